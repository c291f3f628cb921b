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
