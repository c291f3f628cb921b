"""The GPU suite's exact-drafting check (``drafts_equal_recompute``) on records in the
shape ``tools/record_dspark_drafts.py --recompute`` writes (no GPU needed; the same
tool's records from a real engine are checked in ``tests/dspark/test_dspark_e2e.py``)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import suite  # noqa: E402


def block(prompt: list[int], anchor: int, scale: float, position: int | None = None) -> dict:
    """A record of one drafted block: two slots of three draft logits each, anchored
    at ``position`` (right after the prompt unless given)."""
    logits = [[scale, 2 * scale, -scale], [0.5 * scale, scale, 3 * scale]]
    return {
        "prompt": prompt,
        "anchor": anchor,
        "anchor_position": len(prompt) if position is None else position,
        "base_logits": logits,
        "drafts": [1, 2],
    }


def run(served_offsets: list[float] | None = None) -> dict:
    """Four served blocks, each with a recompute of its committed prefix; the blocks
    differ from one another by whole units (another context), a served block from
    its recompute by ``served_offsets``."""
    prefixes = [[7], [7, 8], [9], [9, 10, 11]]
    offsets = served_offsets or [0.0] * len(prefixes)
    served = [
        block([7] if p[0] == 7 else [9], 100 + i, 1.0 + i + o, len(p))
        for i, (p, o) in enumerate(zip(prefixes, offsets, strict=True))
    ]
    fresh = [block(p, 100 + i, 1.0 + i) for i, p in enumerate(prefixes)]
    return {"records": served, "prefixes": prefixes, "fresh": {"records": fresh}}


def verdict(result: dict) -> tuple[bool, str]:
    return suite.drafts_equal_recompute(("job",))({"job": suite.Outcome(result, [], "", 1.0, 0)})


def test_blocks_equal_to_their_recompute_pass():
    passed, text = verdict(run([0.0, 1e-4, 0.0, -1e-4]))
    assert passed, text
    assert "4/4 served blocks compared" in text and "4/4 blocks drafted the same tokens" in text


def test_a_block_drafted_on_a_wrong_context_fails():
    passed, text = verdict(run([0.0, 0.0, 0.5, 0.0]))
    assert not passed and "largest logit difference 1.5" in text


def test_a_recompute_anchored_elsewhere_is_left_out_and_too_many_fail():
    """A recompute whose greedy anchor differs drafted from another context: it is
    not compared, and fewer than four in five compared fails the check."""
    result = run([0.0, 0.0, 0.0, 0.5])
    result["fresh"]["records"][3]["anchor"] = 999
    passed, text = verdict(result)
    assert "3/4 served blocks compared" in text and "largest logit difference 0" in text
    assert not passed


def test_too_few_blocks_to_compare_is_missing():
    result = run()
    result["fresh"]["records"] = result["fresh"]["records"][:1]
    with pytest.raises(suite.Missing, match="1 blocks with a recompute"):
        verdict(copy.deepcopy(result))


def test_a_result_over_the_files_limit_is_left_out_and_its_verdict_stands(monkeypatch):
    """The results file must come back from the machine: a result over RESULT_LIMIT
    is replaced by a note, and checks reading it are left out when the file is
    evaluated again (the verdict answered on the machine stands)."""
    outcomes = {"job": suite.Outcome(run([0.5, 0.0, 0.0, 0.0]), [], "", 1.0, 0)}
    assert verdict(outcomes["job"].result)[0] is False
    monkeypatch.setattr(suite, "RESULT_LIMIT", 100)
    saved = suite.saved_results(outcomes)
    assert set(saved["job"]) == {suite.OMITTED}
    reloaded = {"job": suite.Outcome(saved["job"], None, "", 1.0, 0)}
    with pytest.raises(suite.NotSaved):
        suite.drafts_equal_recompute(("job",))(reloaded)
    monkeypatch.setattr(suite, "RESULT_LIMIT", 10**9)
    assert suite.saved_results(outcomes)["job"] is outcomes["job"].result


def served_context_verdict(result: dict) -> tuple[bool, str]:
    check = suite.drafts_equal_recompute(("job",), "fresh_served")
    return check({"job": suite.Outcome(result, [], "", 1.0, 0)})


def with_served_recompute(result: dict, replaced: int, missing: int) -> dict:
    """The same recompute, as the ``--served-context`` pass reports it."""
    served = copy.deepcopy(result["fresh"])
    served["substituted"] = {"replaced": replaced, "missing": missing}
    return {**result, "fresh_served": served}


def test_the_served_context_recompute_is_judged_with_its_row_counts():
    passed, text = served_context_verdict(with_served_recompute(run(), 40, 0))
    assert passed, text
    assert "replaced by the served ones 40, without a served row 0" in text


def test_a_recompute_row_without_a_served_row_fails():
    """A recompute that read its own context for some row compared nothing served."""
    passed, text = served_context_verdict(with_served_recompute(run(), 40, 3))
    assert not passed and "without a served row 3" in text


def test_a_run_without_the_served_context_recompute_is_missing():
    with pytest.raises(suite.Missing, match="no 'fresh_served' recompute"):
        served_context_verdict(run())


def as_sparse(record: dict) -> dict:
    """The record as ``--sparse-logits`` writes it: each slot's non-zero entries."""
    slots = [
        {
            "size": len(slot),
            "ids": [i for i, v in enumerate(slot) if v],
            "values": [v for v in slot if v],
        }
        for slot in record["base_logits"]
    ]
    return {**record, "base_logits": slots}


def test_sparse_logits_give_the_dense_differences():
    served = block([7], 100, 1.0)
    served["base_logits"][0][2] = 0.0  # a zero entry the sparse form leaves out
    twin = block([7], 100, 1.25)
    dense = suite.block_differences(served, twin)
    assert dense == pytest.approx(1.25)  # the zeroed entry against -1.25
    assert suite.block_differences(as_sparse(served), as_sparse(twin)) == dense
    assert suite.block_differences(as_sparse(served), twin) == dense


def test_first_blocks_and_later_blocks_are_reported_apart():
    """Prefixes [7] and [9] are their requests' first blocks (anchored right after the
    prompt); the wrong context is put on a later one."""
    passed, text = verdict(run([0.0, 0.0, 0.0, 0.5]))
    assert not passed
    assert "first blocks 0-0 (2), later blocks 0-1.5 (2)" in text


def test_the_served_context_effect_is_reported_per_recompute_prompt():
    """Own target rows against served rows, per recompute prompt's first block: a
    substitution that changed nothing shows as 0."""
    result = with_served_recompute(run(), 40, 0)
    text = served_context_verdict(result)[1]
    assert "served rows against the recompute's own (4 first blocks): largest 0, median 0" in text
    result["fresh_served"]["records"][2] = block([9], 102, 3.5, 1)
    text = served_context_verdict(result)[1]
    assert "(4 first blocks): largest 1.5, median 0" in text


def noise_run(loop_offset: float, own_offset: float = 0.2) -> dict:
    """Served blocks, their served-row twins off by ``loop_offset`` and their own-row
    twins off by ``own_offset`` more (the target's noise in the context rows)."""
    result = run([loop_offset] * 4)
    served = copy.deepcopy(result["fresh"])
    served["substituted"] = {"replaced": 40, "missing": 0}
    own = [
        block(r["prompt"], r["anchor"], 1.0 + i - own_offset)
        for i, r in enumerate(result["fresh"]["records"])
    ]
    return {**result, "fresh": {"records": own}, "fresh_served": served}


def noise_verdict(result: dict) -> tuple[bool, str]:
    check = suite.drafts_within_noise("job")
    return check({"job": suite.Outcome(result, [], "", 1.0, 0)})


def test_served_blocks_within_the_targets_noise_pass():
    passed, text = noise_verdict(noise_run(0.1))
    assert passed, text
    # a slot's difference is 2 or 3 times the offset (the blocks' logit scales)
    assert "median slot difference served against served-row twin 0.25" in text
    assert "own-row twin against served-row twin 0.5 " in text


def test_a_loop_further_off_than_the_noise_fails():
    passed, text = noise_verdict(noise_run(0.5))
    assert not passed and "served against served-row twin 1.25" in text


def test_noise_as_large_as_another_prefix_tells_nothing_and_fails():
    passed, text = noise_verdict(noise_run(0.1, own_offset=3.0))
    assert not passed and "own-row twin against served-row twin 7.5" in text


def test_a_committed_row_without_a_served_row_fails_the_noise_check():
    result = noise_run(0.1)
    result["fresh_served"]["substituted"]["missing"] = 1
    assert not noise_verdict(result)[0]
