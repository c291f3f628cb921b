"""Patch ``cpu_expand``: the CPU override of the rejection sampler's ``expand_kernel``
writes its result into the output it was given, whatever that output's dtype."""

from __future__ import annotations

import ast
import functools
import inspect
from typing import TYPE_CHECKING, Any

from vllm_v4_patches.registry import PatchRecord, ProbeResult, Target
from vllm_v4_patches.sources import SourceReader, dotted, names_in

if TYPE_CHECKING:
    from vllm_v4_patches.patcher import Patcher

MODULE = "vllm.utils.cpu_triton_utils"
FUNCTION = "_expand_kernel_impl"
# Releases that bind the function into a launcher object at import keep it here
LAUNCHER, LAUNCHER_FIELD = "expand_kernel", "func"

RECORD = PatchRecord(
    id="cpu_expand",
    toggle="VLLM_V4_PATCH_CPU_EXPAND",
    summary="CPU expand_kernel override: expanded values land in the caller's output.",
    why=(
        "Without Triton, vLLM runs the rejection sampler's expand_kernel through a C++ "
        "op that reads and writes int64. Its Python override converts the output and "
        "input to int64 copies and never copies the result back, so a float32 output "
        "(the per-token temperatures expand_batch_to_tokens builds for every batch "
        "with a sampled request under speculative decoding) keeps uninitialised "
        "memory, and a float input is truncated. Every request of such a batch, the "
        "greedy ones included, is then verified against garbage temperatures: "
        "greedy outputs differ from a run without speculation."
    ),
    how=(
        "Wrap the override (the module function where the platform registers it at "
        "worker start, or the launcher object's function where the module binds it at "
        "import): an int64 output and input go to the C++ op unchanged; any other dtype "
        "is expanded with torch (each request's value, replace_from swapped for "
        "replace_to, repeated over its tokens) straight into the output."
    ),
    upstream=("none found: vLLM's CPU override converts without copying back",),
    removal_plan=(
        "The probe reports not-needed once the override writes its result back into "
        "a non-int64 output (or stops converting it)."
    ),
    targets=(
        Target(MODULE, FUNCTION, versions=">=0.31"),
        Target(MODULE, f"{LAUNCHER}.{LAUNCHER_FIELD}", versions="<0.31"),
    ),
    vllm_versions=">=0.10.0",
)


# -- probe ------------------------------------------------------------------


def probe(source: SourceReader) -> ProbeResult:
    text = source.read(MODULE)
    if text is None:
        return ProbeResult("absent", f"{MODULE} does not exist")
    tree = ast.parse(text)
    function = next(
        (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == FUNCTION), None
    )
    if function is None:
        return ProbeResult("absent", f"{MODULE} has no {FUNCTION}")
    output = function.args.args[0].arg if function.args.args else None
    if output is None or not _converts(function, output) or _writes_back(function, output):
        return ProbeResult("not-needed", f"{FUNCTION} writes into its output")
    variant = "launcher" if _binds_launcher(tree) else "registered"
    return ProbeResult(
        "needed",
        f"{FUNCTION} hands the op an int64 copy of {output} and never copies it back",
        variant=variant,
    )


def _converts(function: ast.FunctionDef, output: str) -> bool:
    """Whether a call inside gets ``<something>(output)`` as an argument."""
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            for arg in node.args:
                if isinstance(arg, ast.Call) and [dotted(a) for a in arg.args] == [output]:
                    return True
    return False


def _writes_back(function: ast.FunctionDef, output: str) -> bool:
    """``output.copy_(...)`` or an assignment into ``output[...]``."""
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and dotted(node.func) == f"{output}.copy_":
            return True
        if isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Subscript) and output in names_in(t) for t in targets):
                return True
    return False


def _binds_launcher(tree: ast.Module) -> bool:
    """``expand_kernel = SomeWrapper(_expand_kernel_impl)`` at module level."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and [dotted(t) for t in node.targets] == [LAUNCHER]:
            value = node.value
            if isinstance(value, ast.Call) and [dotted(a) for a in value.args] == [FUNCTION]:
                return True
    return False


# -- apply ------------------------------------------------------------------


def apply(patcher: Patcher, found: ProbeResult) -> str:
    if found.variant == "launcher":
        how = patcher.wrap_when_imported(MODULE, LAUNCHER, LAUNCHER_FIELD, expand_into_output)
        return f"{how} {LAUNCHER}.{LAUNCHER_FIELD}"
    how = patcher.wrap_when_imported(MODULE, "", FUNCTION, expand_into_output)
    return f"{how} {FUNCTION}"


# read once per override: the rejection sampler calls it every speculative step
_signature = functools.cache(inspect.signature)


def expand_into_output(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    import torch

    call = _signature(wrapped).bind(*args, **kwargs).arguments
    output, values, cu_num_tokens, replace_from, replace_to = list(call.values())[:5]
    if output.dtype == torch.int64 and values.dtype == torch.int64:
        return wrapped(*args, **kwargs)
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    replaced = torch.where(values == replace_from, replace_to, values).to(output.dtype)
    expanded = torch.repeat_interleave(replaced, counts)
    output[: expanded.shape[0]].copy_(expanded)
    return None
