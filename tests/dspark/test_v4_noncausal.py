"""The DeepSeek-V4 draft block's non-causal sliding-window indices for releases
before 0.25 (``dspark.v4_noncausal``), against a loop written from the definition:
each token of a request's block sees the window before the block and the whole
block. The builder's metadata is a stand-in dataclass with the fields the sparse
sliding-window metadata has (the real builder needs CUDA and V4's kernels)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from vllm_v4_patches.dspark.v4_noncausal import (
    block_swa_indices,
    index_width,
    noncausal_block_metadata,
)

BLOCK_SIZE = 4


def batch() -> dict:
    """Three requests of 5-token blocks: a short context, one past the window, and
    one whose block crosses a cache block; token 12 is padding."""
    context = [3, 40, 9]
    block = 5
    seq_lens = torch.tensor([c + block for c in context], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 5, 10, 15], dtype=torch.int32)
    generator = torch.Generator().manual_seed(0)
    block_table = torch.randperm(64, generator=generator)[:36].view(3, 12).to(torch.int32)
    rows = torch.repeat_interleave(torch.arange(3), block).to(torch.int32)
    valid = torch.ones(15, dtype=torch.bool)
    valid[12] = False
    return dict(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        token_rows=rows,
        valid_tokens=valid,
        block_table=block_table,
    )


def expected(inputs: dict, window: int) -> list[list[int]]:
    out = []
    for token, row in enumerate(inputs["token_rows"].tolist()):
        if not inputs["valid_tokens"][token]:
            out.append([])
            continue
        end = int(inputs["seq_lens"][row])
        query = int(inputs["query_start_loc"][row + 1] - inputs["query_start_loc"][row])
        first = max(end - query - window, 0)
        table = inputs["block_table"][row].tolist()
        out.append(
            [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(first, end)]
        )
    return out


def test_each_token_sees_the_window_before_its_block_and_the_whole_block():
    inputs = batch()
    window = 16
    width = index_width(window, 5)
    indices, counts = block_swa_indices(
        **inputs, block_size=BLOCK_SIZE, window_size=window, width=width
    )
    assert indices.shape == (15, 1, width) and width == 128
    want = expected(inputs, window)
    for token, slots in enumerate(want):
        assert counts[token] == len(slots)
        assert indices[token, 0, : len(slots)].tolist() == slots
        assert (indices[token, 0, len(slots) :] == -1).all()
    # every token of a block sees the same slots, the block's last included
    assert indices[0, 0].tolist() == indices[4, 0].tolist()
    assert counts.tolist()[5:10] == [16 + 5] * 5  # past the window: cut to it


def test_causal_indices_are_not_what_the_block_gets():
    """Control: a causal window (each token sees the positions up to its own) is what
    a builder left causal gives; it differs for every valid token but each block's
    last within the window, so this comparison can tell the two apart."""
    inputs = batch()
    window = 16
    indices, counts = block_swa_indices(
        **inputs, block_size=BLOCK_SIZE, window_size=window, width=128
    )
    differs = []
    for token, row in enumerate(inputs["token_rows"].tolist()):
        if not inputs["valid_tokens"][token]:
            continue
        start = int(inputs["query_start_loc"][row])
        end = int(inputs["seq_lens"][row])
        position = end - 5 + token - start
        table = inputs["block_table"][row].tolist()
        causal = [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for p in range(max(position - window + 1, 0), position + 1)
        ]
        ours = indices[token, 0, : counts[token]].tolist()
        differs.append(ours != causal)
    # past the window (the second request) even the last token sees more: the window
    # is anchored at the block's start
    assert differs == [True, True, True, True, False] + [True] * 5 + [True, True, True, False]


def test_the_width_is_the_window_and_block_rounded_up_for_the_kernel():
    assert index_width(128, 5) == 256
    assert index_width(123, 5) == 128
    assert index_width(0, 1) == 128


@dataclasses.dataclass
class Metadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    token_to_req_indices: torch.Tensor
    is_valid_token: torch.Tensor
    decode_swa_indices: torch.Tensor
    decode_swa_lens: torch.Tensor
    num_decode_tokens: int


class Builder:
    window_size = 16
    num_speculative_tokens = 5
    block_size = BLOCK_SIZE

    def __init__(self) -> None:
        self.decode_swa_indices = torch.zeros(64, 1, self.window_size, dtype=torch.int32)


class Common:
    def __init__(self, block_table: torch.Tensor) -> None:
        self.block_table_tensor = block_table


def causal_metadata(inputs: dict) -> Metadata:
    """The builder's own (causal) answer for ``batch()``: window-wide indices."""
    return Metadata(
        query_start_loc=inputs["query_start_loc"],
        seq_lens=inputs["seq_lens"],
        token_to_req_indices=inputs["token_rows"],
        is_valid_token=inputs["valid_tokens"],
        decode_swa_indices=torch.zeros(15, 1, 16, dtype=torch.int32),
        decode_swa_lens=torch.zeros(15, dtype=torch.int32),
        num_decode_tokens=15,
    )


def test_the_builders_causal_answer_is_replaced_in_buffers_it_keeps():
    inputs = batch()
    metadata = causal_metadata(inputs)
    builder = Builder()
    common = Common(inputs["block_table"])
    first = noncausal_block_metadata(builder, metadata, common)
    want, _ = block_swa_indices(**inputs, block_size=BLOCK_SIZE, window_size=16, width=128)
    assert torch.equal(first.decode_swa_indices, want)
    second = noncausal_block_metadata(builder, metadata, common)
    assert second.decode_swa_indices.data_ptr() == first.decode_swa_indices.data_ptr()
    assert metadata.decode_swa_indices.shape[-1] == 16  # the builder's own left as it was


class BuildingBuilder(Builder):
    """A builder whose ``build`` answers with the causal metadata given to it."""

    def __init__(self, metadata: Metadata) -> None:
        super().__init__()
        self.metadata = metadata

    def build(self, common_prefix_len: int, common_attn_metadata: Common) -> Metadata:
        return self.metadata


@pytest.mark.parametrize("through_class", [False, True])
def test_the_wrapped_build_replaces_only_a_non_causal_blocks_indices(monkeypatch, through_class):
    """The wrapper on the builder's ``build``: the drafter's metadata (``causal``
    False) gets the block's slots, the target's (causal) is returned as built, also
    when ``build`` is called through the class."""
    import wrapt

    from vllm_v4_patches.dspark.v4_noncausal import noncausal_for_draft_block

    inputs = batch()
    metadata = causal_metadata(inputs)
    wrapped = wrapt.FunctionWrapper(BuildingBuilder.build, noncausal_for_draft_block)
    monkeypatch.setattr(BuildingBuilder, "build", wrapped)
    builder = BuildingBuilder(metadata)
    want, _ = block_swa_indices(**inputs, block_size=BLOCK_SIZE, window_size=16, width=128)
    for causal in (False, True):
        common = Common(inputs["block_table"])
        common.causal = causal
        if through_class:
            built = BuildingBuilder.build(builder, 0, common)
        else:
            built = builder.build(0, common_attn_metadata=common)
        if causal:
            assert built is metadata
        else:
            assert torch.equal(built.decode_swa_indices, want)


# -- the decode split under parallel drafting ---------------------------------

SWA_BUILDER_PATH = "vllm/v1/attention/backends/mla/sparse_swa.py"
BASE_BUILDER_PATH = "vllm/v1/attention/backend.py"
# what the sliding-window builder's __init__ computes its threshold from
THRESHOLD_INPUTS = {"num_speculative_tokens", "decode_threshold", "spec_config", "spec_mult"}


def release_builders(version: str, wrap: bool) -> tuple[type, type]:
    """(the sliding-window builder, a sparse MLA builder): stand-in classes whose
    threshold code is the release's own, compiled from its source tree (the real
    builders need CUDA); with ``wrap``, the overlay's wrapper on the first's
    ``__init__``."""
    import vllm_builds
    import wrapt

    from vllm_v4_patches.dspark.v4_noncausal import decode_split_for_parallel_drafting

    root = vllm_builds.fetch_source(version)
    from release_code import release_method

    swa_init = release_method(
        root,
        SWA_BUILDER_PATH,
        "DeepseekSparseSWAMetadataBuilder",
        "__init__",
        keep=THRESHOLD_INPUTS,
    )
    reorder = release_method(
        root, BASE_BUILDER_PATH, "AttentionMetadataBuilder", "_init_reorder_batch_threshold"
    )

    class SlidingWindow:
        reorder_batch_threshold = 1  # the release's class attribute (checked below)
        __init__ = (
            wrapt.FunctionWrapper(swa_init, decode_split_for_parallel_drafting)
            if wrap
            else swa_init
        )

    class SparseMLA:
        _init_reorder_batch_threshold = reorder

        def __init__(self) -> None:
            self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    return SlidingWindow, SparseMLA


def built(cls: type, tokens: int, parallel: bool):
    spec = types.SimpleNamespace(num_speculative_tokens=tokens, parallel_drafting=parallel)
    parallel_config = types.SimpleNamespace(decode_context_parallel_size=1)
    config = types.SimpleNamespace(speculative_config=spec, parallel_config=parallel_config)
    builder = cls.__new__(cls)
    builder.vllm_config = config
    builder.__init__()
    return builder


@pytest.mark.parametrize("version", ["0.20.2", "0.22.0", "0.24.0"])
def test_under_parallel_drafting_the_window_builder_splits_where_the_sparse_mla_one_does(version):
    """Stock 0.20-0.24: under parallel drafting the sliding-window builder calls a
    query of N+2 to 2N+1 tokens a prefill and the sparse MLA builders a decode (the
    H200's 0.24.0 warm-up failed there). With the wrapper both thresholds are the
    same; without parallel drafting nothing changes."""
    import vllm_builds

    text = (vllm_builds.fetch_source(version) / SWA_BUILDER_PATH).read_text()
    assert "reorder_batch_threshold: int = 1" in text
    for tokens in (1, 3, 5):
        stock_window, sparse_mla = release_builders(version, wrap=False)
        patched_window, _ = release_builders(version, wrap=True)
        mla = built(sparse_mla, tokens, parallel=True).reorder_batch_threshold
        assert mla == 1 + 2 * tokens
        assert built(stock_window, tokens, parallel=True).decode_threshold == 1 + tokens
        assert built(patched_window, tokens, parallel=True).decode_threshold == mla
        # no parallel drafting: the release's split, which already agrees
        mla = built(sparse_mla, tokens, parallel=False).reorder_batch_threshold
        for window in (stock_window, patched_window):
            assert built(window, tokens, parallel=False).decode_threshold == mla == 1 + tokens


def test_from_025_the_release_splits_as_the_wrapper_does():
    """vLLM 0.25.0 counts the parallel-drafting slots in the window builder itself
    (why the route's wrapper stops at 0.24)."""
    window, sparse_mla = release_builders("0.25.0", wrap=False)
    for tokens in (1, 5):
        mla = built(sparse_mla, tokens, parallel=True).reorder_batch_threshold
        assert built(window, tokens, parallel=True).decode_threshold == mla
