"""Patch ``async_sync``: depth-1 CUDA-event guard on reused pinned staging buffers."""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

from vllm_v4_patches.patcher import split_receiver
from vllm_v4_patches.registry import PatchRecord, ProbeResult, Target
from vllm_v4_patches.sources import SourceReader, find_class, find_method, names_in, read_method

if TYPE_CHECKING:
    from vllm_v4_patches.patcher import Patcher

V1_MODULE = "vllm.v1.spec_decode.llm_base_proposer"
V1_CLASS, V1_METHOD = "SpecDecodeBaseProposer", "prepare_next_token_ids_padded"
V2_MODULE = "vllm.v1.worker.gpu.buffer_utils"
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
V2_CLASS, V2_METHOD = "UvaBufferPool", "copy_to_uva"

RECORD = PatchRecord(
    id="async_sync",
    toggle="VLLM_V4_PATCH_ASYNC_SYNC",
    summary="Gate every reuse of a pinned staging buffer behind a depth-1 CUDA event.",
    why=(
        "Under async scheduling the runner skips its per-step host wait on sampled "
        "tokens, so nothing bounds how far the CPU runs ahead of the GPU. A pinned "
        "host buffer that feeds a non-blocking host-to-device copy can then be "
        "rewritten for step N+1 while the GPU still reads it for step N (tearing). "
        "V1 guards its input preparation with prepare_inputs_event, but pinned "
        "writes after that event is recorded are unguarded (the drafter's "
        "backup_next_token_ids in SpecDecodeBaseProposer.prepare_next_token_ids_padded). "
        "V2 relies on rotating UvaBufferPool slots, whose bound is lost when a step "
        "has no sampled-output wait (idle data-parallel dummy runs, encoder-only steps)."
    ),
    how=(
        "V1: around prepare_next_token_ids_padded, synchronize the event recorded "
        "after the previous call's copy_to_gpu before the method writes the pinned "
        "buffer again, and record a new event once its copy is enqueued. V2: in "
        "UvaBufferPool.copy_to_uva, record an event for the slot handed out by the "
        "previous call (its GPU readers are enqueued by then) and synchronize the "
        "event of the slot about to be rewritten. Both wait only for an earlier use "
        "of the same buffer, never for the current step. No-op without CUDA."
    ),
    upstream=(
        "vllm-project/vllm#29288 (open): eagle async scheduling CPU race (V1)",
        "vllm-project/vllm#53057 (closed): V2 pool reuse without a sampled-output wait",
        "vllm-project/vllm#54269 (open): ports prepare_inputs_event to V2",
        "ROCm/ATOM#2137: the seed fix (_V4DecodeMetaBuffers depth-1 event)",
    ),
    removal_plan=(
        "Drop each variant when upstream guards it: the V1 probe looks for an event "
        "or synchronize in prepare_next_token_ids_padded, the V2 probe for one in "
        "UvaBufferPool or a prepare_inputs_event in the V2 runner (#54269)."
    ),
    targets=(
        Target(V1_MODULE, f"{V1_CLASS}.{V1_METHOD}", runner="V1"),
        Target(V2_MODULE, f"{V2_CLASS}.{V2_METHOD}", runner="V2", versions=">=0.14"),
    ),
    vllm_versions=">=0.20.0",
)

_GUARDS = {"synchronize", "Event", "prepare_inputs_event"}


# -- probe ------------------------------------------------------------------


def probe(source: SourceReader) -> ProbeResult:
    return ProbeResult.per_runner({"V1": _v1_verdict(source), "V2": _v2_verdict(source)})


def _v1_verdict(source: SourceReader) -> str:
    method = read_method(source, V1_MODULE, V1_CLASS, V1_METHOD)
    if method is None:
        return "absent"
    return "not-needed" if names_in(method) & _GUARDS else "needed"


def _v2_verdict(source: SourceReader) -> str:
    text = source.read(V2_MODULE)
    pool = find_class(ast.parse(text), V2_CLASS) if text else None
    if pool is None or find_method(pool, V2_METHOD) is None:
        return "absent"
    runner = source.read(V2_RUNNER_MODULE) or ""
    guarded = names_in(pool) & _GUARDS or "prepare_inputs_event" in runner
    return "not-needed" if guarded else "needed"


# -- apply ------------------------------------------------------------------


def apply(patcher: Patcher, found: ProbeResult) -> str:
    done = []
    if found.facts.get("V1") == "needed":
        how = patcher.wrap_when_imported(V1_MODULE, V1_CLASS, V1_METHOD, gate_backup_tokens)
        done.append(f"V1 {how} {V1_CLASS}.{V1_METHOD}")
    if found.facts.get("V2") == "needed":
        how = patcher.wrap_when_imported(V2_MODULE, V2_CLASS, V2_METHOD, gate_pool_slot_reuse)
        done.append(f"V2 {how} {V2_CLASS}.{V2_METHOD}")
    return "; ".join(done)


def new_event() -> Any:
    """A CUDA event, or None where there is no CUDA (the guard is then a no-op)."""
    import torch

    return torch.cuda.Event() if torch.cuda.is_available() else None


def gate_backup_tokens(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    proposer, _, _ = split_receiver(instance, args)
    previous = proposer.__dict__.get("_vllm_v4_backup_event")
    if previous is not None:
        previous.synchronize()  # the last copy out of backup_next_token_ids has landed
    result = wrapped(*args, **kwargs)  # writes the pinned buffer, enqueues copy_to_gpu
    event = previous or new_event()
    if event is not None:
        event.record()
        proposer._vllm_v4_backup_event = event
    return result


def gate_pool_slot_reuse(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    pool, _, _ = split_receiver(instance, args)
    events = pool.__dict__.setdefault("_vllm_v4_slot_events", {})
    handed_out = pool._curr
    if pool.__dict__.get("_vllm_v4_used"):
        # the previous call's readers are enqueued by now: close that slot's use
        event = events.get(handed_out) or new_event()
        if event is not None:
            event.record()
            events[handed_out] = event
    upcoming = (handed_out + 1) % pool.max_concurrency
    if upcoming in events:
        events[upcoming].synchronize()  # its last readers have finished
    pool._vllm_v4_used = True
    return wrapped(*args, **kwargs)
