"""The shrunken DeepSeek-V4-Flash checkpoint of ``tools/build_tiny_v4.py``.

Three kinds of checks, none importing vLLM (its V4 modules need a GPU):

* the tensor inventory of every plan (built dry, no data) against what vLLM 0.26.0's
  loaders look up - ``DeepseekV4ForCausalLM.load_weights`` (weights mapper, stacked
  and expert rules of ``vllm/models/deepseek_v4/nvidia/model.py``) and
  ``DSparkDeepseekV4ForCausalLM.load_weights`` (``nvidia/dspark.py``), restated
  below - with every parameter covered exactly once; and, at the real widths,
  against the published DeepSeek-V4-Flash-0731 shard sizes, byte for byte;
* one real build (1 target layer, 1 expert, vocabulary 1024: 0.66 GB, about 15 s on
  the 2-core machine when it is not busy): the safetensors headers, the project's V4
  parser, the config, the tokenizer, and the fp8 / fp4 encodings decoded here,
  independently of the builder;
* the quantisers on hand-made inputs.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import build_tiny_v4 as tiny
from vllm_v4_patches.dspark.checkpoint import (
    FORMAT_DEEPSEEK_V4,
    group_dspark_v4_weights,
    load_draft_spec,
    parse_deepseek_v4_config,
)

# the cheapest build, with the GPU suite's head of a few live rows
SMALL = tiny.Plan(layers=1, experts=1, topk=1, vocab=1024, seed=0, live_tokens=8)
E4M3_MANTISSA_BITS = 3


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-v4") / "ckpt"
    tiny.build(str(out), SMALL, log=lambda *_: None)
    return out


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


def read_tensor(checkpoint: Path, name: str) -> tuple[str, torch.Tensor]:
    """(dtype string, raw bytes as uint8 [*shape[:-1], bytes per row]) from the file."""
    index = read_json(checkpoint / "model.safetensors.index.json")
    path = checkpoint / index["weight_map"][name]
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        entry = json.loads(handle.read(length))[name]
        start, end = entry["data_offsets"]
        handle.seek(8 + length + start)
        raw = bytearray(handle.read(end - start))
    flat = torch.frombuffer(raw, dtype=torch.uint8)
    return entry["dtype"], flat.view(*entry["shape"][:-1], -1)


# --- independent decoders ------------------------------------------------------------


def decode_ue8m0(scale_bytes: torch.Tensor) -> torch.Tensor:
    """UE8M0: the byte is a biased power-of-two exponent (bias 127)."""
    return torch.pow(2.0, scale_bytes.to(torch.float64) - 127)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """float8 e4m3fn from its bits: sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    codes = codes.to(torch.int64)
    sign = torch.where(codes & 0x80 > 0, -1.0, 1.0).double()
    exponent = (codes >> 3) & 0xF
    mantissa = (codes & 0x7).double()
    normal = (1 + mantissa / 8) * torch.pow(2.0, exponent.double() - 7)
    subnormal = mantissa / 8 * 2.0**-6
    assert not ((exponent == 0xF) & (mantissa == 7)).any(), "NaN code"
    return sign * torch.where(exponent == 0, subnormal, normal)


def decode_e2m1_packed(packed: torch.Tensor) -> torch.Tensor:
    """MXFP4 bytes [O, K/2] -> e2m1 values [O, K]; column 2j is byte j's low nibble."""
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).to(torch.int64)
    sign = torch.where(nibbles & 0x8 > 0, -1.0, 1.0).double()
    return sign * magnitudes[nibbles & 0x7]


def fp8_block_dequant(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    scale = decode_ue8m0(scales).repeat_interleave(128, 0).repeat_interleave(128, 1)
    return decode_e4m3(codes) * scale[: codes.shape[0], : codes.shape[1]]


def fp4_dequant(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return decode_e2m1_packed(packed) * decode_ue8m0(scales).repeat_interleave(32, 1)


def assert_fp8_close(weight: torch.Tensor, decoded: torch.Tensor, scales: torch.Tensor) -> None:
    """Within half a step of e4m3: 2**-4 relative for normals, 2**-10 * scale below."""
    scale = decode_ue8m0(scales).repeat_interleave(128, 0).repeat_interleave(128, 1)
    scale = scale[: weight.shape[0], : weight.shape[1]]
    bound = torch.maximum(weight.double().abs() * 2.0**-E4M3_MANTISSA_BITS / 2, 2.0**-10 * scale)
    assert ((decoded - weight.double()).abs() <= bound * (1 + 1e-9)).all()


def assert_fp4_close(weight: torch.Tensor, decoded: torch.Tensor, scales: torch.Tensor) -> None:
    """Within half a step of the e2m1 grid at that magnitude (steps 0.5, 1, 2)."""
    scale = decode_ue8m0(scales).repeat_interleave(32, 1)
    magnitude = weight.double().abs() / scale
    half_step = torch.where(magnitude < 2, 0.25, torch.where(magnitude < 4, 0.5, 1.0))
    assert ((decoded - weight.double()).abs() <= half_step * scale * (1 + 1e-9)).all()


# --- vLLM 0.26.0's loaders, restated ---------------------------------------------------
#
# Parameter shapes as the NVIDIA V4 model registers them at TP 1 (not MegaMoE):
# fp8 block linears register ``weight`` (float8_e4m3fn) and ``weight_scale_inv``
# (float8_e8m0fnu, since expert_dtype is fp4: quant_config.is_scale_e8m0);
# Mxfp4MoEMethod registers uint8 ``w13_weight`` [E, 2I, H/2], ``w13_weight_scale``
# [E, 2I, H/32], ``w2_weight`` [E, H, I/2], ``w2_weight_scale`` [E, H, I/32].
# Kinds: what a checkpoint tensor feeding the parameter must be.
FP8, E8M0, PACKED, SCALE_BYTES, INT, FLOAT = "fp8", "e8m0", "packed", "ue8m0", "int", "float"
ACCEPTS = {
    FP8: {"F8_E4M3"},
    E8M0: {"F8_E8M0"},  # copied into a float8_e8m0fnu parameter
    PACKED: {"I8", "U8"},  # copied into uint8: the bytes are kept
    SCALE_BYTES: {"F8_E8M0", "U8"},  # the loader views float8_e8m0fnu as uint8 first
    INT: {"I64", "I32"},
    FLOAT: {"BF16", "F32", "F16"},  # default_weight_loader converts
}


def _block(n: int) -> int:
    return -(-n // 128)


def layer_params(cfg: dict, prefix: str, ratio: int, hash_routed: bool) -> dict[str, tuple]:
    h, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    q, o, groups = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"]
    inter, experts, hc = cfg["moe_intermediate_size"], cfg["n_routed_experts"], cfg["hc_mult"]
    mix = (2 + hc) * hc
    a = prefix + "attn."
    params = {
        a + "attn_sink": ((64 if heads <= 64 else 128,), FLOAT),  # FlashMLA pads to 64/128
        a + "fused_wqa_wkv.weight": ((q + hd, h), FP8),
        a + "fused_wqa_wkv.weight_scale_inv": ((_block(q + hd), _block(h)), E8M0),
        a + "q_norm.weight": ((q,), FLOAT),
        a + "kv_norm.weight": ((hd,), FLOAT),
        a + "wq_b.weight": ((heads * hd, q), FP8),
        a + "wq_b.weight_scale_inv": ((_block(heads * hd), _block(q)), E8M0),
        a + "wo_a.weight": ((groups * o, heads * hd // groups), FP8),
        a + "wo_a.weight_scale_inv": ((_block(groups * o), _block(heads * hd // groups)), E8M0),
        a + "wo_b.weight": ((h, groups * o), FP8),
        a + "wo_b.weight_scale_inv": ((_block(h), _block(groups * o)), E8M0),
        prefix + "attn_norm.weight": ((h,), FLOAT),
        prefix + "ffn_norm.weight": ((h,), FLOAT),
        prefix + "ffn.gate.weight": ((experts, h), FLOAT),
        prefix + "ffn.shared_experts.gate_up_proj.weight": ((2 * inter, h), FP8),
        prefix
        + "ffn.shared_experts.gate_up_proj.weight_scale_inv": (
            (_block(2 * inter), _block(h)),
            E8M0,
        ),
        prefix + "ffn.shared_experts.down_proj.weight": ((h, inter), FP8),
        prefix
        + "ffn.shared_experts.down_proj.weight_scale_inv": ((_block(h), _block(inter)), E8M0),
        prefix + "ffn.experts.routed_experts.w13_weight": ((experts, 2 * inter, h // 2), PACKED),
        prefix
        + "ffn.experts.routed_experts.w13_weight_scale": (
            (experts, 2 * inter, h // 32),
            SCALE_BYTES,
        ),
        prefix + "ffn.experts.routed_experts.w2_weight": ((experts, h, inter // 2), PACKED),
        prefix
        + "ffn.experts.routed_experts.w2_weight_scale": ((experts, h, inter // 32), SCALE_BYTES),
    }
    for part in ("attn", "ffn"):
        params[f"{prefix}hc_{part}_fn"] = ((mix, hc * h), FLOAT)
        params[f"{prefix}hc_{part}_base"] = ((mix,), FLOAT)
        params[f"{prefix}hc_{part}_scale"] = ((3,), FLOAT)
    if hash_routed:
        params[prefix + "ffn.gate.tid2eid"] = ((cfg["vocab_size"], cfg["num_experts_per_tok"]), INT)
    else:  # topk_method noaux_tc
        params[prefix + "ffn.gate.e_score_correction_bias"] = ((experts,), FLOAT)

    def compressor(c: str, width: int, head_dim: int) -> None:
        params[c + "ape"] = ((ratio, width), FLOAT)
        params[c + "fused_wkv_wgate.weight"] = ((2 * width, h), FLOAT)
        params[c + "norm.weight"] = ((head_dim,), FLOAT)

    if ratio > 1:
        compressor(a + "compressor.", (1 + (ratio == 4)) * hd, hd)
    if ratio == 4:
        ihd, iheads = cfg["index_head_dim"], cfg["index_n_heads"]
        params[a + "indexer.wq_b.weight"] = ((iheads * ihd, q), FP8)
        params[a + "indexer.wq_b.weight_scale_inv"] = ((_block(iheads * ihd), _block(q)), E8M0)
        params[a + "indexer.weights_proj.weight"] = ((iheads, h), FLOAT)
        compressor(a + "indexer.compressor.", 2 * ihd, ihd)
    return params


def head_params(cfg: dict, prefix: str) -> dict[str, tuple]:
    h, hc = cfg["hidden_size"], cfg["hc_mult"]
    return {
        prefix + "norm.weight": ((h,), FLOAT),
        prefix + "hc_head_fn": ((hc, hc * h), FLOAT),
        prefix + "hc_head_base": ((hc,), FLOAT),
        prefix + "hc_head_scale": ((1,), FLOAT),
    }


def target_params(cfg: dict) -> dict[str, tuple]:
    """``DeepseekV4ForCausalLM``'s parameters that its ``load_weights`` fills."""
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    params = {
        "model.embed_tokens.weight": ((v, h), FLOAT),
        "lm_head.weight": ((v, h), FLOAT),
        **head_params(cfg, "model."),
    }
    for i in range(cfg["num_hidden_layers"]):
        hashed = i < cfg["num_hash_layers"]
        params.update(layer_params(cfg, f"model.layers.{i}.", cfg["compress_ratios"][i], hashed))
    return params


def draft_params(cfg: dict) -> dict[str, tuple]:
    """``DSparkDeepseekV4ForCausalLM``'s parameters filled from ``mtp.*`` (the
    embedding and LM head are aliased from the target, not loaded)."""
    v, h, r = cfg["vocab_size"], cfg["hidden_size"], cfg["dspark_markov_rank"]
    taps = len(cfg["dspark_target_layer_ids"])
    params = {
        "model.main_proj.weight": ((h, h * taps), FP8),
        "model.main_proj.weight_scale_inv": ((_block(h), _block(h * taps)), E8M0),
        "model.main_norm.weight": ((h,), FLOAT),
        "model.markov_head.markov_w1.weight": ((v, r), FLOAT),
        "model.markov_head.markov_w2.weight": ((v, r), FLOAT),
        **head_params(cfg, "model."),
    }
    for stage in range(cfg.get("n_mtp_layers") or 3):  # vLLM's default stage count
        # draft layers are vLLM layers num_hidden_layers + i: ratio 1, learned router
        params.update(layer_params(cfg, f"model.layers.{stage}.", 1, hash_routed=False))
    return params


# (parameter, checkpoint name, row offset) of both loaders' stacked (merged-column)
# rules; "half": wgate follows wkv, whose width depends on the compress ratio
def _stacked_rules(cfg: dict, *, with_compressor: bool) -> list[tuple[str, str, Any]]:
    q, inter = cfg["q_lora_rank"], cfg["moe_intermediate_size"]
    rules: list[tuple[str, str, Any]] = [
        ("gate_up_proj", "w1", 0),
        ("gate_up_proj", "w3", inter),
        ("attn.fused_wqa_wkv", "attn.wq_a", 0),
        ("attn.fused_wqa_wkv", "attn.wkv", q),
    ]
    if with_compressor:
        rules += [
            ("compressor.fused_wkv_wgate", "compressor.wkv", 0),
            ("compressor.fused_wkv_wgate", "compressor.wgate", "half"),
        ]
    return rules


def _expert_rule(name: str, cfg: dict) -> tuple[str, tuple] | None:
    """``experts.{e}.w{1,3}.`` -> ``experts.routed_experts.w13_`` rows [e, shard],
    ``experts.{e}.w2.`` -> ``experts.routed_experts.w2_`` [e]."""
    match = re.search(r"experts\.(\d+)\.(w[123])\.", name)
    if match is None:
        return None
    expert, shard = int(match.group(1)), match.group(2)
    param = name.replace(
        match.group(0), f"experts.routed_experts.{'w2' if shard == 'w2' else 'w13'}_"
    )
    rows = {"w1": 0, "w3": cfg["moe_intermediate_size"], "w2": 0}[shard]
    return param, (expert, rows)


def simulate_target_load(names: dict[str, tuple[str, list[int]]], cfg: dict) -> dict:
    """Checkpoint name -> (parameter, placement) as ``DeepseekV4ForCausalLM`` 0.26.0
    loads it (``mtp.*`` is skipped there: ``AutoWeightsLoader(skip_substrs=["mtp."])``)."""
    placed = {}
    for name in names:
        if "mtp." in name:
            continue
        mapped = name
        # _make_deepseek_v4_weights_mapper("fp4"): regex, substr, prefix, suffix
        mapped = re.sub(r"(\.experts\.\d+\.w[123])\.scale$", r"\1.weight_scale", mapped)
        mapped = re.sub(r"\.scale$", ".weight_scale_inv", mapped)
        mapped = mapped.replace(".shared_experts.w2", ".shared_experts.down_proj", 1)
        for old, new in (("layers.", "model.layers."), ("embed.", "model.embed."),
                         ("norm.", "model.norm."), ("hc_head", "model.hc_head")):  # fmt: skip
            if mapped.startswith(old):
                mapped = mapped.replace(old, new, 1)
        for old, new in (("head.weight", "lm_head.weight"), ("embed.weight", "embed_tokens.weight"),
                         (".ffn.gate.bias", ".ffn.gate.e_score_correction_bias")):  # fmt: skip
            if mapped.endswith(old):
                mapped = new.join(mapped.rsplit(old, 1))
        placed[name] = _place_in_layer(mapped, cfg, with_compressor=True)
    return placed


def simulate_draft_load(names: dict[str, tuple[str, list[int]]], cfg: dict) -> dict:
    """Checkpoint name -> (parameter, placement) as ``DSparkDeepseekV4ForCausalLM``
    0.26.0 loads it (``_remap_dspark_name``, then its scale / stacked / expert rules)."""
    placed = {}
    heads = ("norm.", "hc_head_fn", "hc_head_base", "hc_head_scale", "markov_head.")
    for name in names:
        match = re.match(r"mtp\.(\d+)\.(.*)", name)
        if match is None or match.group(2).startswith("confidence_head."):
            continue  # the target's, or not wired into inference in 0.26.0
        stage, rest = match.groups()
        if rest.startswith(("main_proj.", "main_norm.")) or rest.startswith(heads):
            mapped = f"model.{rest}"
        else:
            mapped = f"model.layers.{stage}.{rest}"
        if mapped.endswith(".scale"):
            expert = re.search(r"\.experts\.\d+\.w[123]\.scale$", mapped)
            mapped = mapped.removesuffix(".scale") + (
                ".weight_scale" if expert else ".weight_scale_inv"
            )
        mapped = mapped.replace(".shared_experts.w2", ".shared_experts.down_proj")
        if mapped.endswith(".ffn.gate.bias"):
            mapped = mapped.replace(".ffn.gate.bias", ".ffn.gate.e_score_correction_bias")
        if not mapped.startswith("model.layers."):
            placed[name] = (mapped, None)  # head-stack params load directly
        else:
            placed[name] = _place_in_layer(mapped, cfg, with_compressor=False)
    return placed


def _place_in_layer(mapped: str, cfg: dict, *, with_compressor: bool) -> tuple[str, Any]:
    if ".experts." in mapped:  # checked first by both loaders
        rule = _expert_rule(mapped, cfg)
        assert rule is not None, mapped
        return rule
    for param, shard, offset in _stacked_rules(cfg, with_compressor=with_compressor):
        if shard in mapped:
            return mapped.replace(shard, param, 1), ("rows", offset)
    return mapped, None


def check_load(
    placed: dict, params: dict[str, tuple], inventory: dict[str, tuple[str, list[int]]]
) -> None:
    """Every checkpoint tensor lands on an existing parameter with the right shape and
    a dtype the loader accepts; every parameter is filled exactly, without overlap."""
    filled: dict[str, set] = {}

    def fill(param: str, cells: set) -> None:
        assert not filled.get(param, set()) & cells, f"{param} filled twice"
        filled.setdefault(param, set()).update(cells)

    for name, (param, placement) in placed.items():
        assert param in params, f"{name} -> {param}: vLLM has no such parameter"
        shape, kind = params[param]
        dtype, ckpt_shape = inventory[name]
        assert dtype in ACCEPTS[kind], f"{name}: {dtype} into a {kind} parameter"
        if placement is None:
            if param.endswith("attn_sink"):  # narrowed into the padded head slots
                assert ckpt_shape[0] <= shape[0], name
                ckpt_shape = list(shape)
            assert tuple(ckpt_shape) == shape, f"{name} {ckpt_shape} -> {param} {shape}"
            fill(param, {"all"})
        elif placement[0] == "rows":  # a merged-column shard: rows of weight or scale
            offset = shape[0] // 2 if placement[1] == "half" else placement[1]
            if param.endswith("weight_scale_inv"):
                offset //= 128
            assert ckpt_shape[1:] == list(shape[1:]), f"{name} {ckpt_shape} -> {param} {shape}"
            assert offset + ckpt_shape[0] <= shape[0], f"{name} overflows {param}"
            fill(param, set(range(offset, offset + ckpt_shape[0])))
        else:  # an expert shard: [expert, rows, ...]
            expert, offset = placement
            assert expert < shape[0], name
            assert ckpt_shape[1:] == list(shape[2:]), f"{name} {ckpt_shape} -> {param} {shape}"
            assert offset + ckpt_shape[0] <= shape[1], f"{name} overflows {param}"
            fill(param, {(expert, row) for row in range(offset, offset + ckpt_shape[0])})
    for param, (shape, _) in params.items():
        cells = filled.get(param, set())
        if cells == {"all"}:
            continue
        expected = shape[0] if ".routed_experts." not in param else shape[0] * shape[1]
        assert len(cells) == expected, f"{param} {shape}: {len(cells)} of {expected} rows filled"


@pytest.mark.parametrize("layers", [1, 2, 3, 4])
def test_every_plan_loads_into_vllm_026_parameters(layers: int) -> None:
    plan = tiny.Plan(layers=layers, experts=3, topk=2, vocab=2048, seed=0)
    inventory = tiny.inventory(plan)
    cfg = tiny.hf_config(plan, noise_token_id=2000)
    check_load(simulate_target_load(inventory, cfg), target_params(cfg), inventory)
    check_load(simulate_draft_load(inventory, cfg), draft_params(cfg), inventory)
    # the confidence head is the only tensor neither model loads (0.26.0 drops it)
    loaded = set(simulate_target_load(inventory, cfg)) | set(simulate_draft_load(inventory, cfg))
    assert set(inventory) - loaded == {"mtp.2.confidence_head.proj.weight"}


def test_real_widths_match_the_published_checkpoint_byte_for_byte() -> None:
    """Built at full size, the plan of 4 layers is the real model's layers 0-3 (two
    sliding-window hash layers, a ratio-4 hash layer, a ratio-128 learned layer), so
    its shards must equal the real shards 1-5, 45 (head) and 46-48 (mtp.0-2) of
    DeepSeek-V4-Flash-0731: tensor counts and file sizes, header included."""
    published = [  # (tensors, bytes) from the checkpoint's safetensors index and LFS
        (1, 1_059_061_856),
        (1565, 3_566_321_192),
        (1565, 3_566_321_192),
        (1576, 3_596_229_272),
        (1569, 3_568_768_976),
        (5, 1_059_332_516),
        (1568, 3_610_455_184),
        (1565, 3_560_111_960),
        (1572, 3_692_775_244),
    ]
    plan = tiny.Plan(layers=4, experts=256, topk=6, vocab=129280, seed=0)
    shards = list(tiny.shards(plan, dry=True))
    assert len(shards) == len(published)
    for (what, tensors), (count, size) in zip(shards, published, strict=True):
        written = 8 + len(tiny.safetensors_header(tensors)) + tensors.nbytes()
        assert (len(tensors.items), written) == (count, size), what


def test_the_weight_check_passes_the_real_inventory() -> None:
    """The checks a V4 draft's headers go through at engine start, on the inventory
    that equals the published DeepSeek-V4-Flash-0731 shards (previous test): a valid
    checkpoint of the real model must not be refused (its 43 layers as the taps'
    range; the inventory holds layers 0-3)."""
    from vllm_v4_patches.dspark.checkpoint import check_v4_entries

    plan = tiny.Plan(layers=4, experts=256, topk=6, vocab=129280, seed=0)
    entries = {n: (d, s) for n, (d, s) in tiny.inventory(plan).items() if n.startswith("mtp.")}
    config = tiny.hf_config(plan, noise_token_id=plan.vocab - 1)
    config["num_hidden_layers"] = 43
    config["dspark_target_layer_ids"] = [40, 41, 42]
    layout = check_v4_entries(entries, parse_deepseek_v4_config(config))
    assert layout.num_stages == 3 and layout.has_confidence_head


# --- one real build ----------------------------------------------------------------------


def test_headers_hold_the_official_names_dtypes_and_shapes(built: Path) -> None:
    index = read_json(built / "model.safetensors.index.json")
    headers = {}
    for file_name in sorted(set(index["weight_map"].values())):
        header = read_header(built / file_name)
        assert "__metadata__" not in header  # as the real shards
        for name, entry in header.items():
            assert index["weight_map"][name] == file_name
            headers[name] = (entry["dtype"], entry["shape"])
        # offsets are contiguous from 0 and the file ends with the last tensor
        spans = sorted(entry["data_offsets"] for entry in header.values())
        assert spans[0][0] == 0 and all(
            a[1] == b[0] for a, b in zip(spans[:-1], spans[1:], strict=True)
        )
        header_length = len(json.dumps(header, separators=(",", ":")))
        size = (built / file_name).stat().st_size
        assert 8 + header_length <= size - spans[-1][1] < 8 + header_length + 8
    assert headers == {name: (d, s) for name, (d, s) in tiny.inventory(SMALL).items()}
    assert index["metadata"]["total_size"] == sum(
        tiny.DTYPE_BYTES[d] * math.prod(s) for d, s in headers.values()
    )
    v = SMALL.vocab
    official = {
        "embed.weight": ("BF16", [v, 4096]),
        "head.weight": ("BF16", [v, 4096]),
        "norm.weight": ("BF16", [4096]),
        "hc_head_fn": ("F32", [4, 16384]),
        "hc_head_base": ("F32", [4]),
        "hc_head_scale": ("F32", [1]),
        "layers.0.attn.wq_a.weight": ("F8_E4M3", [1024, 4096]),
        "layers.0.attn.wq_a.scale": ("F8_E8M0", [8, 32]),
        "layers.0.attn.wkv.weight": ("F8_E4M3", [512, 4096]),
        "layers.0.attn.wq_b.weight": ("F8_E4M3", [32768, 1024]),
        "layers.0.attn.wo_a.weight": ("F8_E4M3", [8192, 4096]),
        "layers.0.attn.wo_b.scale": ("F8_E8M0", [32, 64]),
        "layers.0.attn.attn_sink": ("F32", [64]),
        "layers.0.attn.q_norm.weight": ("BF16", [1024]),
        "layers.0.attn.compressor.wkv.weight": ("BF16", [1024, 4096]),
        "layers.0.attn.compressor.ape": ("F32", [4, 1024]),
        "layers.0.attn.indexer.wq_b.scale": ("F8_E8M0", [64, 8]),
        "layers.0.attn.indexer.weights_proj.weight": ("BF16", [64, 4096]),
        "layers.0.attn.indexer.compressor.wgate.weight": ("BF16", [256, 4096]),
        "layers.0.hc_attn_fn": ("F32", [24, 16384]),
        "layers.0.ffn.gate.weight": ("BF16", [1, 4096]),
        "layers.0.ffn.gate.tid2eid": ("I64", [v, 1]),
        "layers.0.ffn.shared_experts.w2.weight": ("F8_E4M3", [4096, 2048]),
        "layers.0.ffn.shared_experts.w2.scale": ("F8_E8M0", [32, 16]),
        "layers.0.ffn.experts.0.w1.weight": ("I8", [2048, 2048]),
        "layers.0.ffn.experts.0.w1.scale": ("F8_E8M0", [2048, 128]),
        "layers.0.ffn.experts.0.w2.weight": ("I8", [4096, 1024]),
        "layers.0.ffn.experts.0.w2.scale": ("F8_E8M0", [4096, 64]),
        "mtp.0.main_proj.weight": ("F8_E4M3", [4096, 4096]),
        "mtp.0.main_proj.scale": ("F8_E8M0", [32, 32]),
        "mtp.0.main_norm.weight": ("BF16", [4096]),
        "mtp.1.ffn.gate.bias": ("F32", [1]),
        "mtp.1.attn.wkv.scale": ("F8_E8M0", [4, 32]),
        "mtp.2.norm.weight": ("BF16", [4096]),
        "mtp.2.hc_head_fn": ("F32", [4, 16384]),
        "mtp.2.markov_head.markov_w1.weight": ("BF16", [v, 256]),
        "mtp.2.markov_head.markov_w2.weight": ("BF16", [v, 256]),
        "mtp.2.confidence_head.proj.weight": ("BF16", [1, 4096 + 256]),
    }
    for name, expected in official.items():
        assert headers.get(name) == expected, name
    assert not any(".compressor." in n or ".indexer." in n for n in headers if n.startswith("mtp."))
    assert not any(n.startswith("mtp.") and n.endswith("tid2eid") for n in headers)


def test_project_parser_reads_three_stages(built: Path) -> None:
    config = read_json(built / "config.json")
    inference = read_json(built / "inference" / "config.json")
    index = read_json(built / "model.safetensors.index.json")
    names = list(index["weight_map"])
    spec = load_draft_spec(built)
    assert spec.format == FORMAT_DEEPSEEK_V4
    assert spec.num_draft_layers == 3  # n_mtp_layers of inference/config.json
    assert (spec.block_size, spec.markov_rank) == (5, 256)
    assert spec.mask_token_id == config["dspark_noise_token_id"]
    assert spec.target_layer_ids == tuple(config["dspark_target_layer_ids"]) == (0,)
    assert (spec.hidden_size, spec.vocab_size, spec.num_target_layers) == (4096, 1024, 1)
    # without inference/config.json, the stage count comes from the mtp.* prefixes
    assert parse_deepseek_v4_config(config, weight_names=names).num_draft_layers == 3
    spec = parse_deepseek_v4_config(config, inference_config=inference, weight_names=names)
    shapes = {name: shape for name, (_, shape) in tiny.inventory(SMALL).items()}
    layout = group_dspark_v4_weights(names, shapes=shapes, spec=spec)
    assert layout.num_stages == 3 and layout.has_confidence_head
    assert layout.markov_w1 == "mtp.2.markov_head.markov_w1.weight"


def test_config_has_what_vllm_reads(built: Path) -> None:
    config = read_json(built / "config.json")
    read_by_vllm = (  # nvidia/model.py, attention.py, compressor.py, dspark.py, rope.py
        "hidden_size vocab_size n_routed_experts num_experts_per_tok n_shared_experts "
        "moe_intermediate_size hc_mult hc_eps hc_sinkhorn_iters qk_rope_head_dim head_dim "
        "q_lora_rank o_lora_rank o_groups index_topk index_n_heads index_head_dim "
        "sliding_window compress_ratios num_hash_layers swiglu_limit num_nextn_predict_layers "
        "dspark_target_layer_ids dspark_markov_rank expert_dtype rms_norm_eps "
        "num_attention_heads num_hidden_layers norm_topk_prob hidden_act topk_method "
        "max_position_embeddings rope_theta compress_rope_theta rope_scaling "
        "quantization_config dspark_block_size dspark_noise_token_id"
    ).split()
    assert [key for key in read_by_vllm if key not in config] == []
    assert config["compress_ratios"] == [4, 0, 0, 0]  # 1 target layer + 3 draft stages
    assert config["num_hash_layers"] == 1 and config["topk_method"] == "noaux_tc"
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"
    assert 0 <= config["dspark_noise_token_id"] < config["vocab_size"] - tiny.UNUSED_TOP_IDS
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    generation = read_json(built / "generation_config.json")
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)
    # the plans' layer kinds
    assert [tiny.Plan(n, 8, 2, 4096, 0).compress_ratios[:n] for n in (1, 2, 3, 4)] == [
        [4],
        [4, 128],
        [0, 4, 128],
        [0, 0, 4, 128],
    ]
    assert [tiny.Plan(n, 8, 2, 4096, 0).num_hash_layers for n in (1, 2, 3, 4)] == [1, 1, 2, 3]
    assert tiny.Plan(4, 8, 2, 4096, 0).target_layer_ids == [1, 2, 3]


def test_tokenizer_fits_the_model(built: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    config = read_json(built / "config.json")
    tokenizer = tokenizers.Tokenizer.from_file(str(built / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) <= config["vocab_size"]
    assert tokenizer.token_to_id(tiny.BOS_TOKEN) == config["bos_token_id"]
    assert tokenizer.token_to_id(tiny.EOS_TOKEN) == config["eos_token_id"]
    assert tokenizer.token_to_id(tiny.NOISE_TOKEN) == config["dspark_noise_token_id"]
    assert tokenizer.get_vocab_size(with_added_tokens=False) > 512  # merges were learned
    encoded = tokenizer.encode("Hello, the draft model.")
    assert encoded.ids[0] == 0 and max(encoded.ids) < config["vocab_size"]
    assert tokenizer.decode(encoded.ids) == "Hello, the draft model."
    special = read_json(built / "special_tokens_map.json")
    assert special["bos_token"] == tiny.BOS_TOKEN


def test_minimal_tokenizer_without_the_tokenizers_package(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")  # to check what was written by hand
    ids = tiny._write_minimal_tokenizer(str(tmp_path))
    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.token_to_id(tiny.BOS_TOKEN) == ids[tiny.BOS_TOKEN] == 0
    assert tokenizer.token_to_id(tiny.EOS_TOKEN) == 1
    assert tokenizer.token_to_id(tiny.NOISE_TOKEN) == ids[tiny.NOISE_TOKEN] < 1024
    encoded = tokenizer.encode("héllo, wörld")
    assert encoded.ids[0] == 0 and len(encoded.ids) == 1 + len("héllo, wörld".encode())
    assert tokenizer.decode(encoded.ids) == "héllo, wörld"


def test_stored_fp8_tensor_decodes_to_its_seeded_weight(built: Path) -> None:
    name = "mtp.1.attn.wkv"
    dtype, codes = read_tensor(built, name + ".weight")
    scale_dtype, scales = read_tensor(built, name + ".scale")
    assert (dtype, scale_dtype, list(codes.shape), list(scales.shape)) == (
        "F8_E4M3",
        "F8_E8M0",
        [512, 4096],
        [4, 32],
    )
    weight = tiny.Tensors(SMALL.seed).normal(name + ".weight", (512, 4096), tiny.WEIGHT_STD)
    decoded = fp8_block_dequant(codes, scales)
    assert_fp8_close(weight, decoded, scales)
    assert abs(decoded.std().item() - tiny.WEIGHT_STD) < 1e-3
    # each block's scale is the smallest power of two that keeps it within +-448
    amax = weight.abs().view(4, 128, 32, 128).amax(dim=(1, 3)).double()
    assert ((amax / decode_ue8m0(scales) <= 448) & (amax / decode_ue8m0(scales) > 224)).all()
    # torch's own float8 types read the same bytes the same way
    assert torch.equal(codes.view(torch.float8_e4m3fn).double(), decode_e4m3(codes))
    if hasattr(torch, "float8_e8m0fnu"):
        assert torch.equal(scales.view(torch.float8_e8m0fnu).double(), decode_ue8m0(scales))


def test_stored_fp4_expert_decodes_to_its_seeded_weight(built: Path) -> None:
    name = "layers.0.ffn.experts.0.w2"
    dtype, packed = read_tensor(built, name + ".weight")
    scale_dtype, scales = read_tensor(built, name + ".scale")
    assert (dtype, scale_dtype, list(packed.shape), list(scales.shape)) == (
        "I8",
        "F8_E8M0",
        [4096, 1024],
        [4096, 64],
    )
    weight = tiny.Tensors(SMALL.seed).normal(name + ".weight", (4096, 2048), tiny.WEIGHT_STD)
    decoded = fp4_dequant(packed, scales)
    assert_fp4_close(weight, decoded, scales)
    amax = weight.abs().view(4096, 64, 32).amax(dim=2).double()
    ratio = amax / decode_ue8m0(scales)
    assert ((ratio <= 6) & (ratio > 3)).all()


def test_hash_table_and_mhc_parameters(built: Path) -> None:
    dtype, raw = read_tensor(built, "layers.0.ffn.gate.tid2eid")
    table = raw.contiguous().view(torch.int64)
    assert dtype == "I64" and list(table.shape) == [SMALL.vocab, SMALL.topk]
    assert ((table >= 0) & (table < SMALL.experts)).all()
    wider = tiny.Tensors(0)
    wider.hash_table("tid2eid", vocab=256, experts=8, topk=3)
    table = wider.items["tid2eid"][2].view(torch.int64).view(256, 3)
    assert ((table >= 0) & (table < 8)).all()
    assert all(len(set(row)) == 3 for row in table.tolist())  # distinct experts per token
    _, base = read_tensor(built, "layers.0.hc_attn_base")
    base = base.contiguous().view(torch.float32)
    pre = torch.sigmoid(base[:4])
    assert torch.allclose(pre, torch.full((4,), 0.25))  # pre-mix = mean of the copies
    assert torch.equal(base[4:], torch.zeros(20))


# --- the quantisers on hand-made inputs ---------------------------------------------------


def test_live_head_rows_are_the_only_non_zero_ones(built: Path) -> None:
    """``--live-tokens K``: the LM head and the Markov head's output keep the real
    dtype and shape, their rows zero but for K seeded ones past bos and eos."""
    live = slice(tiny.FIRST_LIVE_TOKEN, tiny.FIRST_LIVE_TOKEN + SMALL.live_tokens)
    for name, width in (("head.weight", 4096), ("mtp.2.markov_head.markov_w2.weight", 256)):
        dtype, raw = read_tensor(built, name)
        rows = raw.view(torch.bfloat16).float()
        assert dtype == "BF16" and rows.shape == (SMALL.vocab, width), name
        assert (rows[live].abs().sum(dim=1) > 0).all(), name
        assert rows[: live.start].abs().sum() == 0 and rows[live.stop :].abs().sum() == 0
        assert rows[live].std() == pytest.approx(tiny.WEIGHT_STD, rel=0.1), name


def test_fp8_block_quantiser_round_trips() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(256, 384, generator=generator)
    weight[:128, :128] *= 1e-3  # blocks of very different magnitude, one all zero
    weight[128:, 128:256] *= 30.0
    weight[:128, 256:] = 0.0
    codes, scales = tiny.quantize_fp8_block(weight.clone())
    assert codes.dtype == torch.uint8 and list(scales.shape) == [2, 3]
    decoded = fp8_block_dequant(codes, scales)
    assert_fp8_close(weight, decoded, scales)
    assert torch.equal(decoded[:128, 256:], torch.zeros(128, 128, dtype=torch.float64))
    assert torch.allclose(tiny.dequantize_fp8_block(codes, scales).double(), decoded)
    # a shape that is not a multiple of the block: scales cover the ragged edge
    ragged = torch.randn(130, 200, generator=generator)
    codes, scales = tiny.quantize_fp8_block(ragged.clone())
    assert list(codes.shape) == [130, 200] and list(scales.shape) == [2, 2]
    assert_fp8_close(ragged, fp8_block_dequant(codes, scales), scales)


def test_fp4_quantiser_round_trips_and_packs_low_nibble_first() -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 256, generator=generator) * 0.02
    weight[3] *= 1000.0
    packed, scales = tiny.quantize_fp4_mx(weight.clone())
    assert list(packed.shape) == [64, 128] and list(scales.shape) == [64, 8]
    decoded = fp4_dequant(packed, scales)
    assert_fp4_close(weight, decoded, scales)
    assert torch.allclose(tiny.dequantize_fp4_mx(packed, scales).double(), decoded)
    # exact grid values: column 0 = +6, column 1 = -0.5 -> byte 0 = 0x7 | 0x9 << 4
    row = torch.zeros(1, 32)
    row[0, 0], row[0, 1], row[0, 2], row[0, 3] = 6.0, -0.5, 1.5, -4.0
    packed, scales = tiny.quantize_fp4_mx(row.clone())
    assert scales.tolist() == [[127]]  # 2**0
    assert packed[0, :2].tolist() == [0x97, 0xE3]


def test_generation_is_seeded_per_tensor() -> None:
    first = tiny.Tensors(7).normal("layers.0.attn.wkv.weight", (4, 8), 1.0)
    again = tiny.Tensors(7).normal("layers.0.attn.wkv.weight", (4, 8), 1.0)
    other = tiny.Tensors(8).normal("layers.0.attn.wkv.weight", (4, 8), 1.0)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert not torch.equal(first, tiny.Tensors(7).normal("layers.0.attn.wq_a.weight", (4, 8), 1.0))


def test_plans_outside_the_supported_range_are_refused() -> None:
    for plan in (
        tiny.Plan(5, 8, 2, 4096, 0),
        tiny.Plan(2, 2, 3, 4096, 0),
        tiny.Plan(2, 8, 2, 4000, 0),
        tiny.Plan(2, 8, 2, 512, 0),
        tiny.Plan(2, 8, 2, 4096, 0, live_tokens=1),
        tiny.Plan(2, 8, 2, 4096, 0, live_tokens=4095),
    ):
        with pytest.raises(SystemExit):
            tiny.validate(plan)


def test_v1_route_takes_the_in_checkpoint_draft_only_when_asked(
    built: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook the runner choice calls before the overlay's V1 drafter takes a dspark
    config. The overlay's V1 route for a V4 checkpoint's own stages has not served a
    request on the H200 yet (vLLM 0.26.0: it passes the profile run and KV cache set-up
    with the draft's caches in three groups, then its first run timed out), so it is
    opt-in: by default one line naming the setting, with it on the hook lets the
    config through on this vLLM (which has the V4 draft class), an unknown value
    refuses too, and V2 (which drafts it natively) is never refused. The vLLM config
    is a stand-in holding the three fields the hook reads: a real one for V4 was not
    built on the CPU backend."""
    from types import SimpleNamespace

    from vllm_v4_patches.dspark import V4_ROUTE_CLASS
    from vllm_v4_patches.dspark.config_hooks import (
        V4_ON_V1_SETTING,
        v4_route,
        validate_draft_checkpoint,
    )

    def config(num_tokens: int = 5) -> SimpleNamespace:
        speculative = SimpleNamespace(
            model=str(built), num_speculative_tokens=num_tokens, draft_model_config=None
        )
        return SimpleNamespace(
            speculative_config=speculative, model_config=SimpleNamespace(model=str(built))
        )

    assert v4_route() == V4_ROUTE_CLASS  # the installed vLLM ships vLLM's V4 draft class
    for value in (None, "maybe"):
        if value is None:
            monkeypatch.delenv(V4_ON_V1_SETTING, raising=False)
        else:
            monkeypatch.setenv(V4_ON_V1_SETTING, value)
        with pytest.raises(ValueError) as refused:
            validate_draft_checkpoint(config(), runner="V1")
        line = str(refused.value)
        assert "\n" not in line and f"speculative_config.model={built}" in line
        assert f"{V4_ON_V1_SETTING}=on" in line and "VLLM_USE_V2_MODEL_RUNNER" in line
    monkeypatch.setenv(V4_ON_V1_SETTING, "on")
    assert validate_draft_checkpoint(config(), runner="V1") == ()
    # the V1 route's N is the block's (5); V2 keeps stock's own rule
    for other in (3, 7):
        with pytest.raises(ValueError, match=f"num_speculative_tokens={other}: "):
            validate_draft_checkpoint(config(other), runner="V1")
        assert validate_draft_checkpoint(config(other), runner="V2") == ()
    monkeypatch.delenv(V4_ON_V1_SETTING)
    assert validate_draft_checkpoint(config(), runner="V2") == ()  # V2 drafts it natively


# --- bad V4 checkpoints: one line naming the key or tensor -----------------------------


def header_clone(source: Path, out: Path, edit_header=None, edit_config=None) -> Path:
    """``source`` with its safetensors headers (and config) edited: each shard is its
    new header followed by a sparse hole as long as the tensors it points at, so a
    header-only reader sees a whole file and nothing is copied."""
    out.mkdir()
    weight_map = {}
    for shard in sorted(source.glob("*.safetensors")):
        header = read_header(shard)
        if edit_header is not None:
            edit_header(header)
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        blob = json.dumps(header).encode()
        with open(out / shard.name, "wb") as handle:
            handle.write(struct.pack("<Q", len(blob)) + blob)
            handle.truncate(8 + len(blob) + max(ends, default=0))
        weight_map.update({key: shard.name for key in header if key != "__metadata__"})
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    # both config files, as a release of the checkpoint would change them
    for name in ("config.json", "inference/config.json"):
        if not (source / name).exists():
            continue
        config = read_json(source / name)
        if edit_config is not None:
            edit_config(config)
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text(json.dumps(config))
    return out


def drop(prefix: str):
    def edit(header: dict) -> None:
        for key in [k for k in header if k.startswith(prefix)]:
            del header[key]

    return edit


def reshape(name: str, shape: list[int]):
    def edit(header: dict) -> None:
        if name in header:
            header[name]["shape"] = shape

    return edit


def both(*edits):
    def edit(header: dict) -> None:
        for one in edits:
            one(header)

    return edit


def stand_in_config(checkpoint: Path) -> Any:
    """The three fields the config hook reads (a real V4 vLLM config is not built on
    the CPU backend)."""
    from types import SimpleNamespace

    speculative = SimpleNamespace(
        model=str(checkpoint), num_speculative_tokens=5, draft_model_config=None
    )
    return SimpleNamespace(
        speculative_config=speculative, model_config=SimpleNamespace(model=str(checkpoint))
    )


def refusal(checkpoint: Path) -> str:
    """The V1 route's refusal (the route on); V2 leaves the checkpoint to vLLM."""
    from vllm_v4_patches.dspark.config_hooks import validate_draft_checkpoint

    with pytest.raises(ValueError) as refused:
        validate_draft_checkpoint(stand_in_config(checkpoint), runner="V1")
    line = str(refused.value)
    assert "\n" not in line
    return line


def test_a_whole_checkpoint_passes_the_weight_check(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_v4_patches.dspark.checkpoint import check_v4_weights
    from vllm_v4_patches.dspark.config_hooks import (
        V4_ON_V1_SETTING,
        validate_draft_checkpoint,
        validate_draft_paths,
    )

    monkeypatch.setenv(V4_ON_V1_SETTING, "on")
    spec = validate_draft_paths(str(built), str(built))
    assert check_v4_weights(str(built), spec).num_stages == 3
    clone = header_clone(built, tmp_path / "same")
    assert validate_draft_checkpoint(stand_in_config(clone), runner="V1") == ()


def test_bad_v4_checkpoints_are_refused_naming_the_key_or_tensor(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the V1 route (on); on V2, where vLLM's own loader judges the stages, the
    overlay refuses only a config its parser cannot read."""
    from vllm_v4_patches.dspark.config_hooks import V4_ON_V1_SETTING, validate_draft_checkpoint

    monkeypatch.setenv(V4_ON_V1_SETTING, "on")

    def set_key(key: str, value: Any):
        return lambda config: config.__setitem__(key, value)

    cases = {
        # a missing middle stage
        "mtp.* stages are 0, 2": header_clone(built, tmp_path / "a", drop("mtp.1.")),
        # taps outside the target (one layer here)
        "dspark_target_layer_ids": header_clone(
            built, tmp_path / "b", edit_config=set_key("dspark_target_layer_ids", [0, 1])
        ),
        # a Markov rank the tensors do not have
        "mtp.2.markov_head.markov_w1.weight has shape [1024, 256]; expected [1024, 128]": (
            header_clone(built, tmp_path / "c", edit_config=set_key("dspark_markov_rank", 128))
        ),
        # an fp8 weight without its scale
        "mtp.0.attn.wq_a.weight (F8_E4M3) has no scale tensor mtp.0.attn.wq_a.scale": (
            header_clone(built, tmp_path / "d", drop("mtp.0.attn.wq_a.scale"))
        ),
        # an MXFP4 expert's scale of the wrong shape
        "mtp.1.ffn.experts.0.w2.scale has shape": header_clone(
            built,
            tmp_path / "e",
            reshape("mtp.1.ffn.experts.0.w2.scale", [1, 1]),
        ),
        # a context projection for two taps where the config names one
        "mtp.0.main_proj.weight takes 8192 inputs, but dspark_target_layer_ids=[0]": (
            header_clone(
                built,
                tmp_path / "g",
                both(
                    reshape("mtp.0.main_proj.weight", [4096, 8192]),
                    reshape("mtp.0.main_proj.scale", [32, 64]),
                ),
            )
        ),
        # fewer stages than n_mtp_layers says
        "n_mtp_layers": header_clone(built, tmp_path / "f", edit_config=set_key("n_mtp_layers", 4)),
    }
    for expected, checkpoint in cases.items():
        assert expected in refusal(checkpoint), expected
    weights_only = [c for e, c in cases.items() if e.startswith(("mtp.* stages", "mtp.0.attn"))]
    assert len(weights_only) == 2
    for checkpoint in weights_only:
        assert validate_draft_checkpoint(stand_in_config(checkpoint), runner="V2") == ()


# --- the confidence head vLLM's V4 class drops ----------------------------------------


class StandInV4Draft(torch.nn.Module):
    """What ``attach_confidence_head`` touches on vLLM's V4 draft class (``config``,
    an inner ``model``); the class itself builds only with CUDA kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=tiny.HIDDEN)
        self.model = torch.nn.Module()


def test_the_v4_confidence_head_is_read_and_scores_as_its_definition(built: Path) -> None:
    """The overlay's V4 drafter scores ``c_k = sigmoid(w . [h_k ; W1[prev_k]])`` with
    the checkpoint's bf16 ``[1, H + r]`` weight and no bias; checked against the file's
    own bytes and a float64 evaluation (tolerance 1e-5, the head runs in float32)."""
    from vllm_v4_patches.dspark import sampling
    from vllm_v4_patches.dspark.checkpoint import read_v4_confidence_weight
    from vllm_v4_patches.dspark.v4_proposer import attach_confidence_head

    spec = load_draft_spec(built)
    weight = read_v4_confidence_weight(str(built), spec)
    dtype, raw = read_tensor(built, "mtp.2.confidence_head.proj.weight")
    assert dtype == "BF16" and weight.dtype == torch.bfloat16
    assert torch.equal(weight.view(torch.uint8).reshape(raw.shape), raw)
    assert tuple(weight.shape) == (1, tiny.HIDDEN + tiny.MARKOV_RANK)

    draft = StandInV4Draft()
    attach_confidence_head(draft, weight, "cpu")
    generator = torch.Generator().manual_seed(3)
    batch, slots = 2, 5
    hidden = torch.randn(batch * slots, tiny.HIDDEN, generator=generator).bfloat16()
    markov = [
        torch.randn(batch, tiny.MARKOV_RANK, generator=generator).bfloat16() for _ in range(slots)
    ]
    scored = sampling._confidence(draft, hidden, markov, batch)
    assert scored.shape == (batch, slots) and scored.dtype == torch.float32
    features = torch.cat([hidden, torch.stack(markov, dim=1).flatten(0, 1)], dim=-1).double()
    expected = torch.sigmoid(features @ weight.double().reshape(-1)).view(batch, slots)
    assert torch.allclose(scored.double(), expected, atol=1e-5)
    # a head scored without the Markov half, or with a bias, would not match
    hidden_only = torch.sigmoid(hidden.double() @ weight.double().reshape(-1)[: tiny.HIDDEN])
    assert not torch.allclose(scored.double().flatten(), hidden_only, atol=1e-3)


def test_a_config_that_switches_the_head_off_reads_no_weight(built: Path, tmp_path: Path) -> None:
    from dataclasses import replace

    from vllm_v4_patches.dspark.checkpoint import read_v4_confidence_weight

    spec = replace(load_draft_spec(built), enable_confidence_head=False)
    assert read_v4_confidence_weight(str(built), spec) is None


def test_the_step_timer_divides_by_the_checkpoints_stages(built: Path) -> None:
    """``generate.model_depths`` (the per-stage figure's divisor) on a stand-in worker
    (a namespace: no CPU engine runs V4) holding what vLLM 0.26.0 gives the drafter,
    the V4 config loaded from the target's directory, whose
    ``num_nextn_predict_layers`` (1) is not the stage count."""
    import generate

    config = read_json(built / "config.json")
    assert config["num_nextn_predict_layers"] != 3
    loaded = SimpleNamespace(**config)
    drafter = SimpleNamespace(
        draft_model_config=SimpleNamespace(model=str(built), hf_config=loaded)
    )
    runner = SimpleNamespace(model_config=SimpleNamespace(hf_config=loaded), drafter=drafter)
    depths = generate.model_depths(SimpleNamespace(model_runner=runner))
    assert depths == {"target_layers": config["num_hidden_layers"], "draft_stages": 3}


def test_every_stage_tensor_has_one_place_in_the_pre_025_draft(built: Path) -> None:
    """``dspark.v4_stages.stage_tensor_place`` on the checkpoint's real names: each
    stage's decoder-layer tensors carry a target layer's names (so the release's
    target loader takes them), the combiner and head stack land once each, and the
    target's own tensors and the confidence head are left to others."""
    from vllm_v4_patches.dspark.v4_stages import stage_tensor_place

    names = [
        name
        for shard in sorted(built.glob("*.safetensors"))
        for name in read_header(shard)
        if name != "__metadata__"
    ]
    placed = {name: stage_tensor_place(name) for name in names}
    assert all(place is None for name, place in placed.items() if not name.startswith("mtp."))
    confidence = [n for n in names if ".confidence_head." in n]
    assert confidence and all(placed[n] is None for n in confidence)
    target_layer = {n.removeprefix("layers.0.") for n in names if n.startswith("layers.0.")}
    stages = {}
    for place in placed.values():
        if place and place[0] == "layer":
            stage, rest = place[1].removeprefix("layers.").split(".", 1)
            stages.setdefault(int(stage), set()).add(rest)
    assert sorted(stages) == [0, 1, 2]
    # the small plan's one target layer is hash-routed (tid2eid, no gate bias) with a
    # compressor and indexer; a stage is a plain sliding-window layer
    target_only = {n for n in target_layer if ".compressor." in n or ".indexer." in n}
    target_only.add("ffn.gate.tid2eid")
    for rest in stages.values():
        assert rest - target_layer == {"ffn.gate.bias"}
        assert target_layer - rest == target_only
    draft = [place[1] for place in placed.values() if place and place[0] == "draft"]
    assert len(draft) == len(set(draft))
    assert {"main_proj.weight", "main_norm.weight", "norm.weight", "hc_head_fn"} <= set(draft)
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= set(draft)


@pytest.mark.parametrize("version", ["0.20.2", "0.24.0"])
def test_before_025_the_v4_stages_pass_to_vllm_only_when_asked_for(
    built: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """vLLM 0.20-0.24 have V4 without its draft class; the overlay brings one (the
    first and last of them, whose V4 blocks differ most). The installed source here
    is the release's real tree (the probe reads it), the checkpoint the built tiny
    V4; vLLM's config call is recorded, not run (the CPU builds have no V4), and its
    draft config is a stand-in with the checkpoint's keys under the name vLLM's
    dflash config gives them."""
    import vllm_builds

    from vllm_v4_patches import sources
    from vllm_v4_patches.dspark import DRAFT_METHOD_MARK, V4_STAND_IN_ARCHITECTURE
    from vllm_v4_patches.dspark.config_hooks import V4_ON_V1_SETTING, accept_dspark_as_dflash

    tree = sources.TreeSource(str(vllm_builds.fetch_source(version)))
    monkeypatch.setattr(sources, "InstalledSource", lambda: tree)
    keys = {**read_json(built / "config.json"), "architectures": [V4_STAND_IN_ARCHITECTURE]}
    draft = SimpleNamespace(hf_config=SimpleNamespace(**keys))
    config = SimpleNamespace(draft_model_config=draft)
    calls: list[dict] = []

    class Target:
        model = str(built)

    request = {
        "method": "dspark",
        "model": str(built),
        "target_model_config": Target(),
        "num_speculative_tokens": keys["dspark_block_size"],
    }
    monkeypatch.delenv(V4_ON_V1_SETTING, raising=False)
    with pytest.raises(ValueError) as refused:
        accept_dspark_as_dflash(lambda **kw: calls.append(kw), config, (), request)
    line = str(refused.value)
    assert "\n" not in line and f"{V4_ON_V1_SETTING}=on" in line and calls == []
    monkeypatch.setenv(V4_ON_V1_SETTING, "on")
    accept_dspark_as_dflash(lambda **kw: calls.append(kw), config, (), request)
    assert [call["method"] for call in calls] == ["dflash"]
    assert getattr(draft.hf_config, DRAFT_METHOD_MARK) == "dspark"
    # config.json has no stage count; the checkpoint's (inference config, weights) is
    # what the overlay's V4 class builds
    assert "n_mtp_layers" not in keys and draft.hf_config.n_mtp_layers == 3
    other = {**request, "num_speculative_tokens": keys["dspark_block_size"] + 2}
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        accept_dspark_as_dflash(lambda **kw: calls.append(kw), config, (), other)


def test_the_overlays_v4_class_takes_the_stage_count_from_the_checkpoint(built: Path) -> None:
    """``config.json`` has no stage count: the draft config's ``n_mtp_layers`` (set
    by the stand-in route), else the local spec's, else one line naming the key."""
    from vllm_v4_patches.dspark.checkpoint import draft_spec, load_draft_spec
    from vllm_v4_patches.dspark.v4_stages import stage_count

    keys = read_json(built / "config.json")
    loaded = SimpleNamespace(**keys)
    assert stage_count(loaded, load_draft_spec(str(built))) == 3
    assert stage_count(SimpleNamespace(**keys, n_mtp_layers=3), draft_spec(loaded)) == 3
    with pytest.raises(ValueError, match="n_mtp_layers") as refused:
        stage_count(loaded, draft_spec(loaded))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("version", ["0.20.2", "0.21.0"])
def test_on_020_021_a_v4_target_passes_the_tap_model_list_for_that_call_alone(
    built: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """vLLM 0.20-0.21 refuse dflash (the method the stand-in route runs as) for a
    target whose model type is not on a fixed list; DeepSeek-V4 is not (the H200's
    0.20.2 run, 2026-12-05). The list check here is the release's own code, compiled
    from its source (its config needs a GPU model); the target's config is
    transformers' real DeepSeek-V4 one. Without the probe's fact the check refuses;
    with it the V4 target passes, its type is back afterwards, also when the call
    fails, and any other type is checked as before."""
    import vllm_builds
    from release_code import release_method
    from transformers import DeepseekV4Config

    from vllm_v4_patches.dspark import TAPS_GATE_LIST, V4_STAND_IN_ARCHITECTURE
    from vllm_v4_patches.dspark.config_hooks import V4_ON_V1_SETTING, accept_dspark_as_dflash

    gate = release_method(
        vllm_builds.fetch_source(version),
        "vllm/config/speculative.py",
        "SpeculativeConfig",
        "_verify_args",
        keep={TAPS_GATE_LIST},
    )
    keys = {**read_json(built / "config.json"), "architectures": [V4_STAND_IN_ARCHITECTURE]}
    config = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(**keys)))
    text_config = DeepseekV4Config()
    target = SimpleNamespace(model=str(built), hf_text_config=text_config)
    request = {
        "method": "dspark",
        "model": str(built),
        "target_model_config": target,
        "num_speculative_tokens": keys["dspark_block_size"],
    }
    seen: list[str] = []

    def speculative_config_init(**kwargs: Any) -> None:
        gate(SimpleNamespace(**kwargs))
        seen.append(kwargs["target_model_config"].hf_text_config.model_type)

    monkeypatch.setenv(V4_ON_V1_SETTING, "on")
    with pytest.raises(ValueError, match="is only supported for"):
        accept_dspark_as_dflash(speculative_config_init, config, (), request)
    accept_dspark_as_dflash(speculative_config_init, config, (), request, v4_taps_gate=True)
    assert seen == ["deepseek_v3"]
    assert text_config.model_type == "deepseek_v4" and "model_type" not in vars(text_config)

    def failing_init(**kwargs: Any) -> None:
        raise RuntimeError("the config failed after the list check")

    with pytest.raises(RuntimeError):
        accept_dspark_as_dflash(failing_init, config, (), request, v4_taps_gate=True)
    assert text_config.model_type == "deepseek_v4" and "model_type" not in vars(text_config)
    other = SimpleNamespace(model=str(built), hf_text_config=SimpleNamespace(model_type="olmo"))
    with pytest.raises(ValueError, match="is only supported for"):
        accept_dspark_as_dflash(
            speculative_config_init,
            config,
            (),
            {**request, "target_model_config": other},
            v4_taps_gate=True,
        )
