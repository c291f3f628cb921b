"""Patch ``flex_graphs``: no multi-token full CUDA graphs for FlexAttention where
its persistent metadata is re-strided at every step, and a Dynamo recompile limit
that speculative batch shapes fit in (vLLM 0.20.x)."""

from __future__ import annotations

import ast
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_v4_patches.registry import PatchRecord, ProbeResult, Target
from vllm_v4_patches.sources import SourceReader, dotted, find_class

if TYPE_CHECKING:
    from vllm_v4_patches.patcher import Patcher

MODULE = "vllm.v1.attention.backends.flex_attention"
BUILDER = "FlexAttentionMetadataBuilder"
SUPPORT = "get_cudagraph_support"
COPY = "copy_to_persistent"
# what the builder answers instead of ALWAYS: full graphs only for one-token decode
CAPPED = "UNIFORM_SINGLE_TOKEN_DECODE"
RECOMPILE_LIMIT = "torch._dynamo.config.recompile_limit"
# compiled variants of flex_attention a speculative engine may need: two dispatch-key
# sets of the metadata's tensors (target and drafter) times the size classes Dynamo
# specialises (1, 2-127, 128 and more query tokens; one block or several)
RECOMPILE_BUDGET = 64

RECORD = PatchRecord(
    id="flex_graphs",
    toggle="VLLM_V4_PATCH_FLEX_GRAPHS",
    summary="FlexAttention: keep multi-token batches out of full CUDA graphs on vLLM 0.20.x.",
    why=(
        "vLLM 0.20.0 declared FlexAttention fit for every full CUDA graph, but its "
        "builder still copies the block mask into the graph's persistent buffers by "
        "re-striding them to each step's shape (copy_to_persistent with as_strided), "
        "so a replayed graph reads them with the strides of its capture. On 0.20.x a "
        "DFlash drafter (the overlay's DSpark route on V1 included) makes every "
        "layer require non-causal attention, so a float32 target lands on "
        "FlexAttention too. Measured on an H200 with 0.20.2: vLLM's own DFlash and "
        "DSpark die with an illegal memory access in the target's full-graph replay "
        "once a speculative batch shrinks, with FULL_AND_PIECEWISE and with "
        "FULL_DECODE_ONLY; with piecewise graphs only, both give greedy output equal "
        "to no speculation. The same module sets Dynamo's recompile limit to 16, and "
        "its compiled flex_attention recompiles per shape class and per dispatch-key "
        "set of the metadata's tensors, which differ between the target's and the "
        "drafter's calls: vLLM's own DFlash needed 13 recompiles for batches of 1, 16 "
        "and 64, and DSpark's warm-up over every batch size stops the engine at the "
        "limit (FailOnRecompileLimitHit)."
    ),
    how=(
        "Wrap FlexAttentionMetadataBuilder.get_cudagraph_support: where it answers "
        "ALWAYS, answer UNIFORM_SINGLE_TOKEN_DECODE. The runner's own resolution "
        "(CompilationConfig.resolve_cudagraph_mode_and_sizes) then keeps "
        "speculative (multi-token) decode batches and mixed batches out of full "
        "graphs (piecewise graphs, or none where attention is not split out), "
        "logging its own warning. Other backends, and full graphs of one-token "
        "decode batches, are left as they are: the fault was seen with "
        "speculative batches, and one-token full graphs were not measured. Once the "
        "module is imported, raise torch._dynamo.config.recompile_limit to 64 where it "
        "is lower (revert restores it): more variants compile, none computes "
        "differently."
    ),
    upstream=(
        "vLLM 0.21.0: copy_to_persistent writes into a slice of the persistent "
        "buffer instead of re-striding it",
        "vLLM 0.21.0 (#39930): only the drafter's layers require non-causal "
        "attention, so a DFlash target is no longer moved to FlexAttention",
    ),
    removal_plan=(
        "0.21.0 and later report not-needed by the probe; drop the patch with "
        "support for 0.20.x."
    ),
    targets=(Target(MODULE, f"{BUILDER}.{SUPPORT}"),),
    vllm_versions=">=0.20.0",
)

logger = logging.getLogger("vllm_v4_patches")


# -- probe ------------------------------------------------------------------


def probe(source: SourceReader) -> ProbeResult:
    text = source.read(MODULE)
    if text is None:
        return ProbeResult("absent", f"{MODULE} does not exist")
    tree = ast.parse(text)
    builder = find_class(tree, BUILDER)
    if builder is None:
        return ProbeResult("absent", f"no class {BUILDER}")
    support = _declared_support(builder)
    if support != "ALWAYS":
        return ProbeResult("not-needed", f"{BUILDER} declares {support or 'no'} graph support")
    copy = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == COPY), None)
    if copy is None:
        return ProbeResult("not-needed", f"no {COPY}: the builder keeps no re-strided buffers")
    if not any(
        isinstance(n, ast.Call) and dotted(n.func).endswith(".as_strided") for n in ast.walk(copy)
    ):
        return ProbeResult("not-needed", f"{COPY} writes into the buffer without re-striding it")
    return ProbeResult(
        "needed", f"{BUILDER} declares ALWAYS while {COPY} re-strides the persistent buffers"
    )


def _declared_support(builder: ast.ClassDef) -> str | None:
    """``ALWAYS`` for ``_cudagraph_support = AttentionCGSupport.ALWAYS`` in the class."""
    for node in builder.body:
        target = getattr(node, "target", None) or next(iter(getattr(node, "targets", [])), None)
        value = getattr(node, "value", None)
        if dotted(target) == "_cudagraph_support" and value is not None:
            return dotted(value).rsplit(".", 1)[-1]
    return None


# -- apply ------------------------------------------------------------------


def apply(patcher: Patcher, found: ProbeResult) -> str:
    how = patcher.wrap_when_imported(MODULE, BUILDER, SUPPORT, capped_support)
    raised = patcher.register_when_imported(MODULE, RECOMPILE_LIMIT, raise_recompile_limit)
    return f"{how} {BUILDER}.{SUPPORT}; {raised} {RECOMPILE_LIMIT} >= {RECOMPILE_BUDGET}"


def raise_recompile_limit(module: Any) -> Callable[[], None]:
    """Raise Dynamo's limit after the module set its own; the undo restores it."""
    import torch._dynamo

    config = torch._dynamo.config
    before = config.recompile_limit
    config.recompile_limit = max(before, RECOMPILE_BUDGET)
    ours = config.recompile_limit

    def undo() -> None:
        if config.recompile_limit == ours:  # not if something set it since
            config.recompile_limit = before

    return undo


def capped_support(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    support = wrapped(*args, **kwargs)
    if getattr(support, "name", None) != "ALWAYS":
        return support
    capped = type(support)[CAPPED]
    if not _told[0]:
        _told[0] = True
        logger.warning(
            "vllm_v4_patches: flex_graphs: FlexAttention's full CUDA graphs are limited "
            "to one-token decode batches on this release (its persistent block-mask "
            "buffers are re-strided per step); speculative and mixed batches run "
            "piecewise"
        )
    return capped


_told = [False]
