"""What a check says about an engine that left no result (``result_of``): the fault
that stopped it, not the front end's word on its death. The lines are the shapes
vLLM 0.22.1's logs had on the GPU (no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import suite  # noqa: E402

CORE = "(EngineCore pid=3405) ERROR 12-07 15:30:51 [core.py:1165] "
DEATH = "RuntimeError: Engine core initialization failed. See root cause above."


def figure(log: str, returncode: int = 1) -> str:
    with pytest.raises(suite.Missing) as missing:
        suite.result_of({"job": suite.Outcome(None, None, log, 1.0, returncode)}, "job")
    return str(missing.value)


def test_the_engine_cores_first_error_is_named_not_its_death():
    log = "\n".join(
        [
            f"{CORE}ValueError: too many values to unpack (expected 2)",
            "(EngineCore pid=3405) ValueError: too many values to unpack (expected 2)",
            DEATH,
        ]
    )
    assert (
        figure(log)
        == "job exited 1: " + CORE + "ValueError: too many values to unpack (expected 2)"
    )


def test_dynamos_refusal_counts_as_the_error():
    line = f"{CORE}torch._dynamo.exc.Unsupported: Data-dependent branching"
    assert figure("\n".join([line, DEATH])).endswith("Unsupported: Data-dependent branching")


def test_a_device_fault_wins_and_a_timeout_alone_is_said():
    fault = f"{CORE}torch.AcceleratorError: CUDA error: an illegal memory access"
    assert "CUDA error" in figure("\n".join([f"{CORE}RuntimeError: later", fault, DEATH]))
    assert figure("TIMEOUT after 285s", -9) == "job exited -9: TIMEOUT after 285s"
    assert figure(DEATH) == "job exited 1: " + DEATH  # nothing better to say
