"""Patch ``cpu_seed``: a seeded request's discarded sample is undone on the CPU
backend, where torch's generator has no offset to rewind."""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

from vllm_v4_patches.errors import ProbeError
from vllm_v4_patches.registry import PatchRecord, ProbeResult, Target
from vllm_v4_patches.sources import SourceReader, dotted, names_in, read_method

if TYPE_CHECKING:
    from vllm_v4_patches.patcher import Patcher

MODULE = "vllm.v1.worker.gpu_model_runner"
RUNNER = "GPUModelRunner"
SAMPLE, REWIND = "_sample", "_bookkeeping_sync"
# where the runner keeps the rows a step discards: a mask (0.14+), or indices
DISCARD_MASK, DISCARD_INDICES = "discard_request_mask", "discard_request_indices"

RECORD = PatchRecord(
    id="cpu_seed",
    toggle="VLLM_V4_PATCH_CPU_SEED",
    summary="CPU backend: undo a seeded request's discarded sample by restoring its generator.",
    why=(
        "A request whose prompt is prefilled in chunks is sampled at every chunk and "
        "the sample is discarded until the last one. The V1 runner then rewinds the "
        "request's seeded generator with gen.set_offset(gen.get_offset() - 4), which "
        "only a Philox (CUDA) generator supports: torch's CPU generator raises 'CPU "
        "Generator does not use offset', the worker fails and the engine dies. So on "
        "the CPU backend one seeded sampled request meeting chunked prefill (a long "
        "prompt, or a short one arriving when the step's token budget is nearly "
        "spent) takes the server down for every client."
    ),
    how=(
        "Around GPUModelRunner._sample, save the state of every CPU generator of a "
        "row the step discards and restore it once the step has sampled, which undoes "
        "the discarded draw exactly. Around _bookkeeping_sync, take those generators "
        "out of the input batch while its rewind loop runs, and put them back. CUDA "
        "generators are left to vLLM's rewind."
    ),
    upstream=("none found: the rewind assumes a Philox generator",),
    removal_plan=("The probe reports not-needed once _bookkeeping_sync stops calling set_offset."),
    targets=(
        Target(MODULE, f"{RUNNER}.{SAMPLE}", runner="V1"),
        Target(MODULE, f"{RUNNER}.{REWIND}", runner="V1"),
    ),
    # 0.10 rewinds inside execute_model, which this patch does not wrap
    vllm_versions=">=0.11.0",
)


# -- probe ------------------------------------------------------------------


def probe(source: SourceReader) -> ProbeResult:
    rewind = read_method(source, MODULE, RUNNER, REWIND)
    if rewind is None or read_method(source, MODULE, RUNNER, SAMPLE) is None:
        return ProbeResult("absent", f"no {RUNNER}.{REWIND} and {SAMPLE} to wrap")
    if not _rewinds_by_offset(rewind):
        return ProbeResult("not-needed", f"{REWIND} does not rewind generators by offset")
    if not names_in(rewind) & {DISCARD_MASK, DISCARD_INDICES}:
        raise ProbeError(f"{REWIND} rewinds rows read from neither {DISCARD_MASK} nor indices")
    return ProbeResult("needed", f"{REWIND} calls set_offset on every discarded row's generator")


def _rewinds_by_offset(method: ast.AST) -> bool:
    return any(
        isinstance(node, ast.Call) and dotted(node.func).endswith(".set_offset")
        for node in ast.walk(method)
    )


# -- apply ------------------------------------------------------------------


def apply(patcher: Patcher, found: ProbeResult) -> str:
    sample = patcher.wrap_when_imported(MODULE, RUNNER, SAMPLE, sample_then_restore)
    rewind = patcher.wrap_when_imported(MODULE, RUNNER, REWIND, rewind_without_cpu_rows)
    return f"{sample} {RUNNER}.{SAMPLE}; {rewind} {RUNNER}.{REWIND}"


def _discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """Row index -> CPU generator, for the rows this step samples and discards."""
    import numpy as np

    batch = runner.input_batch
    generators = getattr(batch, "generators", None)
    # a CPU runner's generators are CPU ones; any other runner's rewind works
    if not generators or runner.device.type != "cpu":
        return {}
    if hasattr(runner, DISCARD_MASK):
        rows = np.nonzero(getattr(runner, DISCARD_MASK).np[: batch.num_reqs])[0]
    else:
        rows = getattr(runner, DISCARD_INDICES).np[: runner.num_discarded_requests]
    found = {int(i): generators.get(int(i)) for i in rows}
    return {i: g for i, g in found.items() if g is not None}


def sample_then_restore(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    saved = {i: g.get_state() for i, g in _discarded_cpu_generators(instance).items()}
    try:
        return wrapped(*args, **kwargs)
    finally:
        generators = instance.input_batch.generators
        for row, state in saved.items():
            generators[row].set_state(state)


def rewind_without_cpu_rows(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    hidden = _discarded_cpu_generators(instance)
    generators = instance.input_batch.generators
    for row in hidden:
        del generators[row]
    try:
        return wrapped(*args, **kwargs)
    finally:
        generators.update(hidden)
