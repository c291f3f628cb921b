"""DSpark's sequential stage on the GPU: the Markov head and the confidence head.

After the parallel backbone has produced base logits for all N slots of a draft
block, DSpark picks the drafts left to right: slot k adds a rank-r bias that
depends on the token chosen at slot k-1 (the anchor for slot 0), then takes the
argmax (or a Gumbel-max sample). The confidence head scores each slot from the
backbone hidden state and the same Markov embedding (dspark.md sections 2-3).

The work per slot is a [B, r] x [r, V] product plus an argmax over V. With
DeepSeek-V4-Flash sizes (V = 129280, r = 256) the bias weight is 66 MB of bf16,
so the stage is bound by reading that weight and the base logits once per slot.
The fused Triton path does exactly that read and keeps the [B, V] logits out of
memory: a tiled GEMM whose epilogue adds the base logits and keeps only each
tile's per-row (max, argmax). By default the tiles merge those into one packed
64-bit key per row with an atomic max (value high, inverted index low, so ties go
to the lowest index as in torch.argmax), the next slot decodes its previous token
from the keys, and one last launch writes tokens and confidences: N + 2 launches
(key fill, N slots, finish). The alternative keeps per-tile partials and reduces
them in a small launch per slot (2 per slot). No host sync either way, so the whole
N-slot loop can be captured in one CUDA graph.

Nothing here imports torch or triton at module import: the overlay package is
imported by every interpreter start, so the heavy modules load on first call.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class MarkovKernelConfig:
    """Tile shape and launch options of the fused per-slot GEMM + argmax kernel.

    The kernel is a K-looped GEMM over (V-tile, row block) items; the programs of one
    V-tile differ in rows, run side by side and share that markov_w2 slice in L2.

    tile_v: vocabulary columns per program; each yields one (max, argmax) per row.
    block_b: batch rows per program.
    block_k: rank slice per pipeline stage.
    atomic_argmax: programs merge their tile's best into one packed 64-bit key per
        row with an atomic max, and the next slot reads its token from there: no
        reduction launch between slots (good while few rows contend per key).
    prefetch_base: issue the base-logits load before the product (K-loop kernel).
    alternate_direction: odd slots walk the V-tiles from the end, so they start on the
        part of markov_w2 the previous slot read last, which is still in L2.
    keep_weight_in_l2: load markov_w2 as evict-last and the logits as evict-first, so
        that the next slot finds more of the weight in L2.
    """

    tile_v: int = 128
    block_b: int = 16
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    atomic_argmax: bool = False
    prefetch_base: bool = False
    alternate_direction: bool = True
    keep_weight_in_l2: bool = True


def default_config(batch: int) -> MarkovKernelConfig:
    """The tuned configuration for a batch size (H200, V = 129280, r = 256, bf16)."""
    if batch <= 16:
        shape = {"tile_v": 256, "block_b": 16, "num_warps": 8}
    elif batch <= 32:
        shape = {"tile_v": 128, "block_b": 32, "num_warps": 4}
    elif batch <= 64:
        shape = {"tile_v": 128, "block_b": 64, "num_warps": 4}
    else:
        shape = {"tile_v": 128, "block_b": 128, "num_warps": 4}
    return MarkovKernelConfig(**shape, atomic_argmax=True, prefetch_base=True)


# ---------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------


@functools.cache
def triton_available() -> bool:
    """Whether triton can be imported, looked up once without importing it."""
    return importlib.util.find_spec("triton") is not None


def pick_backend(base_logits: torch.Tensor) -> str:
    """'triton' for CUDA tensors when triton is installed, else 'torch' (the fallback)."""
    if base_logits.is_cuda and triton_available():
        return "triton"
    return "torch"


def greedy_markov_draft(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy drafts and confidences of one DSpark block (vanilla Markov head).

    Shapes: base_logits [B, N, V], anchor [B] int64, markov_w1 [V, R] (embedding),
    markov_w2 [V, R] (weight of Linear(R, V)), hidden [B, N, H], confidence_w [H + R].
    Returns tokens [B, N] int64 and confidence [B, N] float32.
    """
    if pick_backend(base_logits) == "triton":
        return greedy_markov_draft_triton(
            base_logits, anchor, markov_w1, markov_w2, hidden, confidence_w
        )
    return greedy_markov_draft_reference(
        base_logits, anchor, markov_w1, markov_w2, hidden, confidence_w
    )


def sampled_markov_draft(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    temperature: torch.Tensor,
    gumbel_noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled drafts by Gumbel-max with per-row temperature, plus confidences.

    temperature [B] float32 (0 means greedy for that row); gumbel_noise [B, N, V]
    standard Gumbel samples, passed in so that a test can fix them. Slot k picks
    argmax(logits_k + temperature * noise_k), the same token as
    argmax(logits_k / temperature + noise_k) for temperature > 0, without a division.
    """
    if pick_backend(base_logits) == "triton":
        return sampled_markov_draft_triton(
            base_logits,
            anchor,
            markov_w1,
            markov_w2,
            hidden,
            confidence_w,
            temperature,
            gumbel_noise,
        )
    return sampled_markov_draft_reference(
        base_logits,
        anchor,
        markov_w1,
        markov_w2,
        hidden,
        confidence_w,
        temperature,
        gumbel_noise,
    )


# ---------------------------------------------------------------------------
# PyTorch reference (CPU fallback and correctness oracle)
# ---------------------------------------------------------------------------


def greedy_markov_draft_reference(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot-by-slot PyTorch version of greedy_markov_draft, all arithmetic in fp32."""
    return _draft_reference(base_logits, anchor, markov_w1, markov_w2, hidden, confidence_w)


def sampled_markov_draft_reference(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    temperature: torch.Tensor,
    gumbel_noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot-by-slot PyTorch version of sampled_markov_draft, all arithmetic in fp32."""
    return _draft_reference(
        base_logits,
        anchor,
        markov_w1,
        markov_w2,
        hidden,
        confidence_w,
        temperature,
        gumbel_noise,
    )


def _draft_reference(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    temperature: torch.Tensor | None = None,
    gumbel_noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    batch, num_slots, _ = base_logits.shape
    # fp32 weights: bf16 products are exact in fp32, so only the summation order
    # separates this from the kernel's fp32-accumulating tensor-core product.
    w2_t = markov_w2.float().t()
    weight = confidence_w.float()
    tokens = torch.empty(batch, num_slots, dtype=torch.int64, device=base_logits.device)
    confidence = torch.empty(batch, num_slots, dtype=torch.float32, device=base_logits.device)
    prev = anchor
    for slot in range(num_slots):
        embedding = markov_w1[prev].float()
        logits = base_logits[:, slot].float() + embedding @ w2_t
        if gumbel_noise is not None:
            logits = logits + gumbel_noise[:, slot].float() * temperature.float()[:, None]
        tokens[:, slot] = logits.argmax(dim=-1)
        features = torch.cat([hidden[:, slot].float(), embedding], dim=-1)
        confidence[:, slot] = torch.sigmoid(features @ weight)
        prev = tokens[:, slot]
    return tokens, confidence


# ---------------------------------------------------------------------------
# Fused Triton path
# ---------------------------------------------------------------------------


def greedy_markov_draft_triton(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    config: MarkovKernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_markov_draft on CUDA tensors: 2 kernel launches per slot, no host sync."""
    return _draft_triton(
        base_logits, anchor, markov_w1, markov_w2, hidden, confidence_w, None, None, config
    )


def sampled_markov_draft_triton(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    temperature: torch.Tensor,
    gumbel_noise: torch.Tensor,
    config: MarkovKernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sampled_markov_draft on CUDA tensors: the noise is read in the GEMM epilogue."""
    return _draft_triton(
        base_logits,
        anchor,
        markov_w1,
        markov_w2,
        hidden,
        confidence_w,
        temperature,
        gumbel_noise,
        config,
    )


def _next_power_of_2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


# One packed key per row and slot, padded to its own 128-byte line so that the
# atomics of different rows do not queue on one L2 line.
_KEY_STRIDE = 16
_KEY_EMPTY = -(2**63)


def _draft_triton(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    temperature: torch.Tensor | None,
    gumbel_noise: torch.Tensor | None,
    config: MarkovKernelConfig | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    kernels = _build_kernels()
    batch, num_slots, vocab = base_logits.shape
    config = config or default_config(batch)
    # The kernels index the last dimension of these with unit stride.
    markov_w1 = markov_w1.contiguous()
    markov_w2 = markov_w2.contiguous()
    confidence_w = confidence_w.contiguous()
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()

    device = base_logits.device
    tokens = torch.empty(batch, num_slots, dtype=torch.int64, device=device)
    confidence = torch.empty(batch, num_slots, dtype=torch.float32, device=device)
    num_tiles = -(-vocab // config.tile_v)
    if config.atomic_argmax:
        keys = torch.full(
            (num_slots, batch, _KEY_STRIDE), _KEY_EMPTY, dtype=torch.int64, device=device
        )
        partial_max = partial_index = None
    else:
        keys = None
        partial_max = torch.empty(batch, num_tiles, dtype=torch.float32, device=device)
        partial_index = torch.empty(batch, num_tiles, dtype=torch.int32, device=device)

    for slot in range(num_slots):
        if slot == 0:
            prev, prev_from_keys = anchor, False
        elif keys is not None:
            prev, prev_from_keys = keys[slot - 1, :, 0], True
        else:
            prev, prev_from_keys = tokens[:, slot - 1], False
        _launch_tile_argmax(
            kernels,
            config,
            slot,
            base_logits,
            temperature,
            gumbel_noise,
            prev,
            prev_from_keys,
            markov_w1,
            markov_w2,
            partial_max,
            partial_index,
            None if keys is None else keys[slot],
        )
        if keys is None:
            _launch_finish_slot(
                kernels,
                slot,
                partial_max,
                partial_index,
                prev,
                markov_w1,
                hidden,
                confidence_w,
                tokens,
                confidence,
            )
    if keys is not None:
        _launch_finish_block(
            kernels, keys, anchor, markov_w1, hidden, confidence_w, tokens, confidence
        )
    return tokens, confidence


def _launch_tile_argmax(
    kernels: _Kernels,
    config: MarkovKernelConfig,
    slot: int,
    base_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    gumbel_noise: torch.Tensor | None,
    prev: torch.Tensor,
    prev_from_keys: bool,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    partial_max: torch.Tensor | None,
    partial_index: torch.Tensor | None,
    slot_keys: torch.Tensor | None,
) -> None:
    import torch

    batch, _, vocab = base_logits.shape
    rank = markov_w2.shape[1]
    num_tiles = -(-vocab // config.tile_v)
    use_noise = gumbel_noise is not None
    slot_logits = base_logits[:, slot]
    # Unused pointer arguments still need a tensor; the logits stand in.
    slot_noise = gumbel_noise[:, slot] if use_noise else slot_logits
    row_temperature = temperature.float() if use_noise else slot_logits
    outputs = (
        (slot_keys, slot_keys, slot_keys.stride(0))
        if slot_keys is not None
        else (partial_max, partial_index, partial_max.stride(0))
    )
    rank_block = max(16, _next_power_of_2(rank))
    common = dict(
        TILE_V=config.tile_v,
        BLOCK_B=config.block_b,
        USE_NOISE=use_noise,
        PREV_FROM_KEYS=prev_from_keys,
        ATOMIC=config.atomic_argmax,
        W2_EVICTION="evict_last" if config.keep_weight_in_l2 else "",
        STREAM_EVICTION="evict_first" if config.keep_weight_in_l2 else "",
        DOT_PRECISION="ieee" if markov_w2.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    args = (
        slot_logits,
        slot_logits.stride(0),
        slot_logits.stride(1),
        slot_noise,
        slot_noise.stride(0),
        slot_noise.stride(1),
        row_temperature,
        prev,
        prev.stride(0),
        markov_w1,
        markov_w1.stride(0),
        markov_w2,
        markov_w2.stride(0),
        *outputs,
        batch,
        vocab,
        rank,
        int(config.alternate_direction and slot % 2 == 1),
    )
    num_row_blocks = -(-batch // config.block_b)
    kernels.tile_argmax[(num_tiles * num_row_blocks,)](
        *args,
        num_tiles,
        num_row_blocks,
        BLOCK_K=min(config.block_k, rank_block),
        PREFETCH_BASE=config.prefetch_base,
        **common,
    )


def _launch_finish_slot(
    kernels: _Kernels,
    slot: int,
    partial_max: torch.Tensor,
    partial_index: torch.Tensor,
    prev: torch.Tensor,
    markov_w1: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    tokens: torch.Tensor,
    confidence: torch.Tensor,
) -> None:
    batch, num_tiles = partial_max.shape
    slot_hidden = hidden[:, slot]
    kernels.finish_slot[(batch,)](
        partial_max,
        partial_index,
        partial_max.stride(0),
        num_tiles,
        prev,
        prev.stride(0),
        markov_w1,
        markov_w1.stride(0),
        slot_hidden,
        slot_hidden.stride(0),
        confidence_w,
        tokens[:, slot],
        tokens.stride(0),
        confidence[:, slot],
        confidence.stride(0),
        hidden.shape[-1],
        markov_w1.shape[1],
        BLOCK_TILES=_next_power_of_2(num_tiles),
        BLOCK_RANK=_next_power_of_2(markov_w1.shape[1]),
        BLOCK_H=min(1024, _next_power_of_2(hidden.shape[-1])),
        num_warps=4,
    )


def _launch_finish_block(
    kernels: _Kernels,
    keys: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    tokens: torch.Tensor,
    confidence: torch.Tensor,
) -> None:
    batch, num_slots = tokens.shape
    kernels.finish_block[(batch,)](
        keys,
        keys.stride(0),
        keys.stride(1),
        anchor,
        anchor.stride(0),
        markov_w1,
        markov_w1.stride(0),
        hidden,
        hidden.stride(0),
        hidden.stride(1),
        confidence_w,
        tokens,
        tokens.stride(0),
        confidence,
        confidence.stride(0),
        num_slots,
        hidden.shape[-1],
        markov_w1.shape[1],
        BLOCK_RANK=_next_power_of_2(markov_w1.shape[1]),
        BLOCK_H=min(1024, _next_power_of_2(hidden.shape[-1])),
        num_warps=4,
    )


@dataclass(frozen=True)
class _Kernels:
    tile_argmax: Any
    finish_slot: Any
    finish_block: Any


@functools.cache
def _build_kernels() -> _Kernels:
    """Defines the jitted kernels once per process (each compiles on first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def load_prev(prev_ptr, prev_stride, rows64, row_ok, PREV_FROM_KEYS: tl.constexpr):
        """Previous tokens of these rows: the anchor/token ids, or decoded packed keys."""
        if PREV_FROM_KEYS:
            key = tl.load(prev_ptr + rows64 * prev_stride, mask=row_ok, other=0)
            prev = decode_key(key)
        else:
            prev = tl.load(prev_ptr + rows64 * prev_stride, mask=row_ok, other=0)
        # Rows past the batch gather row 0 of markov_w1; their results are dropped.
        return tl.where(row_ok, prev, 0).to(tl.int64)

    @triton.jit
    def decode_key(key):
        low = key - ((key >> 32) << 32)
        return 2147483647 - low

    @triton.jit
    def store_tile_best(
        logits,
        rows64,
        row_ok,
        tile,
        out_a_ptr,
        out_b_ptr,
        out_stride,
        TILE_V: tl.constexpr,
        ATOMIC: tl.constexpr,
    ):
        """Publish this tile's per-row best: as partials, or merged into a packed key."""
        # Lowest column among equal maxima, as torch.argmax does.
        best, best_col = tl.max(logits, axis=1, return_indices=True)
        index = tile * TILE_V + best_col
        if ATOMIC:
            # Key order = (value, -index) order: sign-magnitude float bits made
            # monotone in the high half, 2^31-1-index in the low half.
            bits = best.to(tl.int32, bitcast=True)
            ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
            key = (ordered.to(tl.int64) << 32) + (2147483647 - index).to(tl.int64)
            tl.atomic_max(out_a_ptr + rows64 * out_stride, key, mask=row_ok, sem="relaxed")
        else:
            tl.store(out_a_ptr + rows64 * out_stride + tile, best, mask=row_ok)
            tl.store(out_b_ptr + rows64 * out_stride + tile, index, mask=row_ok)

    @triton.jit
    def tile_logits(
        bias,
        rows64,
        row_ok,
        cols,
        col_ok,
        base,
        noise_ptr,
        noise_stride_b,
        noise_stride_v,
        temperature_ptr,
        USE_NOISE: tl.constexpr,
        STREAM_EVICTION: tl.constexpr,
    ):
        logits = base.to(tl.float32) + bias
        if USE_NOISE:
            temperature = tl.load(temperature_ptr + rows64, mask=row_ok, other=0.0)
            noise = tl.load(
                noise_ptr + rows64[:, None] * noise_stride_b + cols[None, :] * noise_stride_v,
                mask=row_ok[:, None] & col_ok[None, :],
                other=0.0,
                eviction_policy=STREAM_EVICTION,
            )
            logits = logits + noise.to(tl.float32) * temperature[:, None]
        return tl.where(col_ok[None, :], logits, float("-inf"))

    @triton.jit
    def tile_argmax(
        logits_ptr,
        logits_stride_b,
        logits_stride_v,
        noise_ptr,
        noise_stride_b,
        noise_stride_v,
        temperature_ptr,
        prev_ptr,
        prev_stride,
        w1_ptr,
        w1_stride_v,
        w2_ptr,
        w2_stride_v,
        out_a_ptr,
        out_b_ptr,
        out_stride,
        batch,
        vocab,
        rank,
        reverse_tiles,
        num_tiles,
        num_row_blocks,
        TILE_V: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_K: tl.constexpr,
        USE_NOISE: tl.constexpr,
        PREV_FROM_KEYS: tl.constexpr,
        ATOMIC: tl.constexpr,
        PREFETCH_BASE: tl.constexpr,
        W2_EVICTION: tl.constexpr,
        STREAM_EVICTION: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """K-looped GEMM + tile argmax over (V-tile, row block) items, row block fastest.

        Row blocks vary fastest so the programs sharing a V-tile run together and
        fetch that slice of markov_w2 from HBM once, the others hitting L2.
        """
        pid = tl.program_id(0)
        tile = pid // num_row_blocks
        row_block = pid % num_row_blocks
        if reverse_tiles:
            tile = num_tiles - 1 - tile
        rows64 = (row_block * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
        cols = tile * TILE_V + tl.arange(0, TILE_V)
        row_ok = rows64 < batch
        col_ok = cols < vocab
        logits_ptrs = (
            logits_ptr + rows64[:, None] * logits_stride_b + cols[None, :] * logits_stride_v
        )
        out_ok = row_ok[:, None] & col_ok[None, :]
        if PREFETCH_BASE:
            base = tl.load(logits_ptrs, mask=out_ok, other=0.0, eviction_policy=STREAM_EVICTION)

        prev = load_prev(prev_ptr, prev_stride, rows64, row_ok, PREV_FROM_KEYS)
        k_offsets = tl.arange(0, BLOCK_K)
        emb_ptrs = w1_ptr + prev[:, None] * w1_stride_v + k_offsets[None, :]
        w2_ptrs = w2_ptr + cols.to(tl.int64)[None, :] * w2_stride_v + k_offsets[:, None]
        bias = tl.zeros((BLOCK_B, TILE_V), dtype=tl.float32)
        for k_start in range(0, rank, BLOCK_K):
            k_ok = (k_start + k_offsets) < rank
            emb = tl.load(emb_ptrs + k_start, mask=k_ok[None, :], other=0.0)
            w2_slice = tl.load(
                w2_ptrs + k_start,
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
                eviction_policy=W2_EVICTION,
            )
            bias = tl.dot(emb, w2_slice, bias, input_precision=DOT_PRECISION)

        if not PREFETCH_BASE:
            base = tl.load(logits_ptrs, mask=out_ok, other=0.0, eviction_policy=STREAM_EVICTION)
        logits = tile_logits(
            bias,
            rows64,
            row_ok,
            cols,
            col_ok,
            base,
            noise_ptr,
            noise_stride_b,
            noise_stride_v,
            temperature_ptr,
            USE_NOISE,
            STREAM_EVICTION,
        )
        store_tile_best(
            logits, rows64, row_ok, tile, out_a_ptr, out_b_ptr, out_stride, TILE_V, ATOMIC
        )

    @triton.jit
    def confidence_score(
        row,
        prev,
        w1_ptr,
        w1_stride_v,
        hidden_row_ptr,
        confidence_w_ptr,
        hidden_size,
        rank,
        BLOCK_RANK: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """sigmoid(w . [hidden_k ; markov_w1[prev_k]]) in fp32, as DSV4 evaluates it."""
        ranks = tl.arange(0, BLOCK_RANK)
        rank_ok = ranks < rank
        emb = tl.load(w1_ptr + prev * w1_stride_v + ranks, mask=rank_ok, other=0.0)
        emb_w = tl.load(confidence_w_ptr + hidden_size + ranks, mask=rank_ok, other=0.0)
        score = tl.sum(emb.to(tl.float32) * emb_w.to(tl.float32), axis=0)
        for h_start in range(0, hidden_size, BLOCK_H):
            h = h_start + tl.arange(0, BLOCK_H)
            h_ok = h < hidden_size
            features = tl.load(hidden_row_ptr + h, mask=h_ok, other=0.0)
            weights = tl.load(confidence_w_ptr + h, mask=h_ok, other=0.0)
            score += tl.sum(features.to(tl.float32) * weights.to(tl.float32), axis=0)
        return tl.sigmoid(score)

    @triton.jit
    def finish_slot(
        partial_max_ptr,
        partial_index_ptr,
        partial_stride_b,
        num_tiles,
        prev_ptr,
        prev_stride,
        w1_ptr,
        w1_stride_v,
        hidden_ptr,
        hidden_stride_b,
        confidence_w_ptr,
        tokens_ptr,
        tokens_stride_b,
        confidence_ptr,
        confidence_stride_b,
        hidden_size,
        rank,
        BLOCK_TILES: tl.constexpr,
        BLOCK_RANK: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """One row of one slot: reduce the tile partials to the token, then the confidence."""
        row = tl.program_id(0).to(tl.int64)
        tiles = tl.arange(0, BLOCK_TILES)
        tile_ok = tiles < num_tiles
        maxima = tl.load(
            partial_max_ptr + row * partial_stride_b + tiles, mask=tile_ok, other=float("-inf")
        )
        indices = tl.load(
            partial_index_ptr + row * partial_stride_b + tiles, mask=tile_ok, other=2**31 - 1
        )
        # Each tile already holds its lowest maximal column; the lowest across tiles
        # that reach the global maximum is then the global lowest, matching torch.
        best = tl.max(maxima, axis=0)
        token = tl.min(tl.where(maxima == best, indices, 2**31 - 1), axis=0)
        tl.store(tokens_ptr + row * tokens_stride_b, token.to(tl.int64))
        prev = tl.load(prev_ptr + row * prev_stride)
        score = confidence_score(
            row,
            prev,
            w1_ptr,
            w1_stride_v,
            hidden_ptr + row * hidden_stride_b,
            confidence_w_ptr,
            hidden_size,
            rank,
            BLOCK_RANK,
            BLOCK_H,
        )
        tl.store(confidence_ptr + row * confidence_stride_b, score)

    @triton.jit
    def finish_block(
        keys_ptr,
        keys_stride_slot,
        keys_stride_b,
        anchor_ptr,
        anchor_stride,
        w1_ptr,
        w1_stride_v,
        hidden_ptr,
        hidden_stride_b,
        hidden_stride_slot,
        confidence_w_ptr,
        tokens_ptr,
        tokens_stride_b,
        confidence_ptr,
        confidence_stride_b,
        num_slots,
        hidden_size,
        rank,
        BLOCK_RANK: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """One row, all slots: decode the packed keys into tokens, then the confidences."""
        row = tl.program_id(0).to(tl.int64)
        prev = tl.load(anchor_ptr + row * anchor_stride).to(tl.int64)
        for slot in range(num_slots):
            token = decode_key(tl.load(keys_ptr + slot * keys_stride_slot + row * keys_stride_b))
            tl.store(tokens_ptr + row * tokens_stride_b + slot, token)
            score = confidence_score(
                row,
                prev,
                w1_ptr,
                w1_stride_v,
                hidden_ptr + row * hidden_stride_b + slot * hidden_stride_slot,
                confidence_w_ptr,
                hidden_size,
                rank,
                BLOCK_RANK,
                BLOCK_H,
            )
            tl.store(confidence_ptr + row * confidence_stride_b + slot, score)
            prev = token

    return _Kernels(
        tile_argmax=tile_argmax,
        finish_slot=finish_slot,
        finish_block=finish_block,
    )
