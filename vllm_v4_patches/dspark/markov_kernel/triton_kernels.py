"""The plain Triton kernels: the per-slot 'stream' and 'k_loop' kernels and the
key-fill and finish launches."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class Kernels:
    tile_argmax: Any
    stream_argmax: Any
    finish_slot: Any
    finish_block: Any


@functools.cache
def build_kernels() -> Kernels:
    """Defines the jitted kernels once per process (each compiles on first launch)."""
    import triton
    import triton.language as tl
    from triton.language.extra import cuda as tl_cuda

    @triton.jit
    def chain_launch(USE_PDL):
        """Programmatic dependent launch: let the next kernel launch now (its programs
        take the multiprocessors as ours leave), then wait until the previous kernel
        has finished and its writes are visible."""
        if USE_PDL:
            tl_cuda.gdc_launch_dependents()
            tl_cuda.gdc_wait()

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
    def tile_key(logits, tile, TILE_V: tl.constexpr):
        """Per-row packed key of the tile's best column: its order is (value, -index)."""
        # Lowest column among equal maxima, as torch.argmax does.
        best, best_col = tl.max(logits, axis=1, return_indices=True)
        return pack_key(best, tile * TILE_V + best_col)

    @triton.jit
    def pack_key(value, index):
        """Sign-magnitude float bits made monotone in the high half, 2^31-1-index in
        the low half: key order is (value, -index) order."""
        bits = value.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return (ordered.to(tl.int64) << 32) + (2147483647 - index).to(tl.int64)

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
        if ATOMIC:
            key = tile_key(logits, tile, TILE_V)
            tl.atomic_max(out_a_ptr + rows64 * out_stride, key, mask=row_ok, sem="relaxed")
        else:
            # Lowest column among equal maxima, as torch.argmax does.
            best, best_col = tl.max(logits, axis=1, return_indices=True)
            index = tile * TILE_V + best_col
            tl.store(out_a_ptr + rows64 * out_stride + tile, best, mask=row_ok)
            tl.store(out_b_ptr + rows64 * out_stride + tile, index, mask=row_ok)

    @triton.jit
    def tile_logits(
        logits,
        rows64,
        row_ok,
        cols,
        col_ok,
        noise_ptr,
        noise_stride_b,
        noise_stride_v,
        temperature_ptr,
        USE_NOISE: tl.constexpr,
        STREAM_EVICTION: tl.constexpr,
    ):
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
            base.to(tl.float32) + bias,
            rows64,
            row_ok,
            cols,
            col_ok,
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
    def stream_argmax(
        logits_desc,
        noise_ptr,
        noise_stride_b,
        noise_stride_v,
        temperature_ptr,
        prev_ptr,
        prev_stride,
        w1_ptr,
        w1_stride_v,
        w2_desc,
        keys_ptr,
        keys_stride,
        batch,
        vocab,
        rank,
        reverse_tiles,
        num_tiles,
        tiles_per_program,
        num_row_blocks,
        TILE_V: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_R: tl.constexpr,
        USE_NOISE: tl.constexpr,
        PREV_FROM_KEYS: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        USE_PDL: tl.constexpr,
        STREAM_EVICTION: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Persistent: one row block's embeddings stay on chip while the program walks
        a contiguous run of V-tiles, one whole-rank product per tile fed by bulk
        copies, keeping a running best key per row and publishing it with one atomic.
        """
        chain_launch(USE_PDL)
        pid = tl.program_id(0)
        row_block = pid % num_row_blocks
        first = (pid // num_row_blocks) * tiles_per_program
        count = tl.minimum(tiles_per_program, num_tiles - first)
        rows64 = (row_block * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
        row_ok = rows64 < batch
        prev = load_prev(prev_ptr, prev_stride, rows64, row_ok, PREV_FROM_KEYS)
        ranks = tl.arange(0, BLOCK_R)
        emb = tl.load(
            w1_ptr + prev[:, None] * w1_stride_v + ranks[None, :],
            mask=(ranks < rank)[None, :],
            other=0.0,
        )
        best = tl.full([BLOCK_B], -9223372036854775807 - 1, tl.int64)
        for step in tl.range(0, count, num_stages=NUM_STAGES):
            tile = first + step + reverse_tiles * (count - 1 - 2 * step)
            cols = tile * TILE_V + tl.arange(0, TILE_V)
            w2_slice = w2_desc.load([tile * TILE_V, 0]).T
            base = logits_desc.load([row_block * BLOCK_B, tile * TILE_V])
            # The base logits seed the fp32 accumulator.
            logits = tl.dot(emb, w2_slice, base.to(tl.float32), input_precision=DOT_PRECISION)
            logits = tile_logits(
                logits,
                rows64,
                row_ok,
                cols,
                cols < vocab,
                noise_ptr,
                noise_stride_b,
                noise_stride_v,
                temperature_ptr,
                USE_NOISE,
                STREAM_EVICTION,
            )
            best = tl.maximum(best, tile_key(logits, tile, TILE_V))
        tl.atomic_max(keys_ptr + rows64 * keys_stride, best, mask=row_ok, sem="relaxed")

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
        USE_PDL: tl.constexpr,
    ):
        """One row, all slots: decode the packed keys into tokens, then the confidences."""
        chain_launch(USE_PDL)
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

    return Kernels(
        tile_argmax=tile_argmax,
        stream_argmax=stream_argmax,
        finish_slot=finish_slot,
        finish_block=finish_block,
    )
