"""``generate.step_share``: which records make a step, and the paired ratio, on
records written here (the engine's own records are checked in test_dspark_e2e)."""

from __future__ import annotations

from generate import step_share


def record(role: str, reqs: int, host_ms: float, device_ms: float | None = None) -> dict:
    return {"role": role, "reqs": reqs, "host_ms": host_ms, "device_ms": device_ms}


def test_steps_pair_a_target_forward_with_the_draft_after_it_and_skip_the_prefill():
    records = [
        record("target", 2, 50.0, 40.0),  # the prefill: left out
        record("draft", 2, 9.0, 8.0),
        record("target", 2, 10.0, 8.0),
        record("draft", 2, 2.0, 1.0),
        record("target", 2, 10.0, 10.0),  # no draft after it: not a step
        record("target", 2, 12.0, 10.0),
        record("draft", 2, 3.0, 3.0),
        record("target", 1, 5.0, 5.0),  # one request left: another batch size
        record("draft", 1, 1.0, 1.0),
    ]
    share = step_share(records, 2)
    assert share["steps"] == 2
    assert share["ratio_basis"] == "device_ms"
    # per step 1/8 and 3/10: the median of the two, not the ratio of the medians
    assert abs(share["draft_over_target"] - (1 / 8 + 3 / 10) / 2) < 1e-12
    assert share["target_device_ms"] == 9.0 and share["draft_host_ms"] == 2.5


def test_without_device_times_the_ratio_is_of_host_times_and_no_step_is_no_figure():
    records = [record("target", 1, 4.0), record("draft", 1, 1.0)] * 3
    share = step_share(records, 1)
    assert share["ratio_basis"] == "host_ms" and share["draft_device_ms"] is None
    assert share["steps"] == 2 and share["draft_over_target"] == 0.25
    assert step_share(records, 8) == {"steps": 0}
