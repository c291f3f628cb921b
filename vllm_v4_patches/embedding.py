"""Patch ``embedding``: masked vocabulary lookup in ``VocabParallelEmbedding`` at tp_size 1."""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

from vllm_v4_patches.errors import ProbeError
from vllm_v4_patches.patcher import split_receiver
from vllm_v4_patches.registry import PatchRecord, ProbeResult, Target
from vllm_v4_patches.sources import SourceReader, dotted, find_class, find_method

if TYPE_CHECKING:
    from vllm_v4_patches.patcher import Patcher

MODULE = "vllm.model_executor.layers.vocab_parallel_embedding"

RECORD = PatchRecord(
    id="embedding",
    toggle="VLLM_V4_PATCH_EMBEDDING",
    summary="Mask out-of-range token ids in VocabParallelEmbedding at tp_size 1.",
    why=(
        "At tp_size 1 VocabParallelEmbedding looks ids up with a raw gather, while "
        "the TP>1 path masks ids outside its shard. Async scheduling with "
        "speculative decoding can put -1 placeholders into input ids; the raw "
        "gather then reads row -1 (an illegal memory access on GPU, an index error "
        "on CPU). vLLM 0.25+ clamps the target model's ids in the V1 runner only; "
        "drafters, MTP heads and the V2 runner still reach the raw path."
    ),
    how=(
        "Wrap the method holding the tp_size 1 lookup (forward, or forward_native "
        "in the CustomOp releases 0.10.2-0.19.x): ids outside "
        "[0, num_embeddings_per_partition) are clamped into the table and their output "
        "rows are zeroed, the semantics of the TP>1 masked path. Valid ids go "
        "through the unchanged stock lookup, so their rows are bit-identical. "
        "No host-device sync. The wrapper is a plain function, which torch.compile "
        "traces into the compiled model (it skips a wrapt proxy there and runs the "
        "stock lookup)."
    ),
    upstream=(
        "vllm-project/vllm#53977 (open): the same mask inside the layer",
        "vllm-project/vllm#47029 (merged, 0.25.0): clamps main-model ids in the V1 runner",
        "ROCm/ATOM#2137: the seed fix (replicated_embedding)",
    ),
    removal_plan=(
        "Drop once a vLLM release masks at tp_size 1 (#53977); the probe then "
        "reports not-needed on that release by itself."
    ),
    targets=(
        Target(MODULE, "VocabParallelEmbedding.forward", versions="0.10.0-0.10.1.1, 0.20+"),
        Target(MODULE, "VocabParallelEmbedding.forward_native", versions="0.10.2-0.19.x"),
    ),
    vllm_versions=">=0.10.0",
)


# -- probe ------------------------------------------------------------------


def probe(source: SourceReader) -> ProbeResult:
    text = source.read(MODULE)
    if text is None:
        return ProbeResult("absent", f"{MODULE} does not exist")
    cls = find_class(ast.parse(text), "VocabParallelEmbedding")
    if cls is None:
        return ProbeResult("absent", "no class VocabParallelEmbedding")
    # The CustomOp releases keep the lookup in forward_native and define no forward.
    method = find_method(cls, "forward") or find_method(cls, "forward_native")
    if method is None:
        raise ProbeError("VocabParallelEmbedding defines neither forward nor forward_native")
    if not _assigns_self_attribute(cls, "num_embeddings_per_partition"):
        raise ProbeError("VocabParallelEmbedding has no num_embeddings_per_partition")
    form = _unmasked_tp1_form(method)
    where = f"VocabParallelEmbedding.{method.name}"
    if form:
        return ProbeResult(
            "needed",
            f"{where} looks ids up unmasked at tp_size 1 ({form})",
            variant=method.name,
        )
    if _tp1_branch_masks(method):
        return ProbeResult("not-needed", f"{where} already masks ids at tp_size 1")
    raise ProbeError(f"{where}: no recognised tp_size 1 lookup")


def _param_name(method: ast.FunctionDef) -> str:
    args = method.args.args
    if len(args) < 2:
        raise ProbeError(f"{method.name} takes no input argument")
    return args[1].arg


def _tp_compare(test: ast.AST) -> tuple[str, int] | None:
    """('==', 1) for ``self.tp_size == 1``, ('>', 1) for ``self.tp_size > 1``."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    if dotted(test.left) != "self.tp_size":
        return None
    right = test.comparators[0]
    if not (isinstance(right, ast.Constant) and isinstance(right.value, int)):
        return None
    op = {ast.Eq: "==", ast.Gt: ">", ast.NotEq: "!="}.get(type(test.ops[0]))
    return (op, right.value) if op else None


def _tp1_branches(method: ast.FunctionDef) -> list[list[ast.stmt]]:
    """The statement lists that run only at tp_size 1."""
    branches = []
    for node in ast.walk(method):
        if isinstance(node, ast.If):
            compare = _tp_compare(node.test)
            if compare == ("==", 1):
                branches.append(node.body)
            elif compare in ((">", 1), ("!=", 1)):
                branches.append(node.orelse)
    return branches


def _unmasked_tp1_form(method: ast.FunctionDef) -> str | None:
    raw = _param_name(method)
    for branch in _tp1_branches(method):
        for stmt in branch:
            # 0.29+: `if self.tp_size == 1: return ...embedding(self, input_.long())`
            if isinstance(stmt, ast.Return) and _is_raw_lookup(stmt.value, raw):
                return "early-return form"
            # 0.10-0.28: `if self.tp_size > 1: <mask> else: masked_input = input_`
            if (
                isinstance(stmt, ast.Assign)
                and isinstance(stmt.value, ast.Name)
                and stmt.value.id == raw
            ):
                return "else form"
    return None


def _is_raw_lookup(node: ast.AST | None, raw: str) -> bool:
    if not isinstance(node, ast.Call) or not dotted(node.func).endswith(".embedding"):
        return False
    return any(_rooted_at(arg, raw) for arg in node.args)


def _rooted_at(node: ast.AST, name: str) -> bool:
    """``input_`` or ``input_.long()`` style expressions built on ``name`` alone."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        node = node.func.value
    return isinstance(node, ast.Name) and node.id == name


def _tp1_branch_masks(method: ast.FunctionDef) -> bool:
    masking = ("mask", "clamp", "where")
    for branch in _tp1_branches(method):
        for stmt in branch:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Call) and any(
                    word in dotted(node.func).lower() for word in masking
                ):
                    return True
    return False


def _assigns_self_attribute(cls: ast.ClassDef, name: str) -> bool:
    init = find_method(cls, "__init__")
    return init is not None and any(
        isinstance(node, ast.Attribute) and dotted(node) == f"self.{name}"
        for node in ast.walk(init)
    )


# -- apply ------------------------------------------------------------------


def apply(patcher: Patcher, found: ProbeResult) -> str:
    import importlib

    module = importlib.import_module(MODULE)
    # the lookup runs inside the compiled model: a wrapper Dynamo traces
    patcher.wrap(module.VocabParallelEmbedding, found.variant, masked_lookup_at_tp1, traced=True)
    return f"wrapped VocabParallelEmbedding.{found.variant}"


def masked_lookup_at_tp1(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Zero rows for ids outside the table at tp_size 1; TP>1 is left to stock.

    Three extra elementwise ops (clamp, compare, multiply) and no host-device
    sync; valid ids reach the stock lookup unchanged, and multiplying their rows
    by 1 keeps every bit. Multiplying rather than ``masked_fill``: on CPU,
    masked_fill of a bf16 [tokens, hidden] tensor is up to 10x slower than the
    lookup itself. In place, because the lookup's output is a fresh tensor and a
    second [tokens, hidden] allocation costs as much as the lookup on CPU.
    """
    layer, rest, receiver = split_receiver(instance, args)
    if layer.tp_size != 1:
        return wrapped(*args, **kwargs)
    input_ = rest[0] if rest else next(iter(kwargs.values()))
    in_table = input_.clamp(0, layer.num_embeddings_per_partition - 1)
    output = wrapped(*receiver, in_table)
    return output.mul_((in_table == input_).unsqueeze(-1))
