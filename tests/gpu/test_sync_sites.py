"""Where the GPU suite's sync counter says a host sync came from
(``generate.sync_site`` and ``generate.sync_caller``), on stacks built here: CUDA's
sync debug mode warns from inside torch, so the counter walks out to the caller.
No GPU needed (the warnings themselves only come from CUDA)."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import generate  # noqa: E402

TORCH = "/opt/torch/.venv/lib/python3.12/site-packages/torch/cuda/__init__.py"
BUILDER = "/tmp/gpu-site/0.26.0-v4/vllm/v1/attention/backends/mla/indexer.py"


def frame(filename: str, lineno: int) -> traceback.FrameSummary:
    return traceback.FrameSummary(filename, lineno, "f", lookup_line=False)


def test_a_site_is_named_inside_its_package_from_the_last_package_folder():
    assert generate.sync_site(TORCH) == "torch/cuda/__init__.py"
    assert generate.sync_site(BUILDER) == "vllm/v1/attention/backends/mla/indexer.py"
    assert generate.sync_site("/work/x/tools/generate.py") == "generate.py"


def test_the_caller_is_the_innermost_frame_outside_torch_and_the_counter():
    stack = [
        frame("/work/x/tools/generate.py", 10),
        frame(BUILDER, 321),
        frame("/usr/lib/python3.12/warnings.py", 99),
        frame(TORCH, 1270),
        frame("/work/x/tools/generate.py", 380),
    ]
    assert generate.sync_caller(stack, (TORCH, 1270)) == (BUILDER, 321)
    only_torch = [frame(TORCH, 1270), frame("/work/x/tools/generate.py", 380)]
    assert generate.sync_caller(only_torch, (TORCH, 1270)) == (TORCH, 1270)


def named(filename: str, lineno: int, name: str) -> traceback.FrameSummary:
    return traceback.FrameSummary(filename, lineno, name, lookup_line=False)


def test_the_torch_function_called_is_named_beside_the_caller():
    """Outermost first, as ``traceback.extract_stack`` gives it: the builder called
    ``Tensor.tolist``'s wrapper, which synced inside torch."""
    stack = [
        named(BUILDER, 321, "build"),
        named(TORCH, 50, "tolist"),
        named(TORCH, 1270, "_sync"),
        named("/usr/lib/python3.12/warnings.py", 99, "_showwarnmsg"),
        named("/work/x/tools/generate.py", 380, "keep"),
    ]
    assert generate.torch_call(stack) == "tolist"
    assert generate.torch_call([named(BUILDER, 321, "build")]) == "a C-level op"


def test_the_counters_own_switch_of_the_debug_mode_is_not_counted():
    """The H200 run of 2026-12-04 (third hold) named the one sync of 37 target
    builds: the counter's own ``set_sync_debug_mode`` at its first use."""
    runner = "/tmp/gpu-site/0.26.0-v4/vllm/v1/worker/gpu_model_runner.py"
    own = [
        named(runner, 4323, "execute_model"),
        named("/work/x/tools/generate.py", 430, "counted"),
        named(TORCH, 1100, "set_sync_debug_mode"),
        named("/work/x/tools/generate.py", 412, "keep"),
    ]
    assert generate.counted_sync(own, (TORCH, 1100)) is None
    builders = [
        named(BUILDER, 321, "build"),
        named(TORCH, 50, "tolist"),
        named("/work/x/tools/generate.py", 412, "keep"),
    ]
    assert generate.counted_sync(builders, (TORCH, 50)) == (BUILDER, 321, "tolist")
