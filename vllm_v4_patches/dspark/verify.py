"""Confidence-scheduled verification for the V1 DSpark drafter (off by default).

After each draft step the drafter holds, per request, the confidence head's
conditional acceptance estimates; their cumulative products are the survival
scores. The paper's Algorithm 1 (``heads.choose_verify_lengths``) admits draft
slots in descending survival while the expected tokens per second,
``tau(B) * SPS(B)``, improves, and stops at the first admission that does not;
each request's drafts are cut to its admitted prefix before the scheduler sees
them. The decision depends on the confidences (computed from the slots before
each draft, never from the draft itself being right), so rejection sampling stays
lossless.

``SPS(B)``, steps per second for a batch of B tokens, comes from a fixed cost model
(``VLLM_V4_DSPARK_VERIFY_COST``) or, by default, from the engine's own step
periods fitted as ``a + b * B`` over recent steps. Until the fit has enough
samples, every draft is verified.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from typing import Any

MODE_SETTING = "VLLM_V4_DSPARK_VERIFY"
COST_SETTING = "VLLM_V4_DSPARK_VERIFY_COST"
MODES = ("all", "confidence")
MIN_SAMPLES = 8

logger = logging.getLogger("vllm_v4_patches")


def verify_mode(env: dict[str, str] | None = None) -> str:
    raw = (os.environ if env is None else env).get(MODE_SETTING, "").strip().lower()
    if raw in MODES:
        return raw
    if raw:
        logger.warning(
            "vllm_v4_patches: %s=%r is not one of %s; verifying every draft",
            MODE_SETTING,
            raw,
            ", ".join(MODES),
        )
    return "all"


def fixed_cost(env: dict[str, str] | None = None) -> tuple[float, float] | None:
    """``(ms per step, ms per token)`` from the setting, or None (measure instead)."""
    raw = (os.environ if env is None else env).get(COST_SETTING, "").strip()
    if not raw:
        return None
    try:
        step_ms, token_ms = (float(part) for part in raw.split(","))
    except ValueError:
        step_ms = token_ms = -1.0
    if step_ms < 0 or token_ms < 0 or step_ms + token_ms <= 0:
        logger.warning(
            "vllm_v4_patches: %s=%r is not 'STEP_MS,TOKEN_MS' (two non-negative numbers, "
            "not both 0); measuring the step cost instead",
            COST_SETTING,
            raw,
        )
        return None
    return step_ms, token_ms


class StepCostModel:
    """Seconds per engine step as ``a + b * tokens``: fixed, or fitted to step periods."""

    def __init__(self, fixed: tuple[float, float] | None = None, window: int = 64) -> None:
        self.fixed = fixed
        self.samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self._last_start: float | None = None
        self._last_tokens = 0

    def step_started(self, tokens: int) -> None:
        """Called as each step starts: the previous step's period ends here."""
        now = time.perf_counter()
        if self._last_start is not None and self._last_tokens > 0:
            self.samples.append((self._last_tokens, now - self._last_start))
        self._last_start, self._last_tokens = now, tokens

    def seconds(self, tokens: int) -> float | None:
        if self.fixed is not None:
            step_ms, token_ms = self.fixed
            return (step_ms + token_ms * tokens) / 1e3
        fit = self._fit()
        return None if fit is None else fit[0] + fit[1] * tokens

    def _fit(self) -> tuple[float, float] | None:
        if len(self.samples) < MIN_SAMPLES or len({t for t, _ in self.samples}) < 2:
            return None
        count = len(self.samples)
        mean_t = sum(t for t, _ in self.samples) / count
        mean_s = sum(s for _, s in self.samples) / count
        spread = sum((t - mean_t) ** 2 for t, _ in self.samples)
        slope = max(sum((t - mean_t) * (s - mean_s) for t, s in self.samples) / spread, 0.0)
        intercept = mean_s - slope * mean_t
        return (intercept, slope) if intercept + slope > 0 else None


def verify_lengths(confidence: Any, cost: StepCostModel) -> list[int] | None:
    """Per-request verify lengths for ``confidence [R, N]``, or None to verify all."""
    from vllm_v4_patches.dspark.heads import choose_verify_lengths, survival

    if cost.seconds(1) is None:
        return None
    scores = survival(confidence.float()).tolist()
    return choose_verify_lengths(scores, _steps_per_second(cost))


def _steps_per_second(cost: StepCostModel) -> Callable[[int], float]:
    def steps_per_second(tokens: int) -> float:
        seconds = cost.seconds(tokens)
        return 0.0 if not seconds or seconds <= 0 else 1.0 / seconds

    return steps_per_second


def truncate(draft_ids: list[list[int]], lengths: list[int]) -> list[list[int]]:
    return [ids[:length] for ids, length in zip(draft_ids, lengths, strict=True)]
