"""A DeepSpec Qwen3 draft's tensors: the shapes its config implies, checked against
its safetensors headers before anything is loaded."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from vllm_v4_patches.dspark.checkpoint.config import (
    _ConfigReader,
    _read_json,
    parse_deepspec_qwen3_config,
)
from vllm_v4_patches.dspark.checkpoint.spec import WEIGHTS_ERROR


def deepspec_qwen3_weight_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a DeepSpec Qwen3 draft with this config holds, with its shape.

    ``embed_tokens`` / ``lm_head`` are copies of the target's (DeepSpec saves
    them; vLLM aliases the target's when they are absent, so they are optional
    for loading). ``confidence_head.proj`` has a bias in DeepSpec.
    """
    spec = parse_deepspec_qwen3_config(config)
    reader = _ConfigReader(config)
    hidden = spec.hidden_size
    num_heads = reader.integer("num_attention_heads", minimum=1)
    num_kv_heads = reader.integer("num_key_value_heads", minimum=1, default=num_heads)
    head_dim = reader.integer("head_dim", minimum=1, default=hidden // num_heads)
    intermediate = reader.integer("intermediate_size", minimum=1)
    target_hidden = reader.integer("target_hidden_size", minimum=1, default=hidden)
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (spec.vocab_size, hidden),
        "lm_head.weight": (spec.vocab_size, hidden),
        "fc.weight": (hidden, target_hidden * len(spec.target_layer_ids)),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for layer in range(spec.num_draft_layers or 0):
        prefix = f"layers.{layer}."
        shapes.update(
            {
                prefix + "input_layernorm.weight": (hidden,),
                prefix + "post_attention_layernorm.weight": (hidden,),
                prefix + "self_attn.q_proj.weight": (num_heads * head_dim, hidden),
                prefix + "self_attn.k_proj.weight": (num_kv_heads * head_dim, hidden),
                prefix + "self_attn.v_proj.weight": (num_kv_heads * head_dim, hidden),
                prefix + "self_attn.o_proj.weight": (hidden, num_heads * head_dim),
                prefix + "self_attn.q_norm.weight": (head_dim,),
                prefix + "self_attn.k_norm.weight": (head_dim,),
                prefix + "mlp.gate_proj.weight": (intermediate, hidden),
                prefix + "mlp.up_proj.weight": (intermediate, hidden),
                prefix + "mlp.down_proj.weight": (hidden, intermediate),
            }
        )
    if spec.markov_rank > 0:
        shapes["markov_head.markov_w1.weight"] = (spec.vocab_size, spec.markov_rank)
        shapes["markov_head.markov_w2.weight"] = (spec.vocab_size, spec.markov_rank)
        if spec.markov_head_type == "gated":
            shapes["markov_head.gate_proj.weight"] = (spec.markov_rank, hidden + spec.markov_rank)
            shapes["markov_head.gate_proj.bias"] = (spec.markov_rank,)
        elif spec.markov_head_type == "rnn":
            joint_in = 2 * spec.markov_rank + hidden
            shapes["markov_head.joint_proj.weight"] = (3 * spec.markov_rank, joint_in)
            shapes["markov_head.joint_proj.bias"] = (3 * spec.markov_rank,)
    if spec.enable_confidence_head:
        width = hidden + (spec.markov_rank if spec.confidence_head_with_markov else 0)
        shapes["confidence_head.proj.weight"] = (1, width)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


_SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")


def check_deepspec_weights(path: str | os.PathLike[str]) -> None:
    """The draft's safetensors files hold every tensor its ``config.json`` asks for,
    at its shape, and are whole: read from the files' headers, nothing is loaded.
    One line naming the file or the tensor otherwise. ``embed_tokens`` and
    ``lm_head`` may be absent (vLLM shares the target's)."""
    import glob

    folder = os.fspath(path)
    config = _read_json(os.path.join(folder, "config.json"))
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"{WEIGHTS_ERROR}: no *.safetensors file in {folder}")
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        for name, shape in _safetensors_shapes(file).items():
            found[name.removeprefix("model.")] = (shape, file)
    for name, shape in deepspec_qwen3_weight_shapes(config).items():
        if name not in found:
            if name in _SHARED_WITH_TARGET:
                continue
            raise ValueError(
                f"{WEIGHTS_ERROR}: {folder} has no tensor {name}, which its config.json " "asks for"
            )
        stored, file = found[name]
        if stored != shape:
            raise ValueError(
                f"{WEIGHTS_ERROR}: {name} in {file} has shape {stored}; its config.json "
                f"implies {shape}"
            )


def _safetensors_shapes(file: str) -> dict[str, tuple[int, ...]]:
    return {name: shape for name, (_, shape) in safetensors_entries(file).items()}


def safetensors_entries(file: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from a safetensors header, after checking that
    the file holds every byte the header points at."""
    import struct

    size = os.path.getsize(file)
    try:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > size - 8:
                raise ValueError("the header runs past the end of the file")
            header = json.loads(handle.read(length))
        ends = [entry["data_offsets"][1] for k, entry in header.items() if k != "__metadata__"]
        if 8 + length + max(ends, default=0) > size:
            raise ValueError("the file is shorter than its tensors (truncated?)")
        return {
            k: (e["dtype"], tuple(e["shape"])) for k, e in header.items() if k != "__metadata__"
        }
    except (ValueError, KeyError, TypeError, struct.error) as error:
        raise ValueError(
            f"{WEIGHTS_ERROR}: {file} is not a readable safetensors file ({error})"
        ) from None
