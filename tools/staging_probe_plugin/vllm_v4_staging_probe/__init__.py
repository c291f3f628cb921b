"""Test-only vLLM plugin: counts torn reuses of the V1 drafter's pinned staging.

``SpecDecodeBaseProposer.prepare_next_token_ids_padded`` writes each request's
backup token into a pinned host buffer and copies it to the GPU without blocking.
Under async scheduling nothing stops the host from writing the next step's values
while the GPU has not yet run the previous copy; the copy then delivers the new
values (a tear). This plugin wraps that buffer's ``copy_to_gpu`` on every drafter:

* ``pending_at_reuse``: calls made while the previous copy had not run yet, so the
  host had already rewritten the buffer it reads;
* ``torn``: steps whose delivered values differ from what the host wrote for them,
  compared on the device (a clone of the destination enqueued right after the copy
  against the step's values through a fresh pinned tensor), so counting never
  makes the host wait.

``STAGING_PROBE_DELAY_US`` enqueues a GPU sleep of that many microseconds before
each copy: a target whose step takes that long on the device, which gives the race
a window on a tiny model. Read the counts with ``counts(drafter)`` in the worker.
"""

from __future__ import annotations

import os
from typing import Any

DELAY_SETTING = "STAGING_PROBE_DELAY_US"
CLOCK_HZ = 1.98e9  # H200 boost clock: torch.cuda._sleep counts cycles


def register() -> None:
    """The ``vllm.general_plugins`` entry point: runs in every vLLM process."""
    import wrapt

    wrapt.register_post_import_hook(_instrument, "vllm.v1.spec_decode.llm_base_proposer")


def _instrument(module: Any) -> None:
    import wrapt

    def after_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
        wrapped(*args, **kwargs)
        buffer = getattr(instance, "backup_next_token_ids", None)
        if buffer is not None and not hasattr(instance, "staging_probe"):
            instance.staging_probe = StagingProbe(buffer)

    wrapt.wrap_function_wrapper(module, "SpecDecodeBaseProposer.__init__", after_init)


class StagingProbe:
    """Replaces one CpuGpuBuffer's copy_to_gpu with a counting one."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.copy = buffer.copy_to_gpu
        self.delay_cycles = int(float(os.environ.get(DELAY_SETTING, "0")) * 1e-6 * CLOCK_HZ)
        self.calls = 0
        self.pending_at_reuse = 0
        self.previous: Any = None  # event recorded after the previous copy
        self.torn_steps: Any = None  # device counter
        buffer.copy_to_gpu = self

    def __call__(self, n: int | None = None) -> Any:
        import torch

        self.calls += 1
        if self.previous is not None and not self.previous.query():
            self.pending_at_reuse += 1
        if self.delay_cycles:
            torch.cuda._sleep(self.delay_cycles)
        out = self.copy(n)
        count = self.buffer.np.shape[0] if n is None else n
        written = torch.from_numpy(self.buffer.np[:count].copy()).pin_memory()
        expected = written.to(self.buffer.gpu.device, non_blocking=True)
        differs = (self.buffer.gpu[:count] != expected).any().int()
        self.torn_steps = differs if self.torn_steps is None else self.torn_steps + differs
        self.previous = torch.cuda.Event()
        self.previous.record()
        return out


def counts(drafter: Any) -> dict | None:
    """The probe's counts on a drafter (waits for the GPU), or None without one."""
    probe = getattr(drafter, "staging_probe", None)
    if probe is None:
        return None
    torn = 0 if probe.torn_steps is None else int(probe.torn_steps.item())
    return {
        "calls": probe.calls,
        "pending_at_reuse": probe.pending_at_reuse,
        "torn": torn,
        "delay_us": probe.delay_cycles / CLOCK_HZ * 1e6,
    }
