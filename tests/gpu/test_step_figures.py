"""The GPU suite's V4 step-time figure (``step_figures``), on records written here:
the check reads what ``generate.py --step-times`` recorded (no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import suite  # noqa: E402

SHARE = {
    "steps": 6,
    "target_host_ms": 0.9,
    "target_device_ms": 3.0,
    "draft_host_ms": 0.6,
    "draft_device_ms": 0.3,
    "ratio_basis": "device_ms",
    "draft_over_target": 0.1,
}


def figure(step_times: dict | None) -> tuple[bool, str]:
    outcome = suite.Outcome({"step_times": step_times}, [], "", 1.0, 0)
    return suite.step_figures("job")({"job": outcome})


def test_both_batches_give_the_ratio_and_the_per_layer_times():
    depths = {"target_layers": 3, "draft_stages": 3}
    passed, text = figure({"depths": depths, "1": SHARE, "64": {**SHARE, "draft_over_target": 0.2}})
    assert passed
    assert "batch 1: draft/target 0.100 (device, 6 steps)" in text
    assert "target 3.000 ms (1.000 per layer of 3)" in text
    assert "draft 0.300 ms (0.100 per stage of 3)" in text
    assert "batch 64: draft/target 0.200" in text


def test_the_engine_reported_layers_divide_and_the_built_checkpoints_stages():
    """The target's depth is the engine's; the draft's is the built checkpoint's,
    whatever an engine reported (vLLM's loaded V4 config says 1)."""
    passed, text = figure(
        {"depths": {"target_layers": 2, "draft_stages": 1}, "1": SHARE, "64": SHARE}
    )
    stages = suite.V4_DRAFT_STAGES
    assert passed and "(1.500 per layer of 2)" in text
    assert f"({0.3 / stages:.3f} per stage of {stages})" in text
    _, text = figure({"1": SHARE, "64": SHARE})
    assert f"per layer of {suite.V4_LAYERS})" in text
    assert f"per stage of {stages})" in text


def test_a_batch_without_a_step_fails_and_a_run_without_timers_is_missing():
    passed, text = figure({"1": SHARE, "64": {"steps": 0}})
    assert not passed and "batch 64: no step" in text
    with pytest.raises(suite.Missing):
        figure(None)


def test_the_checked_engine_without_its_timer_job_is_not_run():
    """A run with the timer in its own job: the checked engine alone, untimed, is not
    a figure (runs before that job timed inside the checked engine still count)."""
    check = suite.step_figures("timer", "checked")
    untimed = {"checked": suite.Outcome({"step_times": None}, [], "", 1.0, 0)}
    with pytest.raises(suite.NotRun):
        check(untimed)
    timed = {"checked": suite.Outcome({"step_times": {"1": SHARE, "64": SHARE}}, [], "", 1.0, 0)}
    assert check(timed)[0]
