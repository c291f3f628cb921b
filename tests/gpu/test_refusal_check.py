"""The GPU suite's refusal check (``refused_in_one_line``) on logs written here: an
engine that must not start passes only when it exited with a line naming the
refusal (no GPU needed; the lines are the overlay's and stock vLLM 0.26.0's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import suite  # noqa: E402

OURS = "ValueError: speculative_config.num_speculative_tokens=7: vllm_v4_patches' V1 route"
STOCK = "Value error, DSpark requires num_speculative_tokens >= dspark_block_size (5); got 3."


def verdict(name: str, log: str, returncode: int) -> tuple[bool, str]:
    check = suite.CHECKS[f"v4: the overlay's V1 route refuses N={name[-1]} in one line"]
    return check({name: suite.Outcome(None, None, log, 1.0, returncode)})


def test_the_overlays_line_and_stocks_own_both_count():
    assert verdict("v4-dspark-overlay-v1-n7", f"start\n{OURS}\n", 1)[0]
    assert verdict("v4-dspark-overlay-v1-n3", f"start\n{STOCK}\n", 1)[0]


def test_an_engine_that_served_or_died_otherwise_fails():
    assert not verdict("v4-dspark-overlay-v1-n7", f"{OURS}\nRESULT {{}}\n", 0)[0]
    assert not verdict("v4-dspark-overlay-v1-n7", "CUDA error: out of memory\n", 1)[0]
    # the overlay's warning past the block is not a refusal
    warning = "num_speculative_tokens=7 exceeds the draft's block_size=5"
    assert not verdict("v4-dspark-overlay-v1-n7", warning, 1)[0]


def test_a_job_not_run_is_not_answered():
    with pytest.raises(suite.NotRun):
        suite.CHECKS["v4: the overlay's V1 route refuses N=3 in one line"]({})
