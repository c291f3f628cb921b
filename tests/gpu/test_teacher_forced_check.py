"""The GPU suite's teacher-forced lossless checks (``teacher_verdict``,
``teacher_forced_lossless`` and the matrix's use of them) on records written here, in
the shape ``generate.py --teacher-forced`` records (no GPU needed). The same verdict
on real CPU engines, a lossless DSpark against a lossy verifier, is in
``tests/dspark/test_dspark_e2e.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import suite  # noqa: E402

# another prompt's answer: gaps the target's own preference gives
CONTROL = [[0.0, 2.5, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.5]]


def scored(gaps: list[list[float]], control: list[list[float]] | None = None) -> dict:
    return {
        "teacher_forced": {"gaps": gaps, "control_gaps": CONTROL if control is None else control}
    }


def outcomes(**records: dict) -> dict[str, suite.Outcome]:
    return {name: suite.Outcome(record, [], "", 1.0, 0) for name, record in records.items()}


def test_answers_of_the_targets_own_picks_pass_and_count_what_differed():
    passed, text = suite.teacher_verdict(scored([[0.0, 0.0], [0.0, 0.05]])["teacher_forced"], 0.1)
    assert passed, text
    assert "1/4 tokens not the target's own pick, largest gap 0.050 nats (bound 0.100)" in text
    assert "control: 3/3 swapped answers past the bound" in text


def test_a_token_past_the_bound_fails():
    passed, text = suite.teacher_verdict(scored([[0.0, 0.4]])["teacher_forced"], 0.1)
    assert not passed and "largest gap 0.400" in text


def test_a_measure_that_cannot_see_a_wrong_token_fails():
    """Controls within the bound: the scoring could not have caught a lossy decoder."""
    flat = [[0.0, 0.05], [0.0, 0.0], [0.02, 0.0]]
    passed, text = suite.teacher_verdict(scored([[0.0]], flat)["teacher_forced"], 0.1)
    assert not passed and "control: 0/3" in text


def test_the_bound_is_stocks_own_largest_gap_and_an_optional_calibrator_counts_where_run():
    check = suite.teacher_forced_lossless("job", ("nospec",), ("stock-dspark",))
    job = scored([[0.0, 0.3]])
    passed, text = check(
        outcomes(job=job, nospec=scored([[0.2]]), **{"stock-dspark": scored([[0.35]])})
    )
    assert passed, text
    assert "bound 0.350" in text and "nospec 0.200, stock-dspark 0.350" in text
    passed, text = check(outcomes(job=job, nospec=scored([[0.2]])))
    assert not passed and "bound 0.200" in text
    passed, text = check(outcomes(job=job, nospec=scored([[0.0]])))
    assert not passed and "bound 0.100" in text  # never below NEAR_TIE


def test_a_run_that_scored_nothing_is_missing():
    check = suite.teacher_forced_lossless("job", ("nospec",))
    with pytest.raises(suite.Missing, match="--teacher-forced"):
        check(outcomes(job={"teacher_forced": None}, nospec=scored([[0.0]])))


def matrix_record(gaps: list[list[float]]) -> dict:
    phase = {"token_ids": [[1, 2]], "margins": [[1.0, 1.0]], **scored(gaps)}
    shared = {**phase, "prefix_tokens": 100, "prefix_queries": 128.0, "prefix_hits": 64.0}
    return {
        **phase,
        "preemptions": 2,
        "phases": {"alone": dict(phase), "shared_prefix": shared},
    }


def test_the_matrix_scores_each_phase_against_the_references_own_gaps():
    """Token ids differ from the reference in every phase; the scores decide."""
    reference = matrix_record([[0.0, 0.25]])
    job = matrix_record([[0.2, 0.0]])
    for phase in (job, job["phases"]["alone"], job["phases"]["shared_prefix"]):
        phase["token_ids"] = [[9, 9]]
    check = suite.lossless_in_every_phase("ref", "job")
    passed, text = check(outcomes(ref=reference, job=job))
    assert passed, text
    assert text.count("bound 0.250") == 3
    job["phases"]["alone"]["teacher_forced"]["gaps"] = [[0.0, 0.9]]
    passed, text = check(outcomes(ref=reference, job=job))
    assert not passed and "largest gap 0.900" in text


def test_a_scoring_that_failed_is_missing_with_its_error():
    """``generate.py`` keeps the run's tokens and records why the scoring stopped."""
    check = suite.teacher_forced_lossless("job", ("nospec",))
    failed = {"teacher_forced": {"error": "ValueError: no prompt logprobs"}}
    with pytest.raises(suite.Missing, match="scoring failed: ValueError: no prompt logprobs"):
        check(outcomes(job=failed, nospec=scored([[0.0]])))
    reference, job = matrix_record([[0.0]]), matrix_record([[0.0]])
    job["phases"]["alone"]["teacher_forced"] = failed["teacher_forced"]
    with pytest.raises(suite.Missing, match="alone: ValueError"):
        suite.lossless_in_every_phase("ref", "job")(outcomes(ref=reference, job=job))
