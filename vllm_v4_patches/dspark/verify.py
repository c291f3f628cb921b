"""Confidence-scheduled verification for the V1 DSpark drafter (off by default).

After each draft step the drafter holds, per request, the confidence head's
conditional acceptance estimates; their cumulative products are the survival
scores. The paper's Algorithm 1 (``verify_lengths.choose_verify_lengths``) admits draft
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

Under async scheduling the drafts never reach the host: the scheduler reserves N
placeholder slots per request and the runner fills them on the device. There the
cut happens in the worker, on a copy of the step's scheduler output, just before
the step runs (vLLM's V1 runner trims its GPU n-gram drafts the same way; to the
scheduler an unverified draft is a rejected one). Reading the confidences of the
drafts about to be verified would make the host wait for the device, so each
request's lengths come from its confidences one draft step older
(:class:`ConfidenceLag`), the paper's production idea of planning from stale
confidences. Those were computed before the current draft was sampled, so the
decision still never looks at it: lossless. A request with no older draft is
scored as if every draft would survive.

A request sampled with its own seed keeps every draft: the plan is made across the
batch, so a cut would make its output depend on what it shares a batch with.
"""

from __future__ import annotations

import collections
import copy
import itertools
import logging
import operator
import os
import time
from collections.abc import Collection
from typing import Any

MODE_SETTING = "VLLM_V4_DSPARK_VERIFY"
COST_SETTING = "VLLM_V4_DSPARK_VERIFY_COST"
MODES = ("all", "confidence")
MIN_SAMPLES = 8
VECTORISE_ABOVE_SLOTS = 64

logger = logging.getLogger("vllm_v4_patches")


def verify_mode(env: dict[str, str] | None = None) -> str:
    from vllm_v4_patches.toggles import read_choice

    return read_choice(MODE_SETTING, MODES, "verifying every draft", env)


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
        from vllm_v4_patches.toggles import warn_once

        warn_once(
            COST_SETTING,
            raw,
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

    def coefficients(self) -> tuple[float, float] | None:
        """``(seconds per step, seconds per token)``; None until there is a fit."""
        if self.fixed is not None:
            step_ms, token_ms = self.fixed
            return step_ms / 1e3, token_ms / 1e3
        return self._fit()

    def seconds(self, tokens: int) -> float | None:
        coefficients = self.coefficients()
        return None if coefficients is None else coefficients[0] + coefficients[1] * tokens

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
    from vllm_v4_patches.dspark.draft_math import survival

    return _plan(survival(confidence.float()).tolist(), cost)


def _plan(survival_rows: list[list[float]], cost: StepCostModel) -> list[int] | None:
    """Algorithm 1 under the cost model's ``SPS(B)``; None while it has no estimate.

    Both choosers give the same lengths; below about 64 slots numpy's fixed cost
    makes the plain loop the faster one.
    """
    from vllm_v4_patches.dspark.verify_lengths import (
        choose_verify_lengths,
        choose_verify_lengths_linear,
    )

    coefficients = cost.coefficients()
    if coefficients is None:
        return None
    if sum(map(len, survival_rows)) > VECTORISE_ABOVE_SLOTS:
        return choose_verify_lengths_linear(survival_rows, *coefficients)
    step, token = coefficients

    def steps_per_second(batch_tokens: int) -> float:
        seconds = step + token * batch_tokens
        return 1.0 / seconds if seconds > 0 else 0.0

    return choose_verify_lengths(survival_rows, steps_per_second)


def truncate(draft_ids: list[list[int]], lengths: list[int]) -> list[list[int]]:
    return [ids[:length] for ids, length in zip(draft_ids, lengths, strict=True)]


def survival_rows(
    confidence: dict[str, list[float]], scheduled: dict[str, int]
) -> list[list[float]]:
    """Survival scores for the scheduled drafts of each request, in ``scheduled``'s
    order: cumulative products of its lagged confidences, or ones without them."""
    rows = []
    for req_id, count in scheduled.items():
        row = (confidence.get(req_id) or [1.0] * count)[:count]
        row += [row[-1] if row else 1.0] * (count - len(row))
        rows.append(list(itertools.accumulate(row, operator.mul)))
    return rows


def lagged_verify_lengths(
    scheduled: dict[str, int], confidence: dict[str, list[float]], cost: StepCostModel
) -> dict[str, int] | None:
    """Per-request verify lengths for this step's scheduled drafts, or None (all)."""
    lengths = _plan(survival_rows(confidence, scheduled), cost) if scheduled else None
    return None if lengths is None else dict(zip(scheduled, lengths, strict=True))


def trim_scheduled_drafts(scheduler_output: Any, lengths: dict[str, int]) -> tuple[Any, dict]:
    """A copy of the scheduler output with each request's drafts cut to its length,
    and the scheduled draft count of every request cut.

    The engine core keeps its own object (in-process executors share it): its
    bookkeeping counts every scheduled draft, and unverified ones as rejected.
    """
    drafts = dict(scheduler_output.scheduled_spec_decode_tokens)
    tokens = dict(scheduler_output.num_scheduled_tokens)
    scheduled_counts = {}
    for req_id, length in lengths.items():
        scheduled = drafts.get(req_id) or []
        if length >= len(scheduled):
            continue
        scheduled_counts[req_id] = len(scheduled)
        tokens[req_id] -= len(scheduled) - length
        if length:
            drafts[req_id] = scheduled[:length]
        else:
            del drafts[req_id]
    if not scheduled_counts:
        return scheduler_output, {}
    trimmed = copy.copy(scheduler_output)
    trimmed.scheduled_spec_decode_tokens = drafts
    trimmed.num_scheduled_tokens = tokens
    trimmed.total_num_scheduled_tokens = sum(tokens.values())
    return trimmed, scheduled_counts


class ConfidenceLag:
    """The confidence heads' outputs of the last two draft steps, copied to the host
    without waiting; :meth:`stale` gives the older one by request id.

    ``capture`` is called as each engine step starts, with the drafter's newest
    confidences (those of the drafts this step verifies) and the batch's request
    ids in row order. The copy is queued behind the drafter on the device; the older
    snapshot's copy finished a step ago, so waiting on it costs nothing, and every
    rank of a tensor-parallel group picks the same snapshot.
    """

    def __init__(self) -> None:
        self._captured_step = -1
        # (host confidences, the copy's end event or None, request ids in row order)
        self._newest: tuple[Any, Any, list[str]] | None = None
        self._older: tuple[Any, Any, list[str]] | None = None

    def capture(self, confidence: Any, req_ids: list[str], draft_step: int) -> None:
        if confidence is None or draft_step == self._captured_step:
            return
        self._captured_step = draft_step
        snapshot = None
        if confidence.shape[0] >= len(req_ids):  # rows past the batch are padding
            snapshot = (*_copy_to_host(confidence[: len(req_ids)]), list(req_ids))
        self._older, self._newest = self._newest, snapshot

    def stale(self) -> dict[str, list[float]]:
        if self._older is None:
            return {}
        host, done, req_ids = self._older
        if done is not None:
            done.synchronize()
        return dict(zip(req_ids, host.tolist(), strict=True))


def _copy_to_host(confidence: Any) -> tuple[Any, Any]:
    """(host tensor, event marking the copy's end or None) for a device tensor."""
    import torch

    values = confidence.detach().float()
    if values.device.type != "cuda":
        return values.clone(), None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


class ScheduledVerification:
    """Confidence-scheduled verification of one drafter: the step-cost model, under
    async scheduling the lagged confidences, each request's planned length, and the
    counts of drafts scheduled and verified. The runner's wrappers hand it the
    step's drafts (synchronous) or scheduler output (async) and use what it cuts."""

    def __init__(self, fixed: tuple[float, float] | None, lagged: bool) -> None:
        self.fixed = fixed
        self.lagged = lagged
        self.restart()

    def restart(self) -> None:
        """Cost history, lagged confidences and counts from zero (after the engine
        core's warm-up requests, whose steps include compilation)."""
        self.cost = StepCostModel(self.fixed)
        self.lag = ConfidenceLag() if self.lagged else None
        self.lengths: dict[str, int] = {}  # request id -> drafts verified, last cut
        self.counts = {"scheduled": 0, "verified": 0}  # where a cut was planned

    def cut_drafts(
        self,
        req_ids: list[str],
        draft_token_ids: list[list[int]],
        confidence: Any,
        seeded: Collection[str] = (),
    ) -> list[list[int]] | None:
        """Synchronous scheduling: each request's drafts cut to its admitted prefix
        before the scheduler sees them, or None (verify them all). ``seeded``
        requests keep every draft (``keep_seeded_whole``)."""
        if self.lag is not None or confidence is None or confidence.shape[0] != len(req_ids):
            return None
        lengths = verify_lengths(confidence, self.cost)
        if lengths is None:
            return None  # no cost model yet
        counts = {req_id: len(ids) for req_id, ids in zip(req_ids, draft_token_ids, strict=True)}
        planned = keep_seeded_whole(dict(zip(req_ids, lengths, strict=True)), counts, seeded)
        self._record(planned, sum(counts.values()))
        return truncate(draft_token_ids, list(planned.values()))

    def cut_step(
        self,
        scheduler_output: Any,
        confidence: Any,
        req_ids: list[str],
        draft_step: int,
        seeded: Collection[str] = (),
    ) -> tuple[Any, dict[str, int]]:
        """Async scheduling: keep the newest confidences, then cut this step's
        scheduled drafts to the lengths planned from the older ones; returns the
        step's scheduler output and the scheduled draft count of every request cut.
        ``seeded`` requests keep every draft (``keep_seeded_whole``)."""
        self.lag.capture(confidence, req_ids, draft_step)
        if confidence is None or laid_out_for_every_draft(scheduler_output):
            return scheduler_output, {}
        scheduled = {
            req_id: len(drafts)
            for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items()
            if drafts
        }
        lengths = lagged_verify_lengths(scheduled, self.lag.stale(), self.cost)
        if lengths is None:
            return scheduler_output, {}
        lengths = keep_seeded_whole(lengths, scheduled, seeded)
        self._record(lengths, sum(scheduled.values()))
        return trim_scheduled_drafts(scheduler_output, lengths)

    def _record(self, lengths: dict[str, int], scheduled: int) -> None:
        self.lengths = lengths
        self.counts["scheduled"] += scheduled
        self.counts["verified"] += sum(lengths.values())


def keep_seeded_whole(
    lengths: dict[str, int], scheduled: dict[str, int], seeded: Collection[str]
) -> dict[str, int]:
    """Every draft of a seeded request is verified. Algorithm 1 plans each request's
    length from the whole batch, and a sampled request's random draws follow its
    verified length, so a planned cut would make a seeded request's output depend on
    its neighbours (the soak measured it); a full length depends on nothing else.
    Verifying more drafts than planned keeps verification lossless."""
    return {
        req_id: scheduled[req_id] if req_id in seeded else length
        for req_id, length in lengths.items()
    }


def seeded_requests(runner: Any) -> frozenset[str]:
    """The runner's requests that sample with their own seed (a generator)."""
    return frozenset(
        req_id
        for req_id, state in runner.requests.items()
        if getattr(state, "generator", None) is not None
    )


def laid_out_for_every_draft(scheduler_output: Any) -> bool:
    """Whether the engine core built more of this step around its scheduled drafts
    than the runner's inputs: a grammar bitmask, or a KV connector's plan."""
    return bool(
        getattr(scheduler_output, "has_structured_output_requests", False)
        or getattr(scheduler_output, "structured_output_request_ids", None)
        or getattr(scheduler_output, "kv_connector_metadata", None) is not None
    )
