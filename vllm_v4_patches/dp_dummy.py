"""Patch ``dp_dummy``: idle data-parallel ranks run their dummy batch as a decode."""

from __future__ import annotations

import ast
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_v4_patches.errors import ProbeError
from vllm_v4_patches.patcher import split_receiver
from vllm_v4_patches.registry import PatchRecord, ProbeResult, Target
from vllm_v4_patches.sources import (
    SourceReader,
    dotted,
    find_class,
    find_method,
    names_in,
    read_method,
)

if TYPE_CHECKING:
    from vllm_v4_patches.patcher import Patcher

WORKER_MODULE = "vllm.v1.worker.gpu_worker"
WORKER_CLASS, WORKER_METHOD = "Worker", "execute_dummy_batch"
V1_MODULE = "vllm.v1.worker.gpu_model_runner"
V1_METHOD = "_build_attention_metadata"
V2_MODULE = "vllm.v1.worker.gpu.model_runner"
V2_METHOD = "_dummy_run"
RUNNER_CLASS = "GPUModelRunner"

# The smallest context that makes every dummy request a continuation: a decode.
DUMMY_CONTEXT_TOKENS = 1

RECORD = PatchRecord(
    id="dp_dummy",
    toggle="VLLM_V4_PATCH_DP_DUMMY",
    summary="Give an idle data-parallel rank's dummy batch a decode context (seq_len > query_len).",
    why=(
        "A data-parallel rank with nothing scheduled still steps with its peers: "
        "Worker.execute_dummy_batch runs _dummy_run(uniform_decode=True). The attention "
        "metadata of that dummy has seq_len == query_len, no computed tokens and "
        "positions from whatever the buffers last held, and is_prefilling read from "
        "stale persistent-batch rows. Builders that tell decodes from prefills by "
        "computed tokens, context length or is_prefilling (DeepSeek-V4's sparse MLA, "
        "indexer and compressor paths, ATOM's metadata) then run the idle rank down "
        "the prefill path while its peers decode: different kernels, graphs and "
        "collective shapes, so the ranks diverge or hang."
    ),
    how=(
        "Worker.execute_dummy_batch arms a thread-local flag for the duration of the "
        "call. V1: while armed, GPUModelRunner._build_attention_metadata "
        "first gives every dummy request one context token before its query tokens, "
        "consistently: seq_lens (host upper bound and device copy), computed and "
        "prompt token counts (so is_prefilling is False) and positions; the "
        "persistent batch's counts are restored when the build returns. V2 (0.28+): "
        "while armed, GPUModelRunner._dummy_run gets context_len=1, so vLLM's own "
        "set_dummy_context fabricates the context. A context of one token stays "
        "within max_model_len (skipped if the query already fills it) and inside the "
        "dummy's first block; dummy slot mappings stay -1, so nothing is written."
    ),
    upstream=(
        "vllm-project/vllm#37142: decode context for DP dummy batches",
        "vllm-project/vllm#54604 (open): pass context_len from execute_dummy_batch (V2)",
        "ROCm/ATOM#2137: the seed fix",
    ),
    removal_plan=(
        "Drop each variant when upstream gives the dummy a context: the probe reports "
        "not-needed once execute_dummy_batch passes context_len (V2) or _dummy_run stops "
        "setting seq_lens = max_query_len (V1)."
    ),
    targets=(
        Target(WORKER_MODULE, f"{WORKER_CLASS}.{WORKER_METHOD}"),
        Target(V1_MODULE, f"{RUNNER_CLASS}.{V1_METHOD}", runner="V1", shared_with=("dspark",)),
        Target(V2_MODULE, f"{RUNNER_CLASS}.{V2_METHOD}", runner="V2", versions=">=0.28"),
    ),
    vllm_versions=">=0.20.0",
)

_armed = threading.local()
_reported = threading.Event()
logger = logging.getLogger("vllm_v4_patches")


# -- probe ------------------------------------------------------------------


def probe(source: SourceReader) -> ProbeResult:
    dummy_call = _dummy_batch_call(source)
    if dummy_call is None:
        return ProbeResult("absent", f"{WORKER_MODULE}: no {WORKER_CLASS}.{WORKER_METHOD}")
    if any(keyword.arg == "context_len" for keyword in dummy_call.keywords):
        return ProbeResult("not-needed", f"{WORKER_METHOD} passes context_len")
    return ProbeResult.per_runner({"V1": _v1_verdict(source), "V2": _v2_verdict(source)})


def _dummy_batch_call(source: SourceReader) -> ast.Call | None:
    method = read_method(source, WORKER_MODULE, WORKER_CLASS, WORKER_METHOD)
    if method is None:
        return None
    for node in ast.walk(method):
        if isinstance(node, ast.Call) and dotted(node.func).endswith("._dummy_run"):
            return node
    raise ProbeError(f"{WORKER_MODULE}: {WORKER_CLASS}.{WORKER_METHOD} calls no _dummy_run")


def _v1_verdict(source: SourceReader) -> str:
    text = source.read(V1_MODULE)
    runner = find_class(ast.parse(text), RUNNER_CLASS) if text else None
    dummy_run = find_method(runner, "_dummy_run") if runner else None
    if dummy_run is None or find_method(runner, V1_METHOD) is None:
        return "absent"
    if "optimistic_seq_lens_cpu" not in names_in(runner):
        # the host seq_lens this patch extends (vLLM 0.19+); older runners stage
        # seq_lens in a CpuGpuBuffer, outside this patch's version range
        raise ProbeError(f"{V1_MODULE}: {RUNNER_CLASS} has no optimistic_seq_lens_cpu")
    zero_context = any(
        isinstance(node, ast.Assign)
        and any(dotted(target) == "seq_lens" for target in node.targets)
        and dotted(node.value) == "max_query_len"
        for node in ast.walk(dummy_run)
    )
    return "needed" if zero_context else "not-needed"


def _v2_verdict(source: SourceReader) -> str:
    dummy_run = read_method(source, V2_MODULE, RUNNER_CLASS, V2_METHOD)
    if dummy_run is None:
        return "absent"
    parameters = dummy_run.args.args + dummy_run.args.kwonlyargs
    if not any(parameter.arg == "context_len" for parameter in parameters):
        return "absent"  # before 0.28 the V2 dummy cannot be given a context
    return "needed"


# -- apply ------------------------------------------------------------------


def apply(patcher: Patcher, found: ProbeResult) -> str:
    done = []
    how = patcher.wrap_when_imported(WORKER_MODULE, WORKER_CLASS, WORKER_METHOD, arm_during_call)
    done.append(f"{how} {WORKER_CLASS}.{WORKER_METHOD}")
    if found.facts.get("V1") == "needed":
        how = patcher.wrap_when_imported(V1_MODULE, RUNNER_CLASS, V1_METHOD, build_with_context)
        done.append(f"V1 {how} {RUNNER_CLASS}.{V1_METHOD}")
    if found.facts.get("V2") == "needed":
        how = patcher.wrap_when_imported(V2_MODULE, RUNNER_CLASS, V2_METHOD, dummy_with_context)
        done.append(f"V2 {how} {RUNNER_CLASS}.{V2_METHOD}")
    return "; ".join(done)


def is_armed() -> bool:
    return getattr(_armed, "depth", 0) > 0


def arm_during_call(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    _report_first_idle_step()
    _armed.depth = getattr(_armed, "depth", 0) + 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        _armed.depth -= 1


def _report_first_idle_step() -> None:
    if _reported.is_set():
        return
    _reported.set()
    logger.info(
        "vllm_v4_patches: dp_dummy: this rank is idle and runs data-parallel dummy "
        "batches; each dummy request gets a %d-token decode context (logged once)",
        DUMMY_CONTEXT_TOKENS,
    )


def dummy_with_context(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if is_armed() and not kwargs.get("context_len"):
        kwargs = {**kwargs, "context_len": DUMMY_CONTEXT_TOKENS}
    return wrapped(*args, **kwargs)


def build_with_context(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if not is_armed():
        return wrapped(*args, **kwargs)
    runner, _, _ = split_receiver(instance, args)
    restore = give_dummy_requests_context(runner, DUMMY_CONTEXT_TOKENS)
    try:
        return wrapped(*args, **kwargs)
    finally:
        restore()


# -- the V1 dummy context ---------------------------------------------------


def give_dummy_requests_context(runner: Any, context: int) -> Callable[[], None]:
    """Turn the dummy rows vLLM staged into decodes with ``context`` tokens of history.

    Returns the function that puts the persistent batch's counts back.
    """
    import numpy as np

    seq_lens = _host_seq_lens(runner)
    query_start = np.asarray(runner.query_start_loc.np)
    num_reqs = int(np.count_nonzero(seq_lens))  # padded rows are staged as 0
    if num_reqs == 0 or int(seq_lens[:num_reqs].max()) + context > runner.max_model_len:
        return _nothing_to_restore
    query_lens = query_start[1 : num_reqs + 1] - query_start[:num_reqs]
    seq_lens[:num_reqs] += context
    contexts = seq_lens[:num_reqs] - query_lens
    _stage_seq_lens(runner)
    _stage_positions(runner, contexts, query_lens)
    return _mark_computed(runner.input_batch, contexts)


def _nothing_to_restore() -> None:
    return None


def _host_seq_lens(runner: Any) -> Any:
    return runner.optimistic_seq_lens_cpu.numpy()  # shares memory with the tensor


def _stage_seq_lens(runner: Any) -> None:
    runner.seq_lens.copy_(runner.optimistic_seq_lens_cpu, non_blocking=True)


def _stage_positions(runner: Any, contexts: Any, query_lens: Any) -> None:
    import numpy as np
    import torch

    if getattr(runner, "uses_mrope", False):
        return  # M-RoPE positions are per modality; vLLM leaves them to the model
    within_query = np.concatenate([np.arange(n) for n in query_lens])
    positions = np.repeat(contexts, query_lens) + within_query
    target = runner.positions
    target[: len(positions)].copy_(torch.from_numpy(positions).to(target.dtype))


def _mark_computed(input_batch: Any, contexts: Any) -> Callable[[], None]:
    """Computed and prompt counts = the context, so no dummy row looks like a prefill."""
    rows = slice(0, len(contexts))
    counts = [
        array
        for array in (
            input_batch.num_computed_tokens_cpu,
            getattr(input_batch, "num_prompt_tokens", None),
        )
        if array is not None
    ]
    saved = [array[rows].copy() for array in counts]
    for array in counts:
        array[rows] = contexts

    def restore() -> None:
        for array, values in zip(counts, saved, strict=True):
            array[rows] = values

    return restore
