"""The fused Triton path's host side: buffers, grids and the launches of one draft
block (key fill, one per-slot kernel per slot, finish), with no host sync."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from vllm_v4_patches.dspark.markov_kernel.config import (
    MarkovKernelConfig,
    default_config,
    pick_kernel,
)
from vllm_v4_patches.dspark.markov_kernel.gluon_kernels import build_gluon_kernels
from vllm_v4_patches.dspark.markov_kernel.reference import anchor_in_table
from vllm_v4_patches.dspark.markov_kernel.triton_kernels import Kernels, build_kernels

if TYPE_CHECKING:
    import torch


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

    kernels = build_kernels()
    batch, num_slots, vocab = base_logits.shape
    anchor = anchor_in_table(anchor, markov_w1)
    # The kernels index the last dimension of these with unit stride.
    markov_w1 = markov_w1.contiguous()
    markov_w2 = markov_w2.contiguous()
    config = config or default_config(batch, pick_kernel(base_logits, markov_w2))
    confidence_w = confidence_w.contiguous()
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()

    device = base_logits.device
    tokens = torch.empty(batch, num_slots, dtype=torch.int64, device=device)
    confidence = torch.empty(batch, num_slots, dtype=torch.float32, device=device)
    num_tiles = -(-vocab // config.tile_v)
    if config.atomic_argmax or config.kernel != "k_loop":
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
        slot_inputs = (base_logits, temperature, gumbel_noise, prev, prev_from_keys)
        if config.kernel == "gluon":
            _launch_gluon_stream(config, slot, *slot_inputs, markov_w1, markov_w2, keys[slot])
        elif config.kernel == "stream":
            _launch_stream_argmax(
                kernels, config, slot, *slot_inputs, markov_w1, markov_w2, keys[slot]
            )
        else:
            _launch_tile_argmax(
                kernels,
                config,
                slot,
                *slot_inputs,
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
            kernels, keys, anchor, markov_w1, hidden, confidence_w, tokens, confidence, config.pdl
        )
    return tokens, confidence


def _launch_tile_argmax(
    kernels: Kernels,
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


@functools.cache
@functools.cache
def _sm_count(device_index: int) -> int:
    """Multiprocessors of a CUDA device, read once (the persistent grids' size)."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch_stream_argmax(
    kernels: Kernels,
    config: MarkovKernelConfig,
    slot: int,
    base_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    gumbel_noise: torch.Tensor | None,
    prev: torch.Tensor,
    prev_from_keys: bool,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    slot_keys: torch.Tensor,
) -> None:
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, _, vocab = base_logits.shape
    rank = markov_w2.shape[1]
    rank_block = max(16, _next_power_of_2(rank))
    num_tiles = -(-vocab // config.tile_v)
    programs, tiles_per_program, num_row_blocks = _stream_grid(
        config, batch, num_tiles, base_logits.device
    )
    slot_logits = base_logits[:, slot]
    use_noise = gumbel_noise is not None
    slot_noise = gumbel_noise[:, slot] if use_noise else slot_logits
    row_temperature = temperature.float() if use_noise else slot_logits
    # The pipeliner stages the noise tiles in shared memory too: at 128 rows three
    # stages of fp32 noise overflow it, two fit.
    num_stages = config.num_stages if not use_noise or config.block_b < 128 else 2
    kernels.stream_argmax[(programs,)](
        TensorDescriptor.from_tensor(slot_logits, [config.block_b, config.tile_v]),
        slot_noise,
        slot_noise.stride(0),
        slot_noise.stride(1),
        row_temperature,
        prev,
        prev.stride(0),
        markov_w1,
        markov_w1.stride(0),
        TensorDescriptor.from_tensor(markov_w2, [config.tile_v, rank_block]),
        slot_keys,
        slot_keys.stride(0),
        batch,
        vocab,
        rank,
        int(config.alternate_direction and slot % 2 == 1),
        num_tiles,
        tiles_per_program,
        num_row_blocks,
        TILE_V=config.tile_v,
        BLOCK_B=config.block_b,
        BLOCK_R=rank_block,
        USE_NOISE=use_noise,
        PREV_FROM_KEYS=prev_from_keys,
        NUM_STAGES=num_stages,
        USE_PDL=config.pdl,
        STREAM_EVICTION="evict_first" if config.keep_weight_in_l2 else "",
        DOT_PRECISION="ieee" if markov_w2.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=num_stages,
        launch_pdl=config.pdl,
    )


def _stream_grid(
    config: MarkovKernelConfig, batch: int, num_tiles: int, device: torch.device
) -> tuple[int, int, int]:
    """(programs, tiles per program, row blocks): about programs_per_sm programs per
    multiprocessor, each walking one contiguous run of V-tiles for one row block."""
    num_row_blocks = -(-batch // config.block_b)
    programs = _sm_count(device.index or 0) * config.programs_per_sm
    chunks = max(1, programs // num_row_blocks)
    tiles_per_program = -(-num_tiles // chunks)
    chunks = -(-num_tiles // tiles_per_program)
    return chunks * num_row_blocks, tiles_per_program, num_row_blocks


def _launch_gluon_stream(
    config: MarkovKernelConfig,
    slot: int,
    base_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    gumbel_noise: torch.Tensor | None,
    prev: torch.Tensor,
    prev_from_keys: bool,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    slot_keys: torch.Tensor,
) -> None:
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    kernel = build_gluon_kernels()
    batch, _, vocab = base_logits.shape
    rank = markov_w2.shape[1]
    num_tiles = -(-vocab // config.tile_v)
    programs, tiles_per_program, num_row_blocks = _stream_grid(
        config, batch, num_tiles, base_logits.device
    )
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[markov_w2.dtype]
    slot_logits = base_logits[:, slot]
    w2_block = [config.tile_v, rank]
    base_block = [config.block_b, config.tile_v]
    w2_desc = TensorDescriptor.from_tensor(
        markov_w2, w2_block, gl.NVMMASharedLayout.get_default_for(w2_block, element)
    )
    base_desc = TensorDescriptor.from_tensor(
        slot_logits, base_block, gl.NVMMASharedLayout.get_default_for(base_block, element)
    )
    use_noise = gumbel_noise is not None
    slot_noise = gumbel_noise[:, slot] if use_noise else slot_logits
    row_temperature = temperature.float() if use_noise else slot_logits
    if use_noise and slot_noise.stride(-1) != 1:
        slot_noise = slot_noise.contiguous()
    num_warps = config.block_b // 16
    kernel[(programs,)](
        base_desc,
        w2_desc,
        slot_noise,
        slot_noise.stride(0),
        row_temperature,
        prev,
        prev.stride(0),
        markov_w1,
        markov_w1.stride(0),
        slot_keys,
        slot_keys.stride(0),
        batch,
        vocab,
        int(config.alternate_direction and slot % 2 == 1),
        num_tiles,
        tiles_per_program,
        num_row_blocks,
        TILE_V=config.tile_v,
        BLOCK_B=config.block_b,
        RANK=rank,
        STAGES=config.num_stages,
        NUM_WARPS=num_warps,
        USE_NOISE=use_noise,
        PREV_FROM_KEYS=prev_from_keys,
        USE_PDL=config.pdl,
        num_warps=num_warps,
        launch_pdl=config.pdl,
    )


def _launch_finish_slot(
    kernels: Kernels,
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
    kernels: Kernels,
    keys: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    tokens: torch.Tensor,
    confidence: torch.Tensor,
    pdl: bool,
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
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
