"""The GPU suite's ``embedding`` checks on results written here (no GPU needed): stock
passes as the fault it is only where the ``-1`` row is not a zero row (eager: a fault;
a compiled model may wrap ``-1`` to the last row instead), and patched only with the
zero row and exact valid rows."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import suite  # noqa: E402

FAULT = {"completed": False, "error": "AcceleratorError: CUDA error: device-side assert"}


def verdict(check: str, job: str, result: dict) -> bool:
    outcome = suite.Outcome(result, None, "", 1.0, 0)
    return suite.CHECKS[check]({job: outcome})[0]


def served(compiled: bool, zero: bool, exact: bool = True) -> dict:
    return {
        "completed": True,
        "compiled": compiled,
        "valid_rows_equal": exact,
        "invalid_row_zero": zero,
    }


def test_stock_passes_as_a_fault_or_a_wrong_row_only():
    eager = "embedding: stock faults on a -1 id at tp 1"
    compiled = "embedding (compiled model): stock faults or returns a row for a -1 id"
    assert verdict(eager, "embedding-stock", FAULT)
    assert not verdict(eager, "embedding-stock", served(False, zero=False))
    assert verdict(compiled, "embedding-stock-compiled", {**FAULT, "compiled": True})
    assert verdict(compiled, "embedding-stock-compiled", served(True, zero=False))
    assert not verdict(compiled, "embedding-stock-compiled", served(True, zero=True))


def test_patched_needs_the_zero_row_and_exact_rows():
    check = "embedding (compiled model): patched zeroes it, valid rows exact"
    assert verdict(check, "embedding-overlay-compiled", served(True, zero=True))
    assert not verdict(check, "embedding-overlay-compiled", served(True, zero=False))
    assert not verdict(check, "embedding-overlay-compiled", served(True, True, exact=False))
    assert not verdict(check, "embedding-overlay-compiled", {**FAULT, "compiled": True})
