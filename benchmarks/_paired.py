"""Paired timing helpers: alternate A and B, report medians and their ratio."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def paired(run_a: Callable[[], float], run_b: Callable[[], float], pairs: int) -> dict:
    """Alternate A/B (B first on odd pairs) so drift hits both sides alike."""
    times_a: list[float] = []
    times_b: list[float] = []
    for index in range(pairs):
        if index % 2:
            times_b.append(run_b())
            times_a.append(run_a())
        else:
            times_a.append(run_a())
            times_b.append(run_b())
    median_a, median_b = statistics.median(times_a), statistics.median(times_b)
    return {"a": median_a, "b": median_b, "ratio": median_b / median_a, "pairs": pairs}
