"""The GPU suite's near-tie comparison (``same_until_near_tie``), on recorded data.

Runs anywhere (no GPU): a check reads the records engines wrote. The real records
are the two no-speculation runs of the shrunken DeepSeek-V4 kept from the H200
(2026-12-03); the others are records written here, with gaps chosen on either side
of the threshold.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import record  # noqa: E402
import suite  # noqa: E402

KEPT = REPO / "docs" / "gpu-runs" / "2026-12-03" / "harness-faults"


def outcome(result: dict) -> suite.Outcome:
    return suite.Outcome(result, [], "", 1.0, 0)


def compare(reference: dict, other: dict) -> tuple[bool, str]:
    check = suite.same_until_near_tie("reference", "other")
    return check({"reference": outcome(reference), "other": outcome(other)})


def test_two_h200_runs_without_gaps_fail_where_they_part() -> None:
    """The same V4 engine twice on one machine parted (numeric noise on random
    weights); without the reference's gaps nothing says the parting was a near-tie,
    so the comparison fails and names where."""
    first = record.read_run(KEPT / "0.26.0-v4-3.json.gz")["results"]["v4-nospec-eager"]
    second = record.read_run(KEPT / "0.26.0-v4-4.json.gz")["results"]["v4-nospec-eager"]
    passed, figure = compare(first, second)
    assert not passed
    assert "(0, None)" in figure  # the first sequence parted at its first token
    assert compare(first, first)[0]


def test_a_parting_passes_only_at_a_near_tie() -> None:
    reference = {"token_ids": [[5, 6, 7, 8], [1, 2, 3, 4]], "margins": [[2.0] * 4, [2.0] * 4]}
    parted = {"token_ids": [[5, 6, 9, 9], [1, 2, 3, 4]]}
    reference["margins"][0][2] = suite.NEAR_TIE / 2
    passed, figure = compare(reference, parted)
    assert passed and "1/2 sequences equal" in figure and "6/8 tokens compared" in figure
    reference["margins"][0][2] = suite.NEAR_TIE * 5  # a confident pick differs: lossy
    assert not compare(reference, parted)[0]
