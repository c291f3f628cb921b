"""The release's DeepSeek-V4 blocks as the overlay's own V4 draft route uses them,
on releases with V4 but no V4 draft class (0.20-0.24).

The same blocks move and change shape across those releases:

* the model module: ``vllm.model_executor.models.deepseek_v4`` (0.20-0.21), then
  ``vllm.models.deepseek_v4.nvidia.model``;
* the decoder layer: 0.20's returns its streams mixed; later ones return
  ``(streams, residual, post_mix, res_mix)`` and leave the last post-mix to their
  caller, which is the layer's own ``hc_post`` (0.21-0.22) or the model module's
  ``mhc_post_tilelang`` (0.23+);
* the head reduction of the streams: the model module's ``hc_head`` (0.20-0.21),
  ``HCHeadOp`` (0.22) or ``hc_head_fused_kernel_tilelang`` (0.23+);
* the sliding-window cache and its fused K/V insert: on the attention wrapper under
  the layer's ``attn`` (``attn.mla_attn``, 0.20-0.22), on ``attn`` itself (0.23+).

``model_module`` is the source probe (which module has every block, else None);
the run-time helpers look the same names up, in the same order, on the objects the
release built. Nothing here imports vLLM or torch at import time.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from types import SimpleNamespace
from typing import Any

from vllm_v4_patches.sources import SourceReader, find_class, find_method, names_in

MODEL_MODULES = ("vllm.models.deepseek_v4.nvidia.model", "vllm.model_executor.models.deepseek_v4")
ATTENTION_MODULES = (
    "vllm.models.deepseek_v4.attention",
    "vllm.model_executor.layers.deepseek_v4_attention",
)
SWA_BUILDER_MODULE = "vllm.v1.attention.backends.mla.sparse_swa"
SWA_BUILDER = "DeepseekSparseSWAMetadataBuilder"
TARGET_CLASS = "DeepseekV4ForCausalLM"
LAYER_CLASS = "DeepseekV4DecoderLayer"
MODEL_CLASS = "DeepseekV4Model"
MIXED_LAYER_ARGS = ("x", "positions", "input_ids")
DEFERRED_LAYER_ARGS = ("x", "positions", "input_ids", "post_mix", "res_mix", "residual")
# the loader methods the stage stack borrows; the helpers only where the loader has them
LOADER_METHODS = ("load_weights", "get_expert_mapping")
LOADER_HELPERS = ("_pad_shared_expert_weight",)
LAYER_POST = "hc_post"  # the layer's own last post-mix (0.21-0.22)
MODULE_POST = "mhc_post_tilelang"  # the model module's (0.23+)
HEAD_NAMES = ("hc_head_fused_kernel_tilelang", "hc_head", "HCHeadOp")  # looked up in order
KV_INSERT = "_fused_qnorm_rope_kv_insert"
KV_INSERT_ARGS = ("q", "kv", "positions", "attn_metadata")


# -- source probe --------------------------------------------------------------


def model_module(source: SourceReader) -> str | None:
    """The V4 model module whose blocks the overlay's V4 draft class can build on,
    with an attention module and a sliding-window builder to match; else None."""
    if not (_has_kv_insert(source) and _has_decode_indices(source)):
        return None
    for module in MODEL_MODULES:
        text = source.read(module)
        if text and _has_model_blocks(ast.parse(text)):
            return module
    return None


def _has_model_blocks(tree: ast.Module) -> bool:
    classes = (LAYER_CLASS, MODEL_CLASS, TARGET_CLASS)
    layer, inner, target = (find_class(tree, name) for name in classes)
    if layer is None or inner is None or target is None:
        return False
    forward = find_method(layer, "forward")
    layout = tuple(a.arg for a in forward.args.args[1:]) if forward else ()
    if layout == DEFERRED_LAYER_ARGS:
        has_post = find_method(layer, LAYER_POST) is not None or MODULE_POST in top_names(tree)
    else:
        has_post = layout == MIXED_LAYER_ARGS
    return (
        has_post
        and all(find_method(inner, name) for name in LOADER_METHODS)
        and "hf_to_vllm_mapper" in names_in(target)
        and any(name in top_names(tree) for name in HEAD_NAMES)
    )


def top_names(tree: ast.Module) -> set[str]:
    """The names a module defines or imports at its top level."""
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            found.update(alias.asname or alias.name for alias in node.names)
    return found


def _has_kv_insert(source: SourceReader) -> bool:
    """An attention class with the sliding-window cache and the fused K/V insert the
    draft's context rows are written with."""
    for module in ATTENTION_MODULES:
        text = source.read(module)
        for node in ast.parse(text).body if text else ():
            insert = find_method(node, KV_INSERT) if isinstance(node, ast.ClassDef) else None
            if insert is not None and "swa_cache_layer" in names_in(node):
                if tuple(a.arg for a in insert.args.args[1:]) == KV_INSERT_ARGS:
                    return True
    return False


def _has_decode_indices(source: SourceReader) -> bool:
    """A sliding-window builder whose ``build`` fills per-token decode indices and
    whose ``__init__`` sets the decode threshold from the reorder threshold (what
    ``v4_noncausal`` corrects)."""
    text = source.read(SWA_BUILDER_MODULE)
    builder = find_class(ast.parse(text), SWA_BUILDER) if text else None
    build = find_method(builder, "build") if builder else None
    init = find_method(builder, "__init__") if builder else None
    return (
        build is not None
        and init is not None
        and "decode_swa_indices" in names_in(build)
        and {"decode_threshold", "reorder_batch_threshold"} <= names_in(init)
    )


@functools.cache
def installed_model_module() -> Any:
    """The installed release's V4 model module, as the probe named it."""
    import importlib

    from vllm_v4_patches.sources import InstalledSource

    name = model_module(InstalledSource())
    if name is None:
        raise RuntimeError("dspark: this vLLM has no DeepSeek-V4 blocks for the V4 route")
    return importlib.import_module(name)


# -- run time -----------------------------------------------------------------


def defers_post_mix(layer: Any) -> bool:
    return "post_mix" in inspect.signature(layer.forward).parameters


def last_post_mix(layer: Any) -> Any:
    """The post-mix a deferring layer leaves to its caller: the layer's own, else
    its model module's."""
    own = getattr(layer, LAYER_POST, None)
    return own if own is not None else getattr(sys.modules[type(layer).__module__], MODULE_POST)


def mixed_streams(layer: Any, output: Any, post_mix: Any = None) -> Any:
    """``[T, hc_mult, H]``: a decoder layer's output with its post-mix applied
    (``post_mix``: the layer's :func:`last_post_mix`, looked up here if not given).
    A deferring layer that ran its native path (0.22 off CUDA) returns no residual:
    its streams are mixed already."""
    if not isinstance(output, tuple):
        return output
    if output[1] is None:
        return output[0]
    # `is None`, not `or`: Dynamo (torch 2.11) refuses a bound method's truth value
    return (last_post_mix(layer) if post_mix is None else post_mix)(*output)


def run_layers(layers: Any, streams: Any, positions: Any, input_ids: Any) -> Any:
    """The stages in order, as the release's V4 model runs its layers; returns the
    mixed streams."""
    if not defers_post_mix(layers[0]):
        for layer in layers:
            streams = layer(streams, positions, input_ids)
        return streams
    residual = post_mix = res_mix = None
    for layer in layers:
        streams, residual, post_mix, res_mix = layer(
            streams, positions, input_ids, post_mix, res_mix, residual
        )
    return mixed_streams(layers[-1], (streams, residual, post_mix, res_mix))


def head_reduction(module: Any) -> Any:
    """The module's streams-to-hidden head: ``f(streams, fn, scale, base, rms_eps,
    hc_eps)``; a class (a custom op) is built once here."""
    for name in HEAD_NAMES:
        found = getattr(module, name, None)
        if found is not None:
            return found() if isinstance(found, type) else found
    raise RuntimeError(f"dspark: {module.__name__} has none of {', '.join(HEAD_NAMES)}")


def kv_owner(layer: Any) -> Any:
    """The attention module that holds the layer's sliding-window cache and inserts
    into it."""
    attn = layer.attn
    return attn if hasattr(attn, KV_INSERT) else attn.mla_attn


def write_context_kv(layer: Any, kv: Any, positions: Any, slots: Any) -> None:
    """Rotate, quantise and write normalised context K/V rows at ``slots`` through
    the release's own fused insert (it picks the op for the cache dtype). The insert
    also processes a query; the context has none, so a zero one is passed and
    dropped, and the metadata it reads is the slots and the cache's block size."""
    import torch

    owner = kv_owner(layer)
    cache = owner.swa_cache_layer
    query = torch.zeros(
        (kv.shape[0], owner.n_local_heads, owner.head_dim), dtype=kv.dtype, device=kv.device
    )
    metadata = {cache.prefix: SimpleNamespace(slot_mapping=slots, block_size=cache.block_size)}
    getattr(owner, KV_INSERT)(query, kv, positions, metadata)
