"""Benchmark-only vLLM plugin: a target whose forward costs more device time.

The tiny models' steps are bound by host work (a few percent of the wall time is
device time), which is the one regime where speculative decoding cannot pay: the
work it saves is device work. Real targets are the other way round: a large model's
decode step is bound by reading its weights, and costs about the same for one token
per request as for the five a verification step scores.

With ``HEAVY_TARGET_US`` set, the V1 runner's ``_model_forward`` enqueues a GPU sleep
of that many microseconds before every target forward (never inside a CUDA graph
capture), the same for one token or many. Tokens are unchanged; the draft's forward
is not touched. A figure measured with it is labelled as emulated.
"""

from __future__ import annotations

import os
from typing import Any

SETTING = "HEAVY_TARGET_US"
CLOCK_HZ = 1.98e9  # H200 boost clock: torch.cuda._sleep counts cycles


def register() -> None:
    """The ``vllm.general_plugins`` entry point: runs in every vLLM process."""
    if not float(os.environ.get(SETTING, "0") or 0):
        return
    import wrapt

    wrapt.register_post_import_hook(_instrument, "vllm.v1.worker.gpu_model_runner")


def _instrument(module: Any) -> None:
    import torch
    import wrapt

    cycles = int(float(os.environ[SETTING]) * 1e-6 * CLOCK_HZ)

    def slower(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda._sleep(cycles)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(module, "GPUModelRunner._model_forward", slower)
