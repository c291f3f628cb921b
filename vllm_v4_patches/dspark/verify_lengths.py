"""The paper's Algorithm 1: how many of each request's drafts to verify.

Given each request's survival scores (the cumulative products of the confidence
head's per-slot acceptance estimates) and ``SPS(B)``, steps per second for a batch of
``B`` verify tokens, slots are admitted in descending survival while the expected
tokens per second improve (``docs/dspark.md``). Plain Python, and numpy for the
vectorised form serving uses; :mod:`vllm_v4_patches.dspark.verify` owns when it runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

# A profiled steps-per-second curve: a callable, or a table indexed by the number of
# tokens in the verify batch (``table[B]``).
StepsPerSecond = Callable[[int], float] | Sequence[float] | Mapping[int, float]


def _steps_per_second_lookup(steps_per_second: StepsPerSecond) -> Callable[[int], float]:
    """Normalise a callable / table into ``B -> SPS(B)``."""
    if callable(steps_per_second):
        return lambda batch_tokens: float(steps_per_second(batch_tokens))
    table = steps_per_second
    return lambda batch_tokens: float(table[batch_tokens])


def _as_survival_matrix(survival_scores: object) -> list[list[float]]:
    """A ``[R, N]`` nested list from a tensor, an array or nested sequences."""
    rows = survival_scores.tolist() if hasattr(survival_scores, "tolist") else survival_scores
    matrix = [[float(value) for value in row] for row in rows]
    for request, row in enumerate(matrix):
        # A cumulative product of values in [0, 1] never increases along the block;
        # admission order relies on that to respect per-request prefixes.
        if any(later > earlier for earlier, later in zip(row[:-1], row[1:], strict=True)):
            raise ValueError(f"survival of request {request} increases along the block: {row}")
    return matrix


def choose_verify_lengths(
    survival_scores: object,
    steps_per_second: StepsPerSecond,
    *,
    early_stop: bool = True,
) -> list[int]:
    """Paper Algorithm 1: how many drafts of each request to verify, ``[R]``.

    Slots ``(r, j)`` are admitted in descending survival (ties: lower slot first, then
    lower request), each request keeping a prefix ``l_r``. With ``B = sum(1 + l_r)``
    verify tokens and ``tau = sum(1 + sum_{j < l_r} a_{r,j})`` expected emitted tokens,
    the objective is ``tau * SPS(B)``; admission stops at the first slot that does not
    strictly improve it. The stop makes the decision for a slot independent of that
    slot's own token (non-anticipating), which keeps verification lossless.

    ``early_stop=False`` instead takes the best prefix of the whole admission order
    (a retrospective global search). It is NOT lossless (paper Appendix A) and exists
    only as a negative control for tests.
    """
    sps = _steps_per_second_lookup(steps_per_second)
    matrix = _as_survival_matrix(survival_scores)
    num_requests = len(matrix)
    order = sorted(
        ((request, slot) for request, row in enumerate(matrix) for slot in range(len(row))),
        key=lambda entry: (-matrix[entry[0]][entry[1]], entry[1], entry[0]),
    )
    lengths = [0] * num_requests
    batch_tokens = num_requests  # every request verifies at least its bonus position
    expected_tokens = float(num_requests)
    best_objective = expected_tokens * sps(batch_tokens)
    best_lengths = list(lengths)
    for request, slot in order:
        candidate_objective = (expected_tokens + matrix[request][slot]) * sps(batch_tokens + 1)
        if early_stop and candidate_objective <= best_objective:
            break
        batch_tokens += 1
        expected_tokens += matrix[request][slot]
        lengths[request] = slot + 1
        if candidate_objective > best_objective:
            best_objective = candidate_objective
            best_lengths = list(lengths)
    return best_lengths


def choose_verify_lengths_linear(
    survival_rows: Sequence[Sequence[float]], step_seconds: float, token_seconds: float
) -> list[int]:
    """:func:`choose_verify_lengths` for ``SPS(B) = 1 / (step + token * B)``, vectorised.

    The same admissions, in the same order and with the same floating-point sums
    (a sequential cumulative sum and ``(tau) * (1 / seconds)``), so the same lengths;
    rows may differ in length. Serving uses this: at batch 256 and N = 5 the loop's
    1280 admissions cost about a millisecond of host time per step.
    """
    import numpy as np

    num_requests = len(survival_rows)
    if num_requests == 0:
        return []
    counts = np.fromiter(map(len, survival_rows), dtype=np.int64, count=num_requests)
    values = np.fromiter(itertools.chain.from_iterable(survival_rows), dtype=np.float64)
    requests = np.repeat(np.arange(num_requests), counts)
    slots = np.arange(len(values)) - np.repeat(np.cumsum(counts) - counts, counts)
    rising = np.nonzero((np.diff(values) > 0) & (requests[1:] == requests[:-1]))[0]
    if rising.size:
        request = int(requests[rising[0]])
        raise ValueError(
            f"survival of request {request} increases along the block: "
            f"{list(survival_rows[request])}"
        )
    order = np.lexsort((requests, slots, -values))
    batch_tokens = num_requests + np.arange(len(order) + 1, dtype=np.float64)
    seconds = step_seconds + token_seconds * batch_tokens
    steps_per_second = np.divide(1.0, seconds, out=np.zeros_like(seconds), where=seconds > 0)
    # summed from the request count onwards, one admission at a time, as the loop does
    expected = np.cumsum(np.concatenate([[float(num_requests)], values[order]]))
    objective = expected * steps_per_second
    stops = np.nonzero(objective[1:] <= objective[:-1])[0]
    admitted = int(stops[0]) if stops.size else len(order)
    return np.bincount(requests[order[:admitted]], minlength=num_requests).tolist()
