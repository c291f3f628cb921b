"""The GPU suite's teacher-forced lossless checks (``teacher_verdict``,
``teacher_forced_lossless`` and the matrix's use of them) on records written here, in
the shape ``generate.py --teacher-forced`` records (no GPU needed). The same verdict
on real CPU engines, a lossless DSpark against a lossy verifier, is in
``tests/dspark/test_dspark_e2e.py``."""

from __future__ import annotations

import copy
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import suite  # noqa: E402

# another prompt's answers: most tokens plausible there too, a share far off
CONTROL = [[0.0] * 60 + [2.5] * 40]


def scored(gaps: list[list[float]], control: list[list[float]] | None = None) -> dict:
    return {
        "teacher_forced": {"gaps": gaps, "control_gaps": CONTROL if control is None else control}
    }


def outcomes(**records: dict) -> dict[str, suite.Outcome]:
    return {name: suite.Outcome(record, [], "", 1.0, 0) for name, record in records.items()}


def answers(tokens: int, strays: int, gap: float) -> list[list[float]]:
    """One answer of ``tokens`` tokens, ``strays`` of them ``gap`` nats off the pick."""
    return [[gap] * strays + [0.0] * (tokens - strays)]


# stock's own answers: 1,000 tokens, 8 of them 0.6 nats off the target's pick
STOCK = answers(1000, 8, 0.6)[0]


def test_the_rate_test_is_the_exact_conditional_binomial():
    assert suite.excess_chance(10, 100, 0, 100) == pytest.approx(0.5**10)
    assert suite.excess_chance(5, 100, 5, 100) == pytest.approx(638 / 1024)
    assert suite.excess_chance(0, 100, 9, 100) == 1.0
    assert suite.excess_chance(1, 100, 0, 0) == 0.0  # nothing to compare: any stray
    assert suite.fewest_failing(100, 0, 100) == 10  # 0.5**10 < 1e-3 < 0.5**9
    assert suite.binomial_tail(1, 2, 0.5) == pytest.approx(0.75)


def test_answers_straying_as_often_as_stocks_pass_past_stocks_largest_gap():
    """The largest gap is no bound: one token past stock's largest, at stock's rate."""
    gaps = [[0.9] + [0.6] * 7 + [0.0] * 992]
    passed, text = suite.teacher_verdict(scored(gaps)["teacher_forced"], STOCK)
    assert passed, text
    assert "8/1000 tokens not the target's own pick" in text
    assert "largest gap 0.900, stock's 0.600" in text


def test_answers_straying_more_often_than_stocks_fail():
    passed, text = suite.teacher_verdict(scored(answers(1000, 30, 0.7))["teacher_forced"], STOCK)
    assert not passed
    assert "30 past 0.600 nats against stock's 0/1000 (chance 9.3e-10)" in text


def test_a_measure_that_cannot_see_a_lossy_decoder_fails():
    """Another prompt's answers as near the picks as stock's own: no evidence."""
    control = answers(1000, 8, 0.6)
    passed, text = suite.teacher_verdict(
        scored(answers(1000, 8, 0.6), control)["teacher_forced"], STOCK
    )
    assert not passed and "a 50% lossy mix failed with chance 0.00" in text


def test_without_stock_answers_any_stray_past_a_near_tie_fails():
    passed, text = suite.teacher_verdict(scored([[0.0, 0.05] * 50])["teacher_forced"], [])
    assert passed, text
    passed, text = suite.teacher_verdict(scored([[0.0, 0.2] + [0.0] * 98])["teacher_forced"], [])
    assert not passed and "1 past 0.100 nats against stock's 0/0" in text


def test_stock_engines_calibrate_together_and_an_optional_one_counts_where_run():
    check = suite.teacher_forced_lossless("job", ("nospec",), ("stock-dspark",))
    spread = [0.5 + 0.01 * i for i in range(50)]
    nospec, stock_dspark = answers(1000, 8, 0.6), [spread + [0.0] * 950]
    job = scored([spread[20:40] + [0.0] * 980])
    passed, text = check(
        outcomes(job=job, nospec=scored(nospec), **{"stock-dspark": scored(stock_dspark)})
    )
    assert passed, text
    assert "nats against stock's" in text and "/2000 (chance" in text
    assert "nospec 0.600, stock-dspark 0.990" in text
    passed, text = check(outcomes(job=job, nospec=scored(nospec)))
    assert not passed and "20 past 0.600 nats against stock's 0/1000" in text


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
        "phases": {"alone": copy.deepcopy(phase), "shared_prefix": copy.deepcopy(shared)},
    }


def test_the_matrix_scores_each_phase_against_the_references_own_gaps():
    """Token ids differ from the reference in every phase; the scores decide."""
    reference = matrix_record([STOCK])
    job = matrix_record(answers(1000, 5, 0.6))
    for phase in (job, job["phases"]["alone"], job["phases"]["shared_prefix"]):
        phase["token_ids"] = [[9, 9]]
    check = suite.lossless_in_every_phase("ref", "job")
    passed, text = check(outcomes(ref=reference, job=job))
    assert passed, text
    assert text.count("5/1000 tokens not the target's own pick, 0 past 0.600") == 3
    job["phases"]["alone"]["teacher_forced"]["gaps"] = answers(1000, 40, 0.9)
    passed, text = check(outcomes(ref=reference, job=job))
    assert not passed and "alone: 40/1000 tokens not the target's own pick" in text


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


# the 128-expert matrix on vLLM 0.20.2, five times on one H100 (2026-12-07)
KEPT_MATRIX = [
    REPO / "docs" / "gpu-runs" / "2026-12-07" / f"0.20.2-{serial}.json.gz" for serial in range(2, 7)
]
PHASES = ("batch", "alone", "shared_prefix")


def phase_of(record: dict, phase: str) -> dict:
    return record if phase == "batch" else record["phases"][phase]


def test_kept_gpu_runs_pass_against_every_runs_reference_and_a_lossy_splice_fails():
    """Real records: the overlay's answers (N = 5) of each run against the stock
    reference of every run, phase by phase, pass: the verdict does not hang on one
    reference run's noise (their largest gaps ranged 1.535-2.219 nats). The first
    run's batch answers with a tenth of their tokens swapped for control tokens (what
    a verifier letting other answers' tokens through would leave) fail."""
    sys.path.insert(0, str(REPO / "tools" / "gpu"))
    import record

    runs = [record.read_run(path)["results"] for path in KEPT_MATRIX]
    for reference in runs:
        for run in runs:
            for phase in PHASES:
                calibration = suite.flat_gaps(
                    phase_of(reference["v4-matrix-reference"], phase)["teacher_forced"]["gaps"]
                )
                scored = phase_of(run["v4-matrix-n5"], phase)["teacher_forced"]
                passed, text = suite.teacher_verdict(scored, calibration)
                assert passed, f"{phase}: {text}"
    scored = runs[0]["v4-matrix-n5"]["teacher_forced"]
    calibration = suite.flat_gaps(runs[0]["v4-matrix-reference"]["teacher_forced"]["gaps"])
    control = suite.flat_gaps(scored["control_gaps"])
    chooser = random.Random(0)
    spliced = [
        [chooser.choice(control) if chooser.random() < 0.1 else gap for gap in answer]
        for answer in scored["gaps"]
    ]
    passed, text = suite.teacher_verdict({**scored, "gaps": spliced}, calibration)
    assert not passed, text
