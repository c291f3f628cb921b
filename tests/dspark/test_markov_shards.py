"""The greedy Markov walk over a vocabulary-split bias weight (``markov_shards``).

The key that carries each rank's best through one all-reduce must order as an
argmax over the whole row does (the larger logit, then the lower id), and a walk
over two ranks' shards must draft the tokens of the loop over the whole bias.
The ranks are two real processes reducing through torch.distributed (gloo). The
bias weight is a plain tensor behind a stand-in for vLLM's ``ParallelLMHead`` (its
``quant_method.apply`` is the unquantized ``F.linear``): the engine's own layer at
TP = 2 is exercised by ``test_dspark_tp.py``.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_v4_patches.dspark import markov_shards
from vllm_v4_patches.dspark.draft_math import sample_slot
from vllm_v4_patches.dspark.markov_chain import walk_slots

VOCAB, RANK, BATCH, SLOTS = 37, 6, 5, 4  # 37: the second shard is short and padded


def whole_argmax(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per row of ``[R, C]`` candidates, the id an argmax over the whole vocabulary
    picks: the largest logit, then the lowest id."""
    best = []
    for row in range(logits.shape[0]):
        pairs = [(-float(logits[row, c]), int(ids[row, c])) for c in range(logits.shape[1])]
        best.append(min(pairs)[1])
    return torch.tensor(best)


def test_the_key_orders_by_logit_then_by_the_lower_id() -> None:
    values = [float("-inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, 2.0, float("inf")]
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor(values)[torch.randint(0, len(values), (200, 6), generator=gen)]
    ids = torch.randint(0, 2**20, (200, 6), generator=gen)
    keys = markov_shards.pack_best(logits, ids)
    picked = ids.gather(1, keys.argmax(dim=1, keepdim=True)).squeeze(1)
    assert torch.equal(picked, whole_argmax(logits, ids))
    assert torch.equal(markov_shards.unpack_token(keys), ids)
    # -0.0 and +0.0 are equal logits: the lower id wins either way round
    pair = markov_shards.pack_best(torch.tensor([-0.0, 0.0]), torch.tensor([3, 9]))
    assert int(markov_shards.unpack_token(pair.max())) == 3


def bias_layer(weight: torch.Tensor, tp_rank: int, tp_size: int) -> SimpleNamespace:
    """This rank's rows of ``weight`` as vLLM splits an LM head: equal padded
    shards, the padding rows zero."""
    per_rank = -(-weight.shape[0] // tp_size)
    start = tp_rank * per_rank
    rows = weight[start : start + per_rank]
    padded = torch.zeros(per_rank, weight.shape[1])
    padded[: rows.shape[0]] = rows
    method = SimpleNamespace(apply=lambda layer, x: torch.nn.functional.linear(x, padded))
    shard = SimpleNamespace(
        org_vocab_start_index=min(start, weight.shape[0]),
        num_org_elements=rows.shape[0],
        num_added_elements=0,
    )
    return SimpleNamespace(quant_method=method, shard_indices=shard, tp_size=tp_size)


def inputs(tie: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(BATCH, SLOTS, VOCAB, generator=gen)
    markov_w1 = torch.randn(VOCAB, RANK, generator=gen)
    markov_w2 = torch.randn(VOCAB, RANK, generator=gen) * 0.5
    if tie:  # every logit the same: the walk must pick id 0 everywhere, as argmax does
        base, markov_w2 = torch.zeros_like(base), torch.zeros_like(markov_w2)
    anchors = torch.randint(0, VOCAB, (BATCH,), generator=gen)
    return {"base": base, "w1": markov_w1, "w2": markov_w2, "anchors": anchors}


def loop_tokens(data: dict[str, torch.Tensor]) -> torch.Tensor:
    def bias_step(previous, slot, state):  # noqa: ANN001, ANN202
        embedding = data["w1"][previous]
        return embedding @ data["w2"].T, None, embedding

    walked = walk_slots(
        data["base"], data["anchors"], bias_step, lambda c, s: sample_slot(c, None, None)
    )
    return walked.tokens


def rank_main(rank: int, port: int, tie: bool, results) -> None:  # noqa: ANN001
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        data = inputs(tie)
        layer = bias_layer(data["w2"], rank, 2)
        index = layer.shard_indices
        shard = markov_shards.VocabShard(
            layer, index.org_vocab_start_index, index.num_org_elements, dist.group.WORLD
        )

        def bias_step(previous, slot, state):  # noqa: ANN001, ANN202
            embedding = data["w1"][previous]  # the engine's embedding is all-reduced
            return shard.bias(embedding), None, embedding

        walked = walk_slots(shard.columns(data["base"]), data["anchors"], bias_step, shard.best)
        results[rank] = walked.tokens
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("tie", [False, True], ids=["random", "all-tied"])
def test_two_ranks_walking_their_shards_draft_the_loops_tokens(tie: bool) -> None:
    """Both ranks end with the loop's tokens; the tied case (every corrected logit
    equal) picks id 0 in every slot, which a rank keeping its own best would not."""
    results = mp.Manager().dict()
    mp.spawn(rank_main, args=(free_port(), tie, results), nprocs=2, join=True)
    expected = loop_tokens(inputs(tie))
    assert torch.equal(results[0], expected) and torch.equal(results[1], expected)
    if tie:
        assert not expected.any()
    else:
        assert len(set(expected.flatten().tolist())) > 3


def test_a_whole_bias_weight_is_not_walked_in_shards() -> None:
    """vocab_shard is None where the bias weight is whole on every rank (the fused
    kernel's or the loop's case), quantized, or scaled."""
    layer = bias_layer(torch.zeros(VOCAB, RANK), 0, 1)
    layer.quant_method = SimpleNamespace(apply=None)
    model = SimpleNamespace(model=SimpleNamespace(markov_head=SimpleNamespace(markov_w2=layer)))
    assert markov_shards.vocab_shard(model, VOCAB) is None
    layer.tp_size = 2  # split, but the stand-in's method is not an unquantized one
    assert markov_shards.vocab_shard(model, VOCAB) is None
