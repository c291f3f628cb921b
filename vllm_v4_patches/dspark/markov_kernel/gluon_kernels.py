"""The Gluon per-slot kernel for Hopper (the 'gluon' choice of ``config``)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


@functools.cache
def build_gluon_kernels() -> Any:
    """The Gluon stream kernel for Hopper, defined once (compiled on first launch).

    Gluon is Triton's lower-level front end: layouts, shared memory, bulk copies,
    mbarriers and asynchronous warpgroup MMAs are written out, not inferred.
    """
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    @gluon.jit
    def issue_tile(
        step,
        first,
        count,
        reverse_tiles,
        row0,
        w2_desc,
        base_desc,
        w2_smem,
        base_smem,
        ready,
        TILE_V,
        STAGES,
    ):
        """Bulk-copy tile `step` of this program's run (W2 slice and base logits) into
        its ring stage; nothing when the run is shorter."""
        stage = step % STAGES
        tile = first + step + reverse_tiles * (count - 1 - 2 * step)
        pred = step < count
        bar = ready.index(stage)
        mbarrier.expect(bar, w2_desc.block_type.nbytes + base_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(
            w2_desc, [tile * TILE_V, 0], bar, w2_smem.index(stage), pred=pred
        )
        tma.async_copy_global_to_shared(
            base_desc, [row0, tile * TILE_V], bar, base_smem.index(stage), pred=pred
        )

    @gluon.jit
    def fold_tile(
        logits,
        tile,
        best,
        rows,
        row_ok,
        col_offsets,
        vocab,
        noise_ptr,
        noise_stride_b,
        temperature_ptr,
        TILE_V,
        USE_NOISE,
    ):
        """max(best, packed key of this tile's best column) per row."""
        cols = tile * TILE_V + col_offsets
        col_ok = cols < vocab
        if USE_NOISE:
            temperature = gl.load(temperature_ptr + rows, mask=row_ok, other=0.0)
            noise = gl.load(
                noise_ptr + rows.to(gl.int64)[:, None] * noise_stride_b + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            logits = logits + noise.to(gl.float32) * temperature[:, None]
        logits = gl.where(col_ok[None, :], logits, float("-inf"))
        value = gl.max(logits, axis=1)
        # The lowest column among equal maxima, as torch.argmax picks.
        col = gl.min(gl.where(logits == value[:, None], col_offsets[None, :], TILE_V), axis=1)
        bits = value.to(gl.int32, bitcast=True)
        ordered = gl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        index = tile * TILE_V + col
        key = (ordered.to(gl.int64) << 32) + (2147483647 - index).to(gl.int64)
        return gl.maximum(best, key)

    @gluon.jit
    def gluon_stream_argmax(
        base_desc,
        w2_desc,
        noise_ptr,
        noise_stride_b,
        temperature_ptr,
        prev_ptr,
        prev_stride,
        w1_ptr,
        w1_stride_v,
        keys_ptr,
        keys_stride,
        batch,
        vocab,
        reverse_tiles,
        num_tiles,
        tiles_per_program,
        num_row_blocks,
        TILE_V: gl.constexpr,
        BLOCK_B: gl.constexpr,
        RANK: gl.constexpr,
        STAGES: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        USE_NOISE: gl.constexpr,
        PREV_FROM_KEYS: gl.constexpr,
        USE_PDL: gl.constexpr,
    ):
        """The stream kernel with its schedule written out.

        A ring of STAGES bulk-copied (W2 slice, base logits) tiles; the product of
        tile i is issued asynchronously and runs on the tensor cores while the warps
        fold tile i-1 into the running keys and refill its stage. Plain Triton waits
        for each product before its epilogue and refills after it, and a CTA-wide
        barrier around each copy then serialises loads, products and epilogues.
        """
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, TILE_V, 16]
        )
        gather_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0])
        emb_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [BLOCK_B, RANK], w2_desc.dtype
        )
        emb_smem = gl.allocate_shared_memory(w2_desc.dtype, [BLOCK_B, RANK], emb_layout)
        w2_smem = gl.allocate_shared_memory(w2_desc.dtype, [STAGES, TILE_V, RANK], w2_desc.layout)
        base_smem = gl.allocate_shared_memory(
            base_desc.dtype, [STAGES, BLOCK_B, TILE_V], base_desc.layout
        )
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for ring_stage in gl.static_range(STAGES):
            mbarrier.init(ready.index(ring_stage), count=1)
        gl.thread_barrier()

        pid = gl.program_id(0)
        row_block = pid % num_row_blocks
        first = (pid // num_row_blocks) * tiles_per_program
        count = gl.minimum(tiles_per_program, num_tiles - first)
        row0 = row_block * BLOCK_B
        # The tiles do not depend on the previous slot: fetch them before waiting for it.
        for prologue_step in gl.static_range(STAGES):
            issue_tile(
                prologue_step,
                first,
                count,
                reverse_tiles,
                row0,
                w2_desc,
                base_desc,
                w2_smem,
                base_smem,
                ready,
                TILE_V,
                STAGES,
            )
        if USE_PDL:
            gl.inline_asm_elementwise(
                "griddepcontrol.launch_dependents; // $0", "=r", [], gl.int32, False, 1
            )
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], gl.int32, False, 1)

        # Embeddings of the previous tokens, gathered once into shared memory.
        g_rows = row0 + gl.arange(0, BLOCK_B, layout=gl.SliceLayout(1, gather_layout))
        g_row_ok = g_rows < batch
        prev = gl.load(prev_ptr + g_rows.to(gl.int64) * prev_stride, mask=g_row_ok, other=0)
        if PREV_FROM_KEYS:  # the token is the packed key's low half, inverted
            prev = 2147483647 - (prev - ((prev >> 32) << 32))
        # Rows past the batch gather row 0 of markov_w1; their keys are not stored.
        prev = gl.where(g_row_ok, prev, 0).to(gl.int64)
        ranks = gl.arange(0, RANK, layout=gl.SliceLayout(0, gather_layout))
        emb = gl.load(w1_ptr + prev[:, None] * w1_stride_v + ranks[None, :])
        emb_smem.store(emb)
        fence_async_shared()
        gl.thread_barrier()

        rows = row0 + gl.arange(0, BLOCK_B, layout=gl.SliceLayout(1, acc_layout))
        row_ok = rows < batch
        col_offsets = gl.arange(0, TILE_V, layout=gl.SliceLayout(0, acc_layout))
        best = gl.full([BLOCK_B], -9223372036854775807 - 1, gl.int64, gl.SliceLayout(1, acc_layout))

        # Tile 0 alone; then each step issues tile `step` and folds tile step - 1.
        mbarrier.wait(ready.index(0), 0)
        base = base_smem.index(0).load(acc_layout).to(gl.float32)
        acc = warpgroup_mma(emb_smem, w2_smem.index(0).permute((1, 0)), base, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        tile_prev = first + reverse_tiles * (count - 1)
        for step in range(1, count):
            stage = step % STAGES
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            base = base_smem.index(stage).load(acc_layout).to(gl.float32)
            # The base logits seed the fp32 accumulator.
            acc_next = warpgroup_mma(
                emb_smem, w2_smem.index(stage).permute((1, 0)), base, is_async=True
            )
            best = fold_tile(
                acc,
                tile_prev,
                best,
                rows,
                row_ok,
                col_offsets,
                vocab,
                noise_ptr,
                noise_stride_b,
                temperature_ptr,
                TILE_V,
                USE_NOISE,
            )
            # Every warpgroup has retired the product of step - 1: its stage is free.
            gl.thread_barrier()
            issue_tile(
                step - 1 + STAGES,
                first,
                count,
                reverse_tiles,
                row0,
                w2_desc,
                base_desc,
                w2_smem,
                base_smem,
                ready,
                TILE_V,
                STAGES,
            )
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc_next])
            tile_prev = first + step + reverse_tiles * (count - 1 - 2 * step)
        best = fold_tile(
            acc,
            tile_prev,
            best,
            rows,
            row_ok,
            col_offsets,
            vocab,
            noise_ptr,
            noise_stride_b,
            temperature_ptr,
            TILE_V,
            USE_NOISE,
        )
        gl.atomic_max(keys_ptr + rows.to(gl.int64) * keys_stride, best, mask=row_ok, sem="relaxed")

    return gluon_stream_argmax
