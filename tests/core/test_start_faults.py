"""Which engine start-up failures get one more try, and what is kept of them: on
outputs shaped as vLLM prints them (real engine deaths cannot be caused on purpose
without killing a worker, which is a different failure)."""

from __future__ import annotations

import start_faults

WORKER_DEATH = """\
(EngineCore pid=2174) INFO 12-03 16:11:02 [core.py:99] warming up
Fatal Python error: Segmentation fault

Current thread 0x00007f (most recent call first):
  File "torch/_inductor/codecache.py", line 2301 in load
  File "vllm/v1/worker/cpu_model_runner.py", line 90 in warming_up_model
(EngineCore pid=2174) ERROR 12-03 16:11:16 [multiproc_executor.py:315] Worker proc \
VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.
(EngineCore pid=2174) ERROR 12-03 16:11:16 [core.py:1510] EngineCore failed to start.
"""


def test_a_worker_death_and_the_port_race_are_retried_and_nothing_else_is():
    assert start_faults.retry_reason(WORKER_DEATH) == "a worker died during start-up"
    race = "OSError: [Errno 98] EADDRINUSE: address already in use"
    assert start_faults.retry_reason(race) == "torch.distributed port race (EADDRINUSE)"
    bad_config = "ValueError: VLLM_V4_DSPARK_VERIFY must be one of off, confidence"
    assert start_faults.retry_reason(bad_config) is None
    assert start_faults.retry_reason("") is None


def test_the_evidence_keeps_the_fatal_signal_and_its_stack_and_drops_the_rest():
    found = start_faults.evidence(WORKER_DEATH).splitlines()
    assert "Fatal Python error: Segmentation fault" in found
    assert any("line 90 in warming_up_model" in line for line in found)
    assert any("died unexpectedly" in line for line in found)
    assert not any("warming up" in line for line in found)
    assert all(
        line.startswith("kernel: ") for line in start_faults.evidence("all well").splitlines()
    )


def test_a_recursion_in_the_dump_is_kept_once_with_its_count():
    frame = ['  File "vllm_v4_patches/x.py", line 7 in __getattr__']
    dump = ["Fatal Python error: _Py_CheckRecursiveCall: Cannot recover from stack overflow."]
    dump += ["", "Current thread 0x01 (most recent call first):", *frame * 50, "  ..."]
    found = start_faults.evidence("\n".join(dump)).splitlines()
    assert found.count(frame[0]) == 1
    assert "  [the 1 line(s) above repeated 49 more times]" in found
    assert found[-1] == "  ..." or found[-1].startswith("kernel: ")
