"""``swa_prefix``: prefix-cache hits for DeepSeek-V4's sliding-window groups with a
drafter, in the real KV cache manager of vLLM 0.22.1 and 0.24.0.

The release's own ``KVCacheManager`` (imported from its source tree on the CPU)
serves one 815-token prompt twice in 256-token chunks with V4's group layout: a
compressed MLA group of 256-token blocks, the target's and the draft's
sliding-window groups (block 64, window 128) and a compressor-state group. The
GPU run that found the fault is ``docs/gpu-runs/2026-12-07/0.22.1-1`` (0 of 17,286
tokens hit with DSpark on). ``gguf`` is a stand-in module: vLLM's config package
imports it and nothing here calls it.
"""

from __future__ import annotations

import json

import pytest
from vllm_builds import fetch_source

from conftest import REPO, run_python
from vllm_v4_patches import swa_prefix
from vllm_v4_patches.sources import TreeSource

pytestmark = pytest.mark.e2e

PROMPT_TOKENS = 815
LOOKUP = r"""
import inspect, json, math, sys

import torch

applied = None
if sys.argv[2] == "patched":
    from vllm_v4_patches.patcher import Patcher
    from vllm_v4_patches.registry import load_patch
    from vllm_v4_patches.sources import InstalledSource

    patch = load_patch("vllm_v4_patches.swa_prefix")
    found = patch.probe(InstalledSource())
    applied = [found.verdict, patch.apply(Patcher(patch.id), found)]

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec, SlidingWindowMLASpec,
)
from vllm.v1.request import Request

speculative = sys.argv[1] == "eagle"
PROMPT, CHUNK = int(sys.argv[3]), 256


def window(block, size, version="deepseek_v4", head=512):
    return SlidingWindowMLASpec(block_size=block, num_kv_heads=1, head_size=head,
        dtype=torch.uint8, sliding_window=size, cache_dtype_str="fp8_ds_mla",
        alignment=576, model_version=version)


compressed = MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=512,
    dtype=torch.uint8, compress_ratio=4, cache_dtype_str="fp8_ds_mla", alignment=576,
    model_version="deepseek_v4")
groups = [
    KVCacheGroupSpec(["model.layers.0.attn"], compressed),
    KVCacheGroupSpec(["model.layers.0.swa", "model.layers.1.swa"], window(64, 128)),
    KVCacheGroupSpec(["mtp.0.swa", "mtp.1.swa"], window(64, 128)),
    KVCacheGroupSpec(["model.layers.0.state"], window(4, 8, None, 1024)),
]
config = KVCacheConfig(num_blocks=2000, kv_cache_tensors=[], kv_cache_groups=groups)
sizes = [g.kv_cache_spec.block_size for g in groups]
hash_block = math.gcd(*sizes)
kwargs = dict(kv_cache_config=config, max_model_len=4096, hash_block_size=hash_block,
    enable_caching=True, use_eagle=speculative, max_num_batched_tokens=CHUNK)
if "scheduler_block_size" in inspect.signature(KVCacheManager.__init__).parameters:
    kwargs["scheduler_block_size"] = math.lcm(*sizes)
manager = KVCacheManager(**kwargs)
kv_cache_utils.init_none_hash(sha256)
hasher = kv_cache_utils.get_request_block_hasher(hash_block, sha256)
prompt = list(range(1000, 1000 + PROMPT))


def prefill(name):
    request = Request(name, prompt, SamplingParams(max_tokens=8), None, block_hasher=hasher)
    blocks, hit = manager.get_computed_blocks(request)
    request.num_computed_tokens = hit
    first = True
    while request.num_computed_tokens < PROMPT:
        new = min(CHUNK, PROMPT - request.num_computed_tokens)
        allocated = manager.allocate_slots(
            request, new, num_new_computed_tokens=hit if first else 0,
            new_computed_blocks=blocks if first else None,
            num_lookahead_tokens=4 if speculative else 0)
        assert allocated is not None
        first = False
        request.num_computed_tokens += new
    manager.free(request)
    return hit


first = prefill("first")
print("RESULT " + json.dumps({"first": first, "second": prefill("second"), "applied": applied}))
"""


# any name the import-time code of vLLM's GGUF helpers reads from gguf resolves
STAND_IN = """
class Anything:
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Anything()

    def __call__(self, *args, **kwargs):
        return Anything()


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return Anything()
"""


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    root = tmp_path_factory.mktemp("stand-ins")
    (root / "gguf").mkdir()
    for module in ("__init__", "constants", "quants"):
        (root / "gguf" / f"{module}.py").write_text(STAND_IN)
    return root


def second_pass_hit(version: str, stand_ins, *, eagle: bool, patched: bool) -> dict:
    source = fetch_source(version)
    # the package importable, not on PYTHONPATH: the repository's sitecustomize would
    # activate the overlay at vLLM's import, and "stock" must stay stock
    args = ["-c", f"import sys; sys.path.append({str(REPO)!r})\n{LOOKUP}"]
    args += ["eagle" if eagle else "none", "patched" if patched else "stock", str(PROMPT_TOKENS)]
    run = run_python(args, pythonpath=[str(source), str(stand_ins)], timeout=300)
    [line] = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def test_the_probe_finds_the_mask_only_on_0_22():
    for version, verdict in (("0.21.0", "not-needed"), ("0.22.1", "needed")):
        assert swa_prefix.probe(TreeSource(str(fetch_source(version)))).verdict == verdict
    found = swa_prefix.probe(TreeSource(str(fetch_source("0.24.0"))))
    assert (found.verdict, swa_prefix.EAGLE_AWARE_MASK in found.detail) == ("not-needed", True)


def test_stock_0_22_1_never_hits_with_the_eagle_lookahead_and_the_patch_restores_it(stand_ins):
    stock = second_pass_hit("0.22.1", stand_ins, eagle=True, patched=False)
    patched = second_pass_hit("0.22.1", stand_ins, eagle=True, patched=True)
    assert stock["second"] == 0, stock
    # applied before the modules' import: armed, then wrapped when they are imported
    assert patched["applied"][0] == "needed"
    assert f"{swa_prefix.MANAGER}.{swa_prefix.MASK}" in patched["applied"][1]
    # two 256-token segments: the last whole one (768) gives its block to the lookahead
    assert patched["second"] == 512, patched
    # 0.24.0, whose mask keeps the lookahead block, hits the same without a patch
    assert second_pass_hit("0.24.0", stand_ins, eagle=True, patched=False)["second"] == 512


def test_without_speculation_the_patch_changes_nothing(stand_ins):
    stock = second_pass_hit("0.22.1", stand_ins, eagle=False, patched=False)
    patched = second_pass_hit("0.22.1", stand_ins, eagle=False, patched=True)
    assert stock["second"] == patched["second"] == 768
