"""Confidence-scheduled verification's settings and cost model, and the request-id API."""

from __future__ import annotations

import logging
import threading

import pytest

from vllm_v4_patches import request_ids
from vllm_v4_patches.dspark import verify


def test_mode_defaults_to_verifying_everything(caplog):
    assert verify.verify_mode({}) == "all"
    assert verify.verify_mode({"VLLM_V4_DSPARK_VERIFY": " Confidence "}) == "confidence"
    with caplog.at_level(logging.WARNING, logger="vllm_v4_patches"):
        assert verify.verify_mode({"VLLM_V4_DSPARK_VERIFY": "sometimes"}) == "all"
    [message] = caplog.messages
    assert "VLLM_V4_DSPARK_VERIFY='sometimes'" in message and "all, confidence" in message
    assert "\n" not in message


@pytest.mark.parametrize("raw", ["1", "a,b", "-1,2", "0,0", "1,2,3"])
def test_malformed_cost_is_named_and_measured_instead(raw, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_v4_patches"):
        assert verify.fixed_cost({"VLLM_V4_DSPARK_VERIFY_COST": raw}) is None
    [message] = caplog.messages
    assert "VLLM_V4_DSPARK_VERIFY_COST" in message and "STEP_MS,TOKEN_MS" in message


def test_fixed_cost_model():
    cost = verify.StepCostModel(verify.fixed_cost({"VLLM_V4_DSPARK_VERIFY_COST": "2,0.5"}))
    assert cost.seconds(4) == pytest.approx(0.004)


def test_measured_cost_model_fits_step_periods():
    cost = verify.StepCostModel()
    assert cost.seconds(1) is None
    for tokens in [4, 8, 4, 8, 4, 8, 4, 8, 4]:
        cost.samples.append((tokens, 0.010 + 0.001 * tokens))
    assert cost.seconds(16) == pytest.approx(0.026)
    flat = verify.StepCostModel()
    for _ in range(10):
        flat.samples.append((4, 0.01))
    assert flat.seconds(4) is None  # one batch size: no slope to fit


def test_step_periods_are_attributed_to_the_step_that_ran():
    cost = verify.StepCostModel()
    cost.step_started(5)
    cost.step_started(9)
    [(tokens, seconds)] = cost.samples
    assert tokens == 5 and seconds >= 0


def test_verify_lengths_follow_algorithm_one():
    torch = pytest.importorskip("torch")
    confidence = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.3, 0.9, 0.9, 0.9]])
    steep = verify.StepCostModel((1.0, 1.0))  # a verified token costs as much as a step
    flat = verify.StepCostModel((1.0, 0.0))  # tokens are free
    assert verify.verify_lengths(confidence, flat) == [4, 4]
    lengths = verify.verify_lengths(confidence, steep)
    assert lengths[0] > lengths[1] and max(lengths) < 4
    assert verify.verify_lengths(confidence, verify.StepCostModel()) is None
    assert verify.truncate([[1, 2, 3], [4, 5, 6]], [2, 0]) == [[1, 2], []]


def test_request_ids_are_per_thread_and_nest():
    assert request_ids.current() == ()
    seen = {}
    with request_ids.published(["a", "b"]):
        worker = threading.Thread(target=lambda: seen.update(other=request_ids.current()))
        worker.start()
        worker.join()
        with request_ids.published(["c"]):
            assert request_ids.current() == ("c",)
        assert request_ids.current() == ("a", "b")
    assert request_ids.current() == ()
    assert seen["other"] == ()


def test_lagged_lengths_plan_from_each_requests_older_confidences():
    """Async scheduling: the lengths come from each request's stale confidences (a
    request without them is scored as if every draft survives), capped at the drafts
    the scheduler reserved for it."""
    steep = verify.StepCostModel((1.0, 1.0))
    stale = {"sure": [0.95, 0.95, 0.95, 0.95], "unsure": [0.2, 0.9, 0.9, 0.9]}
    scheduled = {"sure": 4, "unsure": 4, "new": 2}
    lengths = verify.lagged_verify_lengths(scheduled, stale, steep)
    assert list(lengths) == ["sure", "unsure", "new"]
    assert lengths["unsure"] == 0 < lengths["sure"] and lengths["new"] == 2
    assert verify.lagged_verify_lengths(scheduled, stale, verify.StepCostModel((1.0, 0.0))) == (
        scheduled
    )
    assert verify.lagged_verify_lengths(scheduled, stale, verify.StepCostModel()) is None
    rows = verify.survival_rows({"a": [0.5, 0.5, 0.5]}, {"a": 2, "b": 1})
    assert rows == [[0.5, 0.25], [1.0]]


def test_trimming_copies_vllms_scheduler_output_and_counts_what_was_cut():
    """On vLLM's own SchedulerOutput: the engine core's object is left as it was."""
    output_module = pytest.importorskip("vllm.v1.core.sched.output")
    original = output_module.SchedulerOutput.make_empty()
    original.num_scheduled_tokens = {"a": 5, "b": 5, "c": 7}
    original.scheduled_spec_decode_tokens = {"a": [-1] * 4, "b": [-1] * 4}
    original.total_num_scheduled_tokens = 17
    trimmed, scheduled_counts = verify.trim_scheduled_drafts(original, {"a": 1, "b": 0})
    assert scheduled_counts == {"a": 4, "b": 4}
    assert trimmed.num_scheduled_tokens == {"a": 2, "b": 1, "c": 7}
    assert trimmed.scheduled_spec_decode_tokens == {"a": [-1]}
    assert trimmed.total_num_scheduled_tokens == 10
    assert original.num_scheduled_tokens == {"a": 5, "b": 5, "c": 7}
    assert (
        original.total_num_scheduled_tokens == 17
        and len(original.scheduled_spec_decode_tokens) == 2
    )
    untouched, none_cut = verify.trim_scheduled_drafts(original, {"a": 4, "b": 9})
    assert untouched is original and none_cut == {}


def test_confidence_lag_gives_the_snapshot_before_the_newest():
    torch = pytest.importorskip("torch")
    lag = verify.ConfidenceLag()
    first = torch.tensor([[0.9, 0.8], [0.1, 0.2], [0.0, 0.0]])  # third row: padding
    lag.capture(first, ["a", "b"], draft_step=1)
    assert lag.stale() == {}  # the drafts now verified are the first ones seen
    second = torch.tensor([[0.5, 0.5]])
    lag.capture(second, ["a"], draft_step=2)
    lag.capture(torch.tensor([[0.0, 0.0]]), ["a"], draft_step=2)  # same step: ignored
    first.zero_()  # the snapshot is a copy
    stale = lag.stale()
    assert list(stale) == ["a", "b"] and stale["a"] == pytest.approx([0.9, 0.8])
    lag.capture(torch.tensor([[0.3, 0.3]]), ["a"], draft_step=3)
    assert lag.stale() == {"a": [0.5, 0.5]}
    lag.capture(None, [], draft_step=4)
    assert lag.stale() == {"a": [0.5, 0.5]}


def test_large_batches_plan_through_the_vectorised_chooser_with_the_same_lengths():
    torch = pytest.importorskip("torch")
    from vllm_v4_patches.dspark import draft_math, verify_lengths

    confidence = torch.rand(40, 5, generator=torch.Generator().manual_seed(5))
    assert confidence.numel() > verify.VECTORISE_ABOVE_SLOTS
    cost = verify.StepCostModel((20.0, 0.5))
    step, token = cost.coefficients()
    expected = verify_lengths.choose_verify_lengths(
        draft_math.survival(confidence), lambda batch_tokens: 1.0 / (step + token * batch_tokens)
    )
    lengths = verify.verify_lengths(confidence, cost)
    assert lengths == expected and 0 < sum(lengths) < confidence.numel()


def test_the_owner_cuts_plans_counts_and_restarts():
    """ScheduledVerification: synchronous cuts from the newest confidences, async cuts
    of vLLM's SchedulerOutput from the older ones, both counted; restart forgets."""
    torch = pytest.importorskip("torch")
    output_module = pytest.importorskip("vllm.v1.core.sched.output")
    confidence = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.3, 0.9, 0.9, 0.9]])
    sync = verify.ScheduledVerification((1.0, 1.0), lagged=False)
    drafts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    cut = sync.cut_drafts(["a", "b"], drafts, confidence)
    expected = verify.verify_lengths(confidence, verify.StepCostModel((1.0, 1.0)))
    assert [len(ids) for ids in cut] == expected and sync.lengths == dict(
        zip("ab", expected, strict=True)
    )
    assert sync.counts == {"scheduled": 8, "verified": sum(expected)}
    assert sync.cut_drafts(["a"], drafts, confidence) is None  # rows do not match
    sync.restart()
    assert sync.counts == {"scheduled": 0, "verified": 0} and sync.lengths == {}

    lagged = verify.ScheduledVerification((1.0, 1.0), lagged=True)
    assert lagged.cut_drafts(["a", "b"], drafts, confidence) is None  # async cuts steps
    step = output_module.SchedulerOutput.make_empty()
    step.num_scheduled_tokens = {"a": 5, "b": 5}
    step.scheduled_spec_decode_tokens = {"a": [-1] * 4, "b": [-1] * 4}
    step.total_num_scheduled_tokens = 10
    older = torch.tensor([[0.95, 0.95, 0.95, 0.95], [0.05, 0.9, 0.9, 0.9]])
    lagged.cut_step(step, older, ["a", "b"], draft_step=1)  # kept; planned from none
    lagged.restart()
    lagged.cut_step(step, older, ["a", "b"], draft_step=1)
    trimmed, scheduled_counts = lagged.cut_step(step, confidence, ["a", "b"], draft_step=2)
    assert scheduled_counts.get("b") == 4 and "b" not in trimmed.scheduled_spec_decode_tokens
    assert lagged.counts["scheduled"] == 16 and lagged.counts["verified"] < 16  # two cuts


def test_seeded_requests_keep_every_draft():
    """A seeded request's drafts are never cut, sync or async, while its unseeded
    neighbour's plan is Algorithm 1's; without the seed the same request is cut
    (the control), so the exemption is what keeps it whole."""
    torch = pytest.importorskip("torch")
    output_module = pytest.importorskip("vllm.v1.core.sched.output")
    confidence = torch.tensor([[0.3, 0.9, 0.9, 0.9], [0.2, 0.9, 0.9, 0.9]])
    drafts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    planned = verify.verify_lengths(confidence, verify.StepCostModel((1.0, 1.0)))
    assert planned[0] < 4 and planned[1] < 4  # both would be cut
    sync = verify.ScheduledVerification((1.0, 1.0), lagged=False)
    cut = sync.cut_drafts(["a", "b"], drafts, confidence, seeded={"a"})
    assert cut == [[1, 2, 3, 4], drafts[1][: planned[1]]]
    assert sync.counts == {"scheduled": 8, "verified": 4 + planned[1]}

    lagged = verify.ScheduledVerification((1.0, 1.0), lagged=True)
    step = output_module.SchedulerOutput.make_empty()
    step.num_scheduled_tokens = {"a": 5, "b": 5}
    step.scheduled_spec_decode_tokens = {"a": [-1] * 4, "b": [-1] * 4}
    step.total_num_scheduled_tokens = 10
    lagged.cut_step(step, confidence, ["a", "b"], draft_step=1)
    trimmed, _ = lagged.cut_step(step, confidence, ["a", "b"], draft_step=2, seeded={"a"})
    assert trimmed.scheduled_spec_decode_tokens["a"] == [-1] * 4
    assert len(trimmed.scheduled_spec_decode_tokens.get("b", [])) < 4
    control, _ = lagged.cut_step(step, confidence, ["a", "b"], draft_step=3)
    assert len(control.scheduled_spec_decode_tokens.get("a", [])) < 4
