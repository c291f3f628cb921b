"""Write a shrunken DeepSeek-V4-Flash checkpoint (with its three DSpark draft stages)
in the real on-disk format, so that stock vLLM's ``DeepseekV4ForCausalLM`` loads it
with its normal weight loader (no ``load_format="dummy"``).

    python tools/build_tiny_v4.py OUT_DIR [--layers 3] [--experts 8] [--topk 2]
                                          [--vocab 4096] [--seed 0] [--force]
    python tools/build_tiny_v4.py OUT_DIR --dry-run   # the tensor inventory only

Needs only the standard library, torch (>= 2.1, for ``float8_e4m3fn``) and, for the
tokenizer, ``tokenizers`` when it is importable (a minimal byte-level tokenizer is
written by hand otherwise). safetensors files are written by this script itself
(the format is a JSON header plus raw little-endian bytes, written in the order and
layout safetensors itself uses), so the output does not depend on which dtypes the
installed ``safetensors`` can serialise (``F8_E8M0`` needs a recent one). Same
arguments and seed, same bytes: every tensor is drawn from its own generator seeded
by ``(seed, tensor name)``.

What is kept from the real model
--------------------------------
Every width, dtype and quantisation format is DeepSeek-V4-Flash's, so that every
GPU kernel sees the shapes it was written for. The values come from the
``config.json`` of deepseek-ai/DeepSeek-V4-Flash-0731 (revision 7872f01b), as
transcribed verbatim in public code that pins that file by SHA-256 (a Rust crate's
test constant ``OFFICIAL_CONFIG``, and a Python module freezing the per-layer
contract of the same checkpoint); ``docs``-style notes in the project
(``shared/reference/dspark.md`` section 6.1, ``gpu-vllm.md``) agree:

hidden 4096, 64 heads x head_dim 512 (``qk_rope_head_dim`` 64, one KV head),
``q_lora_rank`` 1024, ``o_lora_rank`` 1024, ``o_groups`` 8, ``moe_intermediate_size``
2048, one shared expert, ``hc_mult`` 4, ``hc_eps`` 1e-6, ``hc_sinkhorn_iters`` 20,
``index_topk`` 512, ``index_n_heads`` 64, ``index_head_dim`` 128, ``sliding_window``
128, ``swiglu_limit`` 10, ``rms_norm_eps`` 1e-6, ``rope_theta`` 10000,
``compress_rope_theta`` 160000, YaRN (factor 16, beta_fast 32, beta_slow 1,
original 65536), ``max_position_embeddings`` 1048576, ``scoring_func`` sqrtsoftplus,
``topk_method`` noaux_tc (so learned-router layers carry ``ffn.gate.bias``),
``routed_scaling_factor`` 1.5, ``norm_topk_prob``, ``expert_dtype`` fp4,
``quantization_config`` {fp8 e4m3, dynamic activations, ``scale_fmt`` ue8m0,
128x128 blocks}, bos 0 / eos 1, ``num_nextn_predict_layers`` 1 (not the DSpark
stage count), ``dspark_block_size`` 5, ``dspark_markov_rank`` 256.

Tensor names, shapes and dtypes are those of the real checkpoint. They were
checked against the published ``model.safetensors.index.json`` figures (72317
tensors in 48 shards: 6 root tensors; 1565 for a ratio-0 hash-routed layer, 1576
for a ratio-4 layer, 1569 for a ratio-128 learned-router layer, 1568 / 1565 / 1572
for ``mtp.0`` / ``mtp.1`` / ``mtp.2``) and the published shard file sizes: built
with the real widths (``Plan(4, 256, 6, 129280)``, whose layers are exactly the real
layers 0-3), every shard this script writes has exactly the byte size of the
corresponding real shard (the embedding, layers 0-3, the head shard and the three
``mtp`` shards), header included; the test suite checks this from the inventory
alone. Any other dtype for a norm, the hash table, the compressor, a scale or a
head would change the sizes:

* attention ``wq_a``, ``wkv``, ``wq_b``, ``wo_a``, ``wo_b``, indexer ``wq_b``, shared
  experts, ``mtp.0.main_proj``: ``F8_E4M3`` weight + ``.scale`` ``F8_E8M0`` per
  128x128 block (power-of-two scale, rounded up so that ``|w / scale| <= 448``);
* routed experts ``ffn.experts.{e}.w{1,2,3}``: MXFP4 - e2m1 codes packed two per
  byte (low nibble = even column), stored as ``I8`` ``[out, in / 2]``, + ``.scale``
  ``F8_E8M0`` per 32 columns ``[out, in / 32]``;
* ``embed``/``head``, norms, ``ffn.gate.weight``, compressor ``wkv``/``wgate``,
  indexer ``weights_proj``, Markov and confidence heads: ``BF16``;
* ``hc_*`` (mHC), ``attn_sink``, compressor ``ape``, ``ffn.gate.bias``: ``F32``;
* ``ffn.gate.tid2eid`` (hash-routed layers): ``I64`` ``[vocab, topk]``.

What is cut
-----------
* depth: ``--layers`` target layers (1-4, default 3). Their compress ratios follow
  the real model's pattern, so the defaults cover every attention kind: 1 -> [4],
  2 -> [4, 128], 3 -> [0, 4, 128], 4 -> [0, 0, 4, 128] (the real first four layers).
  The three draft stages are ratio 0 (plain sliding window), as in the real
  checkpoint, so ratio 0 is exercised even with 1-2 target layers. ``compress_ratios``
  has ``layers + 3`` entries, like the real 46 = 43 + 3.
* ``num_hash_layers``: the real 3 cannot leave a learned-router target layer when
  there are 3 layers or fewer, so it is ``min(3, max(1, layers - 1))``: 1 hash-routed
  layer with 1-2 layers, 2 with 3, the real 3 with 4. (The draft stages always route
  by the learned gate: vLLM names them ``layers.{num_hidden_layers + i}``.)
* experts: ``--experts`` routed experts (default 8, real 256), ``--topk`` per token
  (default 2, real 6). The hash table is ``[vocab, topk]``, each row ``topk``
  distinct experts.
* vocabulary: ``--vocab`` (default 4096, real 129280 = 1010 x 128). A multiple of 128
  is required (vLLM pads embeddings to 64; 128 keeps the real model's alignment),
  at least 1024 (room for the 256 byte tokens, the merges and the special tokens).
* DSpark taps: ``dspark_target_layer_ids`` are the last ``min(3, layers)`` target
  layers (real ``[40, 41, 42]``, the last three); vLLM only needs each id below
  ``num_hidden_layers`` and sizes ``main_proj`` as ``[hidden, hidden * len(ids)]``.
* ``dspark_noise_token_id``: a special token of the tiny tokenizer
  (``<｜dspark▁noise｜>``, a name of this script's own), near the top of the
  vocabulary as the real 128799 is. The tokenizer leaves the last 64 ids unused
  (padding rows of the embedding and head); its bos/eos are ids 0/1, as the real
  ones.

Random weights, chosen so activations stay finite: normal, std 0.02, before
quantisation; norms 1; ``attn_sink`` N(0, 0.1); gate bias N(0, 0.01); compressor
``ape`` N(0, 0.02). The mHC parameters keep the Sinkhorn well conditioned:
``hc_*_fn`` N(0, 0.002) (the mixing logits are ``x . fn`` over ``hc_mult * hidden``
unit-RMS lanes, so their std is ~0.26), ``hc_*_scale`` 1, and ``hc_*_base`` set so
that at zero logits the pre-mix is the mean of the 4 copies (``sigmoid(-ln 3)`` =
1/4), the post-mix is 1 (``2 * sigmoid(0)``) and the residual mix is uniform.

Files: ``config.json``, ``inference/config.json`` (the reference implementation's
``ModelArgs`` names, including ``n_mtp_layers`` 3, as the real repository ships),
``generation_config.json``, ``model-0000k-of-0000n.safetensors`` (one shard for the
embedding, one per target layer, one for ``head``/``norm``/``hc_head_*``, one per
draft stage, in the real checkpoint's order) with ``model.safetensors.index.json``,
and the tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

# --- the real DeepSeek-V4-Flash(-0731) widths and settings (see the docstring) ---
HIDDEN = 4096
N_HEADS = 64
HEAD_DIM = 512
ROPE_DIM = 64
Q_LORA_RANK = 1024
O_LORA_RANK = 1024
O_GROUPS = 8
MOE_INTER = 2048
N_SHARED_EXPERTS = 1
HC_MULT = 4
INDEX_N_HEADS = 64
INDEX_HEAD_DIM = 128
INDEX_TOPK = 512
SLIDING_WINDOW = 128
MARKOV_RANK = 256
DSPARK_BLOCK_SIZE = 5
DSPARK_STAGES = 3
REAL_NUM_HASH_LAYERS = 3
FP8_BLOCK = 128  # quantization_config.weight_block_size
FP4_BLOCK = 32  # MXFP4 scale group along the input dimension
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1
WEIGHT_STD = 0.02
BOS_ID, EOS_ID = 0, 1
UNUSED_TOP_IDS = 64  # ids at the top of the vocabulary that no token uses

# compress ratio per target layer, by depth (docstring, "What is cut")
LAYER_PLANS = {1: [4], 2: [4, 128], 3: [0, 4, 128], 4: [0, 0, 4, 128]}

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
NOISE_TOKEN = "<｜dspark▁noise｜>"
# tokens vLLM's DeepSeek-V4 chat encoding writes (vllm/tokenizers/deepseek_v4_encoding.py)
CHAT_TOKENS = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜latest_reminder｜>",
]


@dataclass(frozen=True)
class Plan:
    layers: int
    experts: int
    topk: int
    vocab: int
    seed: int
    # 0: a random head over the whole vocabulary; K: only K rows are non-zero
    live_tokens: int = 0

    @property
    def compress_ratios(self) -> list[int]:
        return LAYER_PLANS[self.layers] + [0] * DSPARK_STAGES

    @property
    def num_hash_layers(self) -> int:
        return min(REAL_NUM_HASH_LAYERS, max(1, self.layers - 1))

    @property
    def target_layer_ids(self) -> list[int]:
        return list(range(max(0, self.layers - 3), self.layers))


def validate(plan: Plan) -> None:
    if plan.layers not in LAYER_PLANS:
        raise SystemExit(f"--layers must be 1..4, got {plan.layers}")
    if plan.experts < 1 or not 1 <= plan.topk <= plan.experts:
        raise SystemExit(f"need 1 <= --topk <= --experts, got {plan.topk} and {plan.experts}")
    if plan.vocab % 128 or plan.vocab < 1024:
        raise SystemExit(f"--vocab must be a multiple of 128 and >= 1024, got {plan.vocab}")
    if plan.live_tokens and not 2 <= plan.live_tokens <= plan.vocab - FIRST_LIVE_TOKEN:
        raise SystemExit(f"--live-tokens must be 0 or 2..{plan.vocab - FIRST_LIVE_TOKEN}")


# --------------------------------------------------------------------------------------
# quantisation (the real encodings; the tests decode them back)
# --------------------------------------------------------------------------------------


def _ue8m0_exponent(ratio: torch.Tensor) -> torch.Tensor:
    """The smallest e with 2**e >= ratio (ratio > 0), as int32: a UE8M0 scale that
    never lets a block's largest magnitude overflow the element format."""
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2**exponent, m in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)


def quantize_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [O, K] -> (e4m3 codes as uint8 [O, K], UE8M0 scale bytes [ceil(O/128),
    ceil(K/128)]) with ``weight ~= codes * 2**(scale - 127)`` per 128x128 block.
    ``weight`` is overwritten (it is scaled in place)."""
    out_dim, in_dim = weight.shape
    rows, cols = -(-out_dim // FP8_BLOCK), -(-in_dim // FP8_BLOCK)
    if (rows * FP8_BLOCK, cols * FP8_BLOCK) != (out_dim, in_dim):
        padded = weight.new_zeros(rows * FP8_BLOCK, cols * FP8_BLOCK)
        padded[:out_dim, :in_dim] = weight
        weight = padded
    blocks = weight.view(rows, FP8_BLOCK, cols, FP8_BLOCK)
    amax = torch.maximum(blocks.amax(dim=(1, 3)), -blocks.amin(dim=(1, 3)))
    exponent = _ue8m0_exponent(amax.clamp(min=2.0**-100) / FP8_MAX)
    blocks.div_(torch.exp2(exponent.float())[:, None, :, None])  # exact: powers of two
    codes = weight[:out_dim, :in_dim].to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.contiguous(), (exponent + 127).to(torch.uint8)


def dequantize_fp8_block(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    out_dim, in_dim = codes.shape
    values = codes.view(torch.float8_e4m3fn).float()
    scale = torch.exp2(scale_bytes.float() - 127)
    scale = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return values * scale[:out_dim, :in_dim]


# e2m1 magnitudes by 3-bit code; bit 3 is the sign
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between neighbouring e2m1 values, negative and positive: bucketize gives
# the nearest of the 15 values in ascending order (an exact tie goes to the lower one)
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP4_BOUNDS = torch.tensor([-m for m in reversed(_FP4_MIDPOINTS)] + list(_FP4_MIDPOINTS))
# bucket (ascending value, -6 .. 6) -> 4-bit code (sign bit 3, magnitude bits 0-2)
_FP4_CODE_OF_BUCKET = torch.tensor([8 | m for m in range(7, 0, -1)] + list(range(8)))


def quantize_fp4_mx(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [O, K] -> (packed e2m1 bytes [O, K/2], UE8M0 scale bytes [O, K/32]) with
    ``weight ~= e2m1 * 2**(scale - 127)`` per 32 columns; column 2j is the low nibble
    of byte j, column 2j+1 the high nibble. ``weight`` is overwritten."""
    out_dim, in_dim = weight.shape
    if in_dim % FP4_BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {FP4_BLOCK}")
    groups = weight.view(out_dim, in_dim // FP4_BLOCK, FP4_BLOCK)
    amax = torch.maximum(groups.amax(dim=2), -groups.amin(dim=2))
    exponent = _ue8m0_exponent(amax.clamp(min=2.0**-100) / FP4_MAX)
    groups.div_(torch.exp2(exponent.float())[:, :, None])
    bucket = torch.bucketize(weight, _FP4_BOUNDS, out_int32=True)
    nibbles = _FP4_CODE_OF_BUCKET.to(torch.uint8)[bucket]
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8)


def dequantize_fp4_mx(packed: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    out_dim = packed.shape[0]
    packed = packed.view(torch.uint8)
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(out_dim, -1).long()
    table = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES))
    scale = torch.exp2(scale_bytes.view(torch.uint8).float() - 127)
    return table[nibbles] * scale.repeat_interleave(FP4_BLOCK, 1)


# --------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------

# bytes per element of the safetensors dtypes written here
DTYPE_BYTES = {"BF16": 2, "F32": 4, "I64": 8, "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E8M0": 1}

_SCRATCH = [torch.empty(0)]  # see Tensors._scratch_normal


class Tensors:
    """The tensors of one shard: name -> (safetensors dtype, shape, raw bytes).

    With ``dry=True`` only names, dtypes and shapes are recorded (raw is ``None``):
    the inventory of a plan in milliseconds, for ``--dry-run`` and the tests."""

    def __init__(self, seed: int, *, dry: bool = False) -> None:
        self.seed = seed
        self.dry = dry
        self.items: dict[str, tuple[str, list[int], torch.Tensor | None]] = {}

    def generator(self, name: str) -> torch.Generator:
        """Each tensor's own generator: its values depend on the seed and its name only."""
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)

    def normal(self, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
        """The float32 weight ``name`` (before any quantisation)."""
        return self._normal_into(torch.empty(shape), name, std)

    def _normal_into(self, out: torch.Tensor, name: str, std: float) -> torch.Tensor:
        return out.normal_(0.0, std, generator=self.generator(name))

    def _scratch_normal(self, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
        """``normal`` into a buffer reused across tensors (a weight that is quantised
        right away needs no memory of its own: fresh pages cost more than the draws)."""
        size = math.prod(shape)
        if _SCRATCH[0].numel() < size:
            _SCRATCH[0] = torch.empty(size)
        return self._normal_into(_SCRATCH[0][:size].view(shape), name, std)

    def add(self, name: str, dtype: str, shape: tuple[int, ...], make) -> None:
        """Record ``name``; ``make()`` returns its data (any dtype of the same byte width
        as ``dtype``) and is only called when not dry."""
        raw = None
        if not self.dry:
            tensor = make()
            if list(tensor.shape) != list(shape) or tensor.element_size() != DTYPE_BYTES[dtype]:
                raise AssertionError(f"{name}: made {tensor.dtype} {list(tensor.shape)}")
            raw = tensor.contiguous().view(-1).view(torch.uint8)
        self.items[name] = (dtype, list(shape), raw)

    def bf16(self, name: str, shape: tuple[int, ...], std: float = WEIGHT_STD) -> None:
        self.add(name, "BF16", shape, lambda: self.normal(name, shape, std).to(torch.bfloat16))

    def f32(self, name: str, shape: tuple[int, ...], std: float) -> None:
        self.add(name, "F32", shape, lambda: self.normal(name, shape, std))

    def ones(self, name: str, size: int) -> None:
        self.add(name, "BF16", (size,), lambda: torch.ones(size, dtype=torch.bfloat16))

    def _quantized(
        self, prefix: str, shape: tuple[int, int], quantize: Callable
    ) -> Callable[[int], torch.Tensor]:
        """``make(i)``: part ``i`` of ``quantize``'s (codes, scales) of the seeded
        weight, quantised once when either part is first written."""
        made: list[torch.Tensor] = []

        def make(index: int) -> torch.Tensor:
            if not made:
                made.extend(quantize(self._scratch_normal(prefix + ".weight", shape, WEIGHT_STD)))
            return made[index]

        return make

    def fp8_linear(self, prefix: str, out_dim: int, in_dim: int) -> None:
        """``prefix.weight`` F8_E4M3 [O, K] + ``prefix.scale`` F8_E8M0 per 128x128 block."""
        make = self._quantized(prefix, (out_dim, in_dim), quantize_fp8_block)
        blocks = (-(-out_dim // FP8_BLOCK), -(-in_dim // FP8_BLOCK))
        self.add(prefix + ".weight", "F8_E4M3", (out_dim, in_dim), lambda: make(0))
        self.add(prefix + ".scale", "F8_E8M0", blocks, lambda: make(1))

    def fp4_linear(self, prefix: str, out_dim: int, in_dim: int) -> None:
        """``prefix.weight`` I8 [O, K/2] (packed e2m1) + ``prefix.scale`` F8_E8M0 [O, K/32]."""
        make = self._quantized(prefix, (out_dim, in_dim), quantize_fp4_mx)
        self.add(prefix + ".weight", "I8", (out_dim, in_dim // 2), lambda: make(0))
        self.add(prefix + ".scale", "F8_E8M0", (out_dim, in_dim // FP4_BLOCK), lambda: make(1))

    def hc(self, prefix: str, rows: int, scale_size: int) -> None:
        """mHC parameters: ``_fn`` [rows, hc * hidden], ``_base`` [rows], ``_scale``."""
        self.f32(prefix + "_fn", (rows, HC_MULT * HIDDEN), 0.002)
        self.add(prefix + "_base", "F32", (rows,), lambda: _hc_base(rows))
        self.add(prefix + "_scale", "F32", (scale_size,), lambda: torch.ones(scale_size))

    def hash_table(self, name: str, vocab: int, experts: int, topk: int) -> None:
        """``tid2eid`` I64 [vocab, topk]: ``topk`` distinct experts per token id."""

        def make() -> torch.Tensor:
            scores = torch.rand((vocab, experts), generator=self.generator(name))
            return scores.argsort(dim=1)[:, :topk].contiguous()

        self.add(name, "I64", (vocab, topk), make)

    def nbytes(self) -> int:
        return sum(DTYPE_BYTES[d] * math.prod(shape) for d, shape, _ in self.items.values())


def _hc_base(rows: int) -> torch.Tensor:
    """mHC biases: pre-mix logits at -ln(hc - 1) (sigmoid = 1/hc, the mean of the
    copies), post-mix and residual-mix logits at 0 (post 2 * 1/2 = 1, uniform mix)."""
    base = torch.zeros(rows)
    base[:HC_MULT] = -math.log(HC_MULT - 1)
    return base


def add_block(t: Tensors, prefix: str, plan: Plan, layer_id: int, ratio: int) -> None:
    """One decoder block (a target layer ``layers.{i}.`` or a draft stage ``mtp.{s}.``)."""
    attn = prefix + "attn."
    t.fp8_linear(attn + "wq_a", Q_LORA_RANK, HIDDEN)
    t.fp8_linear(attn + "wkv", HEAD_DIM, HIDDEN)
    t.fp8_linear(attn + "wq_b", N_HEADS * HEAD_DIM, Q_LORA_RANK)
    t.fp8_linear(attn + "wo_a", O_GROUPS * O_LORA_RANK, N_HEADS * HEAD_DIM // O_GROUPS)
    t.fp8_linear(attn + "wo_b", HIDDEN, O_GROUPS * O_LORA_RANK)
    t.ones(attn + "q_norm.weight", Q_LORA_RANK)
    t.ones(attn + "kv_norm.weight", HEAD_DIM)
    t.f32(attn + "attn_sink", (N_HEADS,), 0.1)
    if ratio:
        add_compressor(t, attn + "compressor.", ratio, HEAD_DIM)
    if ratio == 4:
        t.fp8_linear(attn + "indexer.wq_b", INDEX_N_HEADS * INDEX_HEAD_DIM, Q_LORA_RANK)
        t.bf16(attn + "indexer.weights_proj.weight", (INDEX_N_HEADS, HIDDEN))
        add_compressor(t, attn + "indexer.compressor.", ratio, INDEX_HEAD_DIM)
    t.ones(prefix + "attn_norm.weight", HIDDEN)
    t.ones(prefix + "ffn_norm.weight", HIDDEN)
    mix_hc = (2 + HC_MULT) * HC_MULT
    t.hc(prefix + "hc_attn", mix_hc, 3)
    t.hc(prefix + "hc_ffn", mix_hc, 3)

    ffn = prefix + "ffn."
    t.bf16(ffn + "gate.weight", (plan.experts, HIDDEN))
    if prefix.startswith("layers.") and layer_id < plan.num_hash_layers:
        t.hash_table(ffn + "gate.tid2eid", plan.vocab, plan.experts, plan.topk)
    else:
        t.f32(ffn + "gate.bias", (plan.experts,), 0.01)
    shared = MOE_INTER * N_SHARED_EXPERTS
    t.fp8_linear(ffn + "shared_experts.w1", shared, HIDDEN)
    t.fp8_linear(ffn + "shared_experts.w3", shared, HIDDEN)
    t.fp8_linear(ffn + "shared_experts.w2", HIDDEN, shared)
    for expert in range(plan.experts):
        t.fp4_linear(f"{ffn}experts.{expert}.w1", MOE_INTER, HIDDEN)
        t.fp4_linear(f"{ffn}experts.{expert}.w3", MOE_INTER, HIDDEN)
        t.fp4_linear(f"{ffn}experts.{expert}.w2", HIDDEN, MOE_INTER)


def add_compressor(t: Tensors, prefix: str, ratio: int, head_dim: int) -> None:
    width = (1 + (ratio == 4)) * head_dim  # ratio 4 compresses overlapping windows
    t.bf16(prefix + "wkv.weight", (width, HIDDEN))
    t.bf16(prefix + "wgate.weight", (width, HIDDEN))
    t.f32(prefix + "ape", (ratio, width), 0.02)
    t.ones(prefix + "norm.weight", head_dim)


def add_head(t: Tensors, prefix: str) -> None:
    """Final norm and the mHC reduction (the target's root, or the last draft stage)."""
    t.ones(prefix + "norm.weight", HIDDEN)
    t.hc(prefix + "hc_head", HC_MULT, 1)


# the live head's first row: past bos (0) and eos (1)
FIRST_LIVE_TOKEN = 2


def add_live_head(t: Tensors, plan: Plan) -> None:
    """A head whose rows are zero but for ``plan.live_tokens`` random ones: greedy
    picks are among those few tokens, so the best and second-best logits lie
    further apart than among 4,096 random rows, and fewer picks are near-ties that
    numeric noise flips (every other logit is exactly 0, and the best of K random
    logits is positive with probability 1 - 2**-K)."""
    add_live_rows(t, "head.weight", plan, HIDDEN)


def add_live_rows(t: Tensors, name: str, plan: Plan, width: int) -> None:
    """``name`` as a [vocab, width] BF16 matrix, zero but for the live tokens' rows
    (the LM head, and the Markov head's output so that its bias is zero outside
    them too and the draft picks among the same tokens)."""
    shape = (plan.vocab, width)
    live = slice(FIRST_LIVE_TOKEN, FIRST_LIVE_TOKEN + plan.live_tokens)

    def make() -> torch.Tensor:
        matrix = torch.zeros(shape, dtype=torch.bfloat16)
        matrix[live] = t.normal(name, (plan.live_tokens, width), WEIGHT_STD).to(torch.bfloat16)
        return matrix

    t.add(name, "BF16", shape, make)


def shards(plan: Plan, *, dry: bool = False) -> Iterator[tuple[str, Tensors]]:
    """(what, tensors) per shard, in the real checkpoint's order; each shard is
    generated only when the writer asks for it."""
    t = Tensors(plan.seed, dry=dry)
    t.bf16("embed.weight", (plan.vocab, HIDDEN))
    yield "embed", t
    for layer_id, ratio in enumerate(LAYER_PLANS[plan.layers]):
        t = Tensors(plan.seed, dry=dry)
        add_block(t, f"layers.{layer_id}.", plan, layer_id, ratio)
        yield f"layer {layer_id} (compress ratio {ratio})", t
    t = Tensors(plan.seed, dry=dry)
    if plan.live_tokens:
        add_live_head(t, plan)
    else:
        t.bf16("head.weight", (plan.vocab, HIDDEN))
    add_head(t, "")
    yield "head", t
    for stage in range(DSPARK_STAGES):
        t = Tensors(plan.seed, dry=dry)
        prefix = f"mtp.{stage}."
        if stage == 0:
            t.fp8_linear(prefix + "main_proj", HIDDEN, HIDDEN * len(plan.target_layer_ids))
            t.ones(prefix + "main_norm.weight", HIDDEN)
        add_block(t, prefix, plan, plan.layers + stage, 0)
        if stage == DSPARK_STAGES - 1:
            add_head(t, prefix)
            t.bf16(prefix + "markov_head.markov_w1.weight", (plan.vocab, MARKOV_RANK))
            if plan.live_tokens:
                add_live_rows(t, prefix + "markov_head.markov_w2.weight", plan, MARKOV_RANK)
            else:
                t.bf16(prefix + "markov_head.markov_w2.weight", (plan.vocab, MARKOV_RANK))
            t.bf16(prefix + "confidence_head.proj.weight", (1, HIDDEN + MARKOV_RANK))
        yield f"draft stage {stage}", t


def inventory(plan: Plan) -> dict[str, tuple[str, list[int]]]:
    """Every tensor the plan's checkpoint holds: name -> (safetensors dtype, shape)."""
    validate(plan)
    return {
        name: (dtype, shape)
        for _, tensors in shards(plan, dry=True)
        for name, (dtype, shape, _) in tensors.items.items()
    }


# safetensors' own writer orders tensors by dtype (this rank, descending), then name
_DTYPE_RANK = ("U8", "I8", "F8_E4M3", "F8_E8M0", "BF16", "F32", "I64")


def file_order(tensors: Tensors) -> list[str]:
    return sorted(tensors.items, key=lambda n: (-_DTYPE_RANK.index(tensors.items[n][0]), n))


def safetensors_header(tensors: Tensors) -> bytes:
    """The header of ``tensors``' file, as the real checkpoint's are written: JSON
    without ``__metadata__``, tensors in safetensors' own order (dtype, then name),
    padded with spaces to a multiple of 8. With this, the full-size plan's shards
    have exactly the published files' sizes (see the tests)."""
    header: dict[str, object] = {}
    offset = 0
    for name in file_order(tensors):
        dtype, shape, _ = tensors.items[name]
        size = DTYPE_BYTES[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return encoded + b" " * (-len(encoded) % 8)


def write_safetensors(path: str, tensors: Tensors) -> None:
    """The safetensors layout: u64 little-endian header length, header, data."""
    header = safetensors_header(tensors)
    with open(path, "wb") as handle:
        handle.write(len(header).to_bytes(8, "little"))
        handle.write(header)
        for name in file_order(tensors):
            handle.write(memoryview(tensors.items[name][2].numpy()))


# --------------------------------------------------------------------------------------
# config and tokenizer
# --------------------------------------------------------------------------------------


def hf_config(plan: Plan, noise_token_id: int) -> dict:
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "expert_dtype": "fp4",
        "hc_eps": 1e-06,
        "hc_mult": HC_MULT,
        "hc_sinkhorn_iters": 20,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "index_head_dim": INDEX_HEAD_DIM,
        "index_n_heads": INDEX_N_HEADS,
        "index_topk": INDEX_TOPK,
        "initializer_range": 0.02,
        "max_position_embeddings": 1048576,
        "model_type": "deepseek_v4",
        "moe_intermediate_size": MOE_INTER,
        "n_routed_experts": plan.experts,
        "n_shared_experts": N_SHARED_EXPERTS,
        "norm_topk_prob": True,
        "num_attention_heads": N_HEADS,
        "num_experts_per_tok": plan.topk,
        "num_hidden_layers": plan.layers,
        "num_hash_layers": plan.num_hash_layers,
        "live_tokens": plan.live_tokens,
        "num_key_value_heads": 1,
        "num_nextn_predict_layers": 1,
        "o_groups": O_GROUPS,
        "o_lora_rank": O_LORA_RANK,
        "q_lora_rank": Q_LORA_RANK,
        "qk_rope_head_dim": ROPE_DIM,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        },
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "sliding_window": SLIDING_WINDOW,
        "swiglu_limit": 10.0,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "use_cache": True,
        "vocab_size": plan.vocab,
        "compress_rope_theta": 160000,
        "compress_ratios": plan.compress_ratios,
        "dspark_block_size": DSPARK_BLOCK_SIZE,
        "dspark_noise_token_id": noise_token_id,
        "dspark_target_layer_ids": plan.target_layer_ids,
        "dspark_markov_rank": MARKOV_RANK,
    }


def inference_config(plan: Plan, noise_token_id: int) -> dict:
    """``inference/config.json``: the reference implementation's ``ModelArgs`` names."""
    return {
        "vocab_size": plan.vocab,
        "dim": HIDDEN,
        "moe_inter_dim": MOE_INTER,
        "n_layers": plan.layers,
        "n_hash_layers": plan.num_hash_layers,
        "n_mtp_layers": DSPARK_STAGES,
        "n_heads": N_HEADS,
        "dtype": "fp8",
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
        "n_routed_experts": plan.experts,
        "n_shared_experts": N_SHARED_EXPERTS,
        "n_activated_experts": plan.topk,
        "score_func": "sqrtsoftplus",
        "route_scale": 1.5,
        "swiglu_limit": 10.0,
        "q_lora_rank": Q_LORA_RANK,
        "head_dim": HEAD_DIM,
        "rope_head_dim": ROPE_DIM,
        "norm_eps": 1e-06,
        "o_groups": O_GROUPS,
        "o_lora_rank": O_LORA_RANK,
        "window_size": SLIDING_WINDOW,
        "compress_ratios": plan.compress_ratios,
        "compress_rope_theta": 160000.0,
        "original_seq_len": 65536,
        "rope_theta": 10000.0,
        "rope_factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "index_n_heads": INDEX_N_HEADS,
        "index_head_dim": INDEX_HEAD_DIM,
        "index_topk": INDEX_TOPK,
        "hc_mult": HC_MULT,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        "dspark_block_size": DSPARK_BLOCK_SIZE,
        "dspark_noise_token_id": noise_token_id,
        "dspark_target_layer_ids": plan.target_layer_ids,
        "dspark_markov_rank": MARKOV_RANK,
    }


# a fixed English word list and syllables for the tokenizer's synthetic corpus
WORDS = (
    "the of and to in is was that for it with as on be at by this had not are but "
    "from or have an they which one you were her all she there would their we him "
    "been has when who will more no if out so said what up its about into than them "
    "can only other new some could time these two may then do first any my now such "
    "like our over man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how "
    "too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us "
    "great old year off come since against go came right used take three hello name "
    "model token draft speculative decoding deep seek flash layer expert attention"
).split()
SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ng"]


def corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(4000):
        words = []
        for _ in range(rng.randint(4, 16)):
            if rng.random() < 0.6:
                words.append(rng.choice(WORDS))
            else:
                words.append("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))))
        if rng.random() < 0.2:
            words.append(str(rng.randint(0, 99999)))
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", ",", "?", "!", ":", ";"]))
    return lines


def byte_alphabet() -> list[str]:
    """The 256 characters a byte-level BPE uses for the bytes 0..255: printable
    Latin-1 bytes stand for themselves, the others are moved to U+0100 upwards."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(0x100 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def special_tokens() -> list[str]:
    return [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]


def added_tokens() -> list[str]:
    return [*CHAT_TOKENS, NOISE_TOKEN]


def write_tokenizer(out_dir: str, plan: Plan) -> dict[str, int]:
    """A byte-level BPE whose ids all lie below ``vocab - 64``; returns the special ids."""
    budget = plan.vocab - UNUSED_TOP_IDS - len(added_tokens())
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        ids = _write_minimal_tokenizer(out_dir)
    else:
        ids = _train_tokenizer(out_dir, plan.seed, budget)
    if ids[BOS_TOKEN] != BOS_ID or ids[EOS_TOKEN] != EOS_ID:
        raise RuntimeError(f"tokenizer put bos/eos at {ids[BOS_TOKEN]}/{ids[EOS_TOKEN]}")
    if max(ids.values()) >= plan.vocab - UNUSED_TOP_IDS:
        raise RuntimeError("tokenizer vocabulary does not fit the model's")
    token = {"content": None, "lstrip": False, "normalized": False, "rstrip": False}
    token["single_word"] = False
    _write_json(
        out_dir,
        "tokenizer_config.json",
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": dict(token, content=BOS_TOKEN),
            "eos_token": dict(token, content=EOS_TOKEN),
            "pad_token": dict(token, content=PAD_TOKEN),
            "clean_up_tokenization_spaces": False,
            "legacy": True,
            "model_max_length": 1048576,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    _write_json(
        out_dir,
        "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    return ids


def _train_tokenizer(out_dir: str, seed: int, budget: int) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=budget,
        special_tokens=special_tokens(),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed), trainer)
    tokenizer.add_special_tokens(added_tokens())
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    return {token: tokenizer.token_to_id(token) for token in special_tokens() + added_tokens()}


def _write_minimal_tokenizer(out_dir: str) -> dict[str, int]:
    """Without ``tokenizers``: a byte-level BPE with the 256 byte tokens and no merges."""
    vocab = {token: i for i, token in enumerate(special_tokens())}
    for char in byte_alphabet():
        vocab[char] = len(vocab)
    ids = dict(vocab)
    added = []
    for token in special_tokens() + added_tokens():
        if token not in ids:
            ids[token] = len(ids)
        added.append(
            {
                "id": ids[token],
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": dict(type="ByteLevel", **byte_level),
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": BOS_TOKEN, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {
                BOS_TOKEN: {"id": BOS_TOKEN, "ids": [BOS_ID], "tokens": [BOS_TOKEN]}
            },
        },
        "decoder": dict(type="ByteLevel", **byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }
    _write_json(out_dir, "tokenizer.json", document)
    return {token: ids[token] for token in special_tokens() + added_tokens()}


def _write_json(out_dir: str, name: str, data: dict) -> None:
    path = os.path.join(out_dir, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, ensure_ascii=False)
        handle.write("\n")


# --------------------------------------------------------------------------------------


def build(out_dir: str, plan: Plan, *, force: bool = False, log=print) -> dict:
    """Write the checkpoint into ``out_dir`` (built in ``out_dir + ".partial"`` and
    renamed, so a reader never sees half a checkpoint). Returns a summary."""
    validate(plan)
    if os.path.exists(out_dir):
        if not force:
            raise SystemExit(f"{out_dir} exists; pass --force to replace it")
        shutil.rmtree(out_dir)
    partial = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    started = time.perf_counter()

    ids = write_tokenizer(partial, plan)
    noise_token_id = ids[NOISE_TOKEN]
    _write_json(partial, "config.json", hf_config(plan, noise_token_id))
    _write_json(partial, "inference/config.json", inference_config(plan, noise_token_id))
    _write_json(partial, "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})

    count = 2 + plan.layers + DSPARK_STAGES
    weight_map: dict[str, str] = {}
    total = 0
    for number, (what, tensors) in enumerate(shards(plan), start=1):
        file_name = f"model-{number:05d}-of-{count:05d}.safetensors"
        write_safetensors(os.path.join(partial, file_name), tensors)
        weight_map.update(dict.fromkeys(tensors.items, file_name))
        total += tensors.nbytes()
        mib = tensors.nbytes() / 2**20
        log(f"  {file_name}: {what}, {len(tensors.items)} tensors, {mib:.1f} MiB")
    _write_json(
        partial,
        "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )
    os.replace(partial, out_dir)
    return {
        "out_dir": out_dir,
        "tensors": len(weight_map),
        "bytes": total,
        "seconds": round(time.perf_counter() - started, 1),
        "noise_token_id": noise_token_id,
        "compress_ratios": plan.compress_ratios,
        "num_hash_layers": plan.num_hash_layers,
        "dspark_target_layer_ids": plan.target_layer_ids,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=3, help="target layers, 1-4 (default 3)")
    parser.add_argument("--experts", type=int, default=8, help="routed experts (default 8)")
    parser.add_argument("--topk", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary (default 4096)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--live-tokens",
        type=int,
        default=0,
        help="only this many LM-head rows non-zero (wider greedy margins; default 0: all)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the tensor inventory; write nothing"
    )
    args = parser.parse_args(argv)
    plan = Plan(args.layers, args.experts, args.topk, args.vocab, args.seed, args.live_tokens)
    if args.dry_run:
        for name, (dtype, shape) in inventory(plan).items():
            print(f"{name}\t{dtype}\t{shape}")
        return 0
    summary = build(args.out_dir, plan, force=args.force)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
