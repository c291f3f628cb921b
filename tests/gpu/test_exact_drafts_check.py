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


def block(prompt: list[int], anchor: int, scale: float) -> dict:
    """A record of one drafted block: two slots of three draft logits each."""
    logits = [[scale, 2 * scale, -scale], [0.5 * scale, scale, 3 * scale]]
    return {"prompt": prompt, "anchor": anchor, "base_logits": logits, "drafts": [1, 2]}


def run(served_offsets: list[float] | None = None) -> dict:
    """Four served blocks, each with a recompute of its committed prefix; the blocks
    differ from one another by whole units (another context), a served block from
    its recompute by ``served_offsets``."""
    prefixes = [[7], [7, 8], [9], [9, 10, 11]]
    offsets = served_offsets or [0.0] * len(prefixes)
    served = [
        block([7] if p[0] == 7 else [9], 100 + i, 1.0 + i + o)
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
