"""The DeepSeek-V4 draft block's sparse sliding-window metadata on releases whose
builder predates DSpark (before 0.25): non-causal indices for the block, and a
decode split that agrees with the sparse MLA builders under parallel drafting.

A V4 draft stage attends with the sparse MLA kernels, which read, per query token,
the cache slots it may see. A DSpark block is non-causal: every token of a request's
block sees the window of context before the block and the whole block, its later
tokens included. vLLM 0.25+ builds these indices itself when the drafter's common
metadata says ``causal=False``; before 0.25 the builder ignores the flag, so the
block would attend causally without a word. The builder's output is corrected here
instead, for the overlay's V4 drafter only.

Under parallel drafting (the dflash method the overlay's route runs as) vLLM's
sparse MLA builders count a query of up to ``1 + 2 * num_speculative_tokens``
tokens as a decode, while the sliding-window builder before 0.25 stops at
``1 + num_speculative_tokens``. The attention reads its prefill/decode split from
the sliding-window metadata and its compressed-layer indices from the sparse MLA
metadata, so a query between the two (a short prompt, the start-up's 16-token
warm-up) found no prefill indices (vLLM 0.24.0 on the H200, 2026-12-05). vLLM 0.25
counts the parallel-drafting slots in the sliding-window builder too; so does
``decode_split_for_parallel_drafting`` before it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_v4_patches.patcher import split_receiver

# the sparse MLA decode kernel pads its query heads to a tile that needs the index
# width to be a multiple of this
INDEX_WIDTH_MULTIPLE = 128


def index_width(window_size: int, block_tokens: int) -> int:
    """Columns per token: the window plus the block, rounded up for the kernel."""
    columns = window_size + block_tokens
    return -(-columns // INDEX_WIDTH_MULTIPLE) * INDEX_WIDTH_MULTIPLE


def block_swa_indices(
    query_start_loc: Any,
    seq_lens: Any,
    token_rows: Any,
    valid_tokens: Any,
    block_table: Any,
    block_size: int,
    window_size: int,
    width: int,
) -> tuple[Any, Any]:
    """Each token's cache slots ``[T, 1, width]`` (-1 past its count) and count ``[T]``:
    the ``window_size`` positions before its request's block, then the whole block.
    A token whose slot is padding (``valid_tokens`` false) sees nothing. All on the
    device, no host sync."""
    import torch

    rows = token_rows.to(torch.int64)
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)[rows]
    ends = seq_lens.to(torch.int64)[rows]
    starts = (ends - query_lens - window_size).clamp(min=0)
    counts = torch.where(valid_tokens, ends - starts, torch.zeros_like(ends))
    columns = torch.arange(width, device=rows.device)
    positions = starts[:, None] + columns[None, :]
    seen = columns[None, :] < counts[:, None]
    table_columns = (positions // block_size).clamp(max=block_table.shape[1] - 1)
    blocks = block_table.to(torch.int64)[rows[:, None], table_columns]
    slots = torch.where(seen, blocks * block_size + positions % block_size, -1)
    return slots.to(torch.int32).unsqueeze(1), counts.to(torch.int32)


def noncausal_block_metadata(builder: Any, metadata: Any, common: Any) -> Any:
    """``metadata`` (the builder's causal answer) with the decode tokens' indices and
    counts replaced by the block's non-causal ones, in buffers the builder keeps so
    their addresses stay fixed between steps."""
    import torch

    tokens = metadata.num_decode_tokens
    if tokens == 0:
        return metadata
    width = index_width(builder.window_size, builder.num_speculative_tokens)
    buffers = getattr(builder, "vllm_v4_block_indices", None)
    if buffers is None or buffers[0].shape[-1] != width:
        rows = builder.decode_swa_indices.shape[0]
        device = builder.decode_swa_indices.device
        buffers = (
            torch.full((rows, 1, width), -1, dtype=torch.int32, device=device),
            torch.zeros(rows, dtype=torch.int32, device=device),
        )
        builder.vllm_v4_block_indices = buffers
    indices, counts = block_swa_indices(
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.token_to_req_indices[:tokens],
        metadata.is_valid_token[:tokens],
        common.block_table_tensor,
        builder.block_size,
        builder.window_size,
        width,
    )
    buffers[0][:tokens].copy_(indices)
    buffers[1][:tokens].copy_(counts)
    return dataclasses.replace(
        metadata, decode_swa_indices=buffers[0][:tokens], decode_swa_lens=buffers[1][:tokens]
    )


def noncausal_for_draft_block(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """The sparse sliding-window builder's ``build``: metadata built for a draft
    block (the drafter's common metadata says ``causal=False``) gets the block's
    non-causal slots; the target's (causal) metadata is left as built."""
    metadata = wrapped(*args, **kwargs)
    builder, call_args, _ = split_receiver(instance, args)
    common = kwargs.get("common_attn_metadata", call_args[1] if len(call_args) > 1 else None)
    if common is None or common.causal is not False:
        return metadata
    return noncausal_block_metadata(builder, metadata, common)


def decode_split_for_parallel_drafting(
    wrapped: Any, instance: Any, args: tuple, kwargs: dict
) -> Any:
    """The sparse sliding-window builder's ``__init__``: under parallel drafting its
    decode threshold counts the drafting slots twice, as the sparse MLA builders'
    reorder threshold does; otherwise it is left as the release set it."""
    result = wrapped(*args, **kwargs)
    builder, _, _ = split_receiver(instance, args)
    spec = builder.vllm_config.speculative_config
    if spec is not None and getattr(spec, "parallel_drafting", False):
        drafting = 2 * (spec.num_speculative_tokens or 0)
        builder.decode_threshold = max(
            builder.decode_threshold, builder.reorder_batch_threshold + drafting
        )
    return result
