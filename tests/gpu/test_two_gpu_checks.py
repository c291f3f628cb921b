"""The GPU suite's two-GPU checks on results written here (no GPU needed): ``dp_dummy``'s
(``idle_rank_dummies``, ``same_answers``, in ``tools/serve_check.py``'s shape) and
DSpark's at tensor parallel size 2 (``ranks_drafted``, in ``tools/generate.py``'s).
A verdict passes only on what it names and fails otherwise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import suite  # noqa: E402

CONTEXT = "dp_dummy/2 GPUs: patched idle-rank dummies have a context (graphs)"
NO_CONTEXT = "dp_dummy/2 GPUs: stock idle-rank dummies have no context (graphs)"
EQUAL = "dp_dummy/2 GPUs: patched DP 2 greedy equals DP 1 (graphs)"


def probe(contexts: list[str], calls: dict | None = None, builds: int = 4) -> dict:
    calls = {"0": 2, "1": 2} if calls is None else calls
    summary = {"calls_by_rank": calls, "builds": builds, "builds_as_decode": builds}
    return {"dummy_batches": {**summary, "contexts_seen": contexts}}


def outcome(result: dict | None) -> suite.Outcome:
    return suite.Outcome(result, [], "", 1.0, 0 if result is not None else 1)


def test_the_context_checks_read_the_builds_they_name():
    assert suite.CHECKS[CONTEXT]({"dp2-overlay": outcome(probe(["[1]"]))})[0]
    assert suite.CHECKS[NO_CONTEXT]({"dp2-stock": outcome(probe(["[0]"]))})[0]
    assert not suite.CHECKS[CONTEXT]({"dp2-overlay": outcome(probe(["[0]"]))})[0]
    assert not suite.CHECKS[CONTEXT]({"dp2-overlay": outcome(probe(["[0]", "[1]"]))})[0]


def test_a_run_where_a_rank_never_idled_or_nothing_was_built_fails():
    one_rank = probe(["[1]"], calls={"1": 5})
    assert not suite.CHECKS[CONTEXT]({"dp2-overlay": outcome(one_rank)})[0]
    assert not suite.CHECKS[CONTEXT]({"dp2-overlay": outcome(probe([], builds=0))})[0]


def test_answers_compare_token_for_token():
    answers = [{"tokens": ["a", "b"], "gaps": [1.0, 1.0]}, {"tokens": ["c"], "gaps": [1.0]}]
    parted = [answers[0], {"tokens": ["d"], "gaps": [1.0]}]
    same = {
        "dp1-mixtral": outcome({"answers": answers}),
        "dp2-overlay": outcome({"answers": answers}),
    }
    assert suite.CHECKS[EQUAL](same) == (True, "2/2 answers equal")
    other = {**same, "dp2-overlay": outcome({"answers": parted})}
    assert suite.CHECKS[EQUAL](other) == (False, "1/2 answers equal")


def test_v4_answers_may_part_at_a_near_tie_only():
    check = suite.CHECKS["dp_dummy/2 GPUs: patched V4 DP 2 greedy equals DP 1 up to near-ties"]
    reference = [{"tokens": ["a", "b", "c"], "gaps": [2.0, 0.05, 2.0]}]
    at_tie = [{"tokens": ["a", "x", "y"], "gaps": [2.0, 2.0, 2.0]}]
    at_wide_gap = [{"tokens": ["x", "b", "c"], "gaps": [2.0, 2.0, 2.0]}]

    def verdict(answers: list[dict]) -> bool:
        runs = {"dp1-v4": outcome({"answers": reference})}
        return check({**runs, "dp2-v4-overlay": outcome({"answers": answers})})[0]

    assert verdict(reference) and verdict(at_tie)
    assert not verdict(at_wide_gap)


def test_a_job_not_run_is_not_answered_and_a_failed_one_is_missing():
    with pytest.raises(suite.NotRun):
        suite.CHECKS[EQUAL]({"dp2-overlay": outcome({"answers": []})})
    with pytest.raises(suite.Missing):
        suite.CHECKS[CONTEXT]({"dp2-overlay": outcome(None)})


def test_two_gpu_jobs_are_left_out_on_one_gpu():
    names = {job.name for job in suite.jobs_for("0.26.0", gpus=1)}
    assert {"dp1-mixtral", "tp1-dspark"} <= names
    assert not {"dp2-overlay", "tp2-dspark"} & names
    assert {"dp2-overlay", "tp2-dspark"} <= {job.name for job in suite.jobs_for("0.26.0", gpus=2)}


SPLIT = "dspark/2 GPUs: the gated head's bias is split over both ranks"
BOTH = "dspark/2 GPUs: both ranks draft"


def drafters(*ranks: tuple[int | None, int]) -> suite.Outcome:
    stats = [{"markov_bias_tp_size": size, "draft_steps": steps} for size, steps in ranks]
    return outcome({"dspark_drafter_ranks": stats})


def test_both_ranks_must_draft_and_split_the_head_where_asked():
    assert suite.CHECKS[SPLIT]({"tp2-dspark-gated": drafters((2, 9), (2, 9))})[0]
    assert not suite.CHECKS[SPLIT]({"tp2-dspark-gated": drafters((None, 9), (None, 9))})[0]
    assert not suite.CHECKS[SPLIT]({"tp2-dspark-gated": drafters((2, 9), (2, 0))})[0]
    assert not suite.CHECKS[SPLIT]({"tp2-dspark-gated": drafters((2, 9))})[0]
    assert suite.CHECKS[BOTH]({"tp2-dspark": drafters((None, 9), (None, 9))})[0]
    assert not suite.CHECKS[BOTH]({"tp2-dspark": outcome({"dspark_drafter_ranks": None})})[0]


WALK = "dspark/2 GPUs: the gated head's shard walk drafts what the loop drafts"
WALK_TIME = "dspark/2 GPUs (diagnostic): shard walk against the loop, draft step"


def drafted(tokens: list, accepted: int, shard_steps: tuple[int, int], steps: int = 9) -> dict:
    ranks = [{"sharded_draft_steps": shard, "draft_steps": steps} for shard in shard_steps]
    counters = {"num_drafts": 30, "num_draft_tokens": 120, "num_accepted_tokens": accepted}
    return {"token_ids": tokens, "spec_decode": counters, "dspark_drafter_ranks": ranks}


def test_the_shard_walk_passes_only_with_the_loops_drafts():
    loop = outcome(drafted([[1, 2]], 50, (0, 0)))

    def verdict(walk: dict) -> bool:
        return suite.CHECKS[WALK](
            {suite.SHARD_WALK_JOB: outcome(walk), suite.SHARD_LOOP_JOB: loop}
        )[0]

    assert verdict(drafted([[1, 2]], 50, (9, 9)))
    assert not verdict(drafted([[1, 3]], 50, (9, 9)))  # other tokens
    assert not verdict(drafted([[1, 2]], 49, (9, 9)))  # other drafts accepted
    assert not verdict(drafted([[1, 2]], 50, (9, 0)))  # one rank gathered instead
    assert not verdict(drafted([[1, 2]], 50, (0, 0)))  # nothing walked shards


def test_the_shard_walk_jobs_are_timed_against_the_loop():
    jobs = {job.name: job for job in suite.jobs_for("0.26.0", gpus=2)}
    walk, loop = jobs[suite.SHARD_WALK_JOB], jobs[suite.SHARD_LOOP_JOB]
    assert loop.env["VLLM_V4_DSPARK_MARKOV_KERNEL"] == "torch"
    assert "VLLM_V4_DSPARK_MARKOV_KERNEL" not in walk.env
    for job in (walk, loop):
        assert "--step-times" in job.args and job.gpus == 2
    share = {"steps": 5, "ratio_basis": "device_ms", "draft_device_ms": 2.0}
    timed = {batch: share for batch in suite.STEP_BATCHES}
    runs = {name: outcome({"step_times": timed}) for name in (walk.name, loop.name)}
    ok, detail = suite.CHECKS[WALK_TIME](runs)
    assert ok and "ratio 1.000" in detail
    runs[walk.name] = outcome({"step_times": {**timed, "64": {"steps": 0}}})
    assert not suite.CHECKS[WALK_TIME](runs)[0]
