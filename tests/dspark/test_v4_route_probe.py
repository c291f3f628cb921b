"""The dspark probe's DeepSeek-V4 aspect: where a V4 checkpoint's own stages can be
drafted on V1, read from source trees written here (each release's real answer is
in the matrix, which tests/core/test_compat.py checks against every release)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_v4_patches import compat
from vllm_v4_patches.dspark import (
    V4_DRAFT_METHODS,
    V4_ROUTE_CLASS,
    V4_ROUTE_NO_CLASS,
    V4_ROUTE_NO_V4,
    V4_ROUTE_OVERLAY,
    v4_draft_route,
)
from vllm_v4_patches.sources import TreeSource

REGISTRY = "vllm/model_executor/models/registry.py"
DRAFT = "vllm/models/deepseek_v4/nvidia/dspark.py"
WITH_V4 = '_MODELS = {"DeepseekV4ForCausalLM": ("vllm.models.deepseek_v4", "X")}\n'


def tree(root: Path, files: dict[str, str]) -> TreeSource:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return TreeSource(str(root))


def draft_class(methods: tuple[str, ...]) -> str:
    body = "".join(f"    def {name}(self):\n        pass\n" for name in methods)
    return f"class DSparkDeepseekV4ForCausalLM:\n{body or '    pass'}\n"


def test_a_release_without_deepseek_v4_says_so(tmp_path):
    source = tree(tmp_path, {REGISTRY: '_MODELS = {"LlamaForCausalLM": ("llama", "L")}\n'})
    assert v4_draft_route(source) == V4_ROUTE_NO_V4


def test_v4_without_its_draft_module_has_no_route(tmp_path):
    assert v4_draft_route(tree(tmp_path, {REGISTRY: WITH_V4})) == V4_ROUTE_NO_CLASS


@pytest.mark.parametrize("missing", V4_DRAFT_METHODS)
def test_a_draft_class_missing_a_method_the_v1_drafter_calls_has_no_route(tmp_path, missing):
    methods = tuple(name for name in V4_DRAFT_METHODS if name != missing)
    source = tree(tmp_path, {REGISTRY: WITH_V4, DRAFT: draft_class(methods)})
    assert v4_draft_route(source) == V4_ROUTE_NO_CLASS


def test_the_full_draft_class_is_the_route(tmp_path):
    source = tree(tmp_path, {REGISTRY: WITH_V4, DRAFT: draft_class(V4_DRAFT_METHODS)})
    assert v4_draft_route(source) == V4_ROUTE_CLASS


def test_the_matrix_records_the_route_and_tells_releases_apart():
    """Before 0.25 V4 has no draft class: 0.20-0.24 have the blocks the overlay builds
    its own from (in two model modules, three layer and head layouts); from 0.25 the
    overlay's V1 route uses vLLM's. The aspect is part of the answer the sweep
    compares."""
    rows = compat.load_matrix()["versions"]
    for version in ("0.20.0", "0.20.2", "0.21.0", "0.22.1", "0.23.0", "0.24.0"):
        assert rows[version]["patches"]["dspark"]["aspects"] == {"v4": V4_ROUTE_OVERLAY}
    assert rows["0.26.0"]["patches"]["dspark"]["aspects"] == {"v4": V4_ROUTE_CLASS}
    changed = {**rows["0.26.0"]["patches"]["dspark"], "aspects": {"v4": V4_ROUTE_NO_CLASS}}
    assert compat._answer(changed) != compat._answer(rows["0.26.0"]["patches"]["dspark"])


NEW_MODEL = "vllm/models/deepseek_v4/nvidia/model.py"
OLD_MODEL = "vllm/model_executor/models/deepseek_v4.py"
NEW_ATTENTION = "vllm/models/deepseek_v4/attention.py"
OLD_ATTENTION = "vllm/model_executor/layers/deepseek_v4_attention.py"
BUILDER = "vllm/v1/attention/backends/mla/sparse_swa.py"
DEFERRED = "x, positions, input_ids, post_mix, res_mix, residual"
MIXED = "x, positions, input_ids"


def model_text(layer_args: str, layer_extra: str = "", top: str = "") -> str:
    return (
        top + "class DeepseekV4DecoderLayer:\n"
        f"    def forward(self, {layer_args}):\n        pass\n"
        + layer_extra
        + "class DeepseekV4Model:\n"
        "    def load_weights(self, w):\n        pass\n"
        "    def get_expert_mapping(self):\n        pass\n"
        "class DeepseekV4ForCausalLM:\n"
        "    hf_to_vllm_mapper = None\n"
    )


ATTENTION = (
    "class Wrapper:\n"
    "    def __init__(self):\n        self.swa_cache_layer = None\n"
    "    def _fused_qnorm_rope_kv_insert(self, q, kv, positions, attn_metadata):\n"
    "        pass\n"
)
SHARED = {
    BUILDER: (
        "class DeepseekSparseSWAMetadataBuilder:\n"
        "    def __init__(self):\n"
        "        self.decode_threshold = self.reorder_batch_threshold + 1\n"
        "    def build(self, p, c):\n        return self.decode_swa_indices\n"
    )
}
# each release family's layout, as the probe reads it (the real trees: the matrix)
LAYOUTS = {
    "0.20": {
        OLD_MODEL: model_text(MIXED, top="def hc_head(a):\n    pass\n"),
        OLD_ATTENTION: ATTENTION,
    },
    "0.21": {
        OLD_MODEL: model_text(
            DEFERRED,
            "    def hc_post(self, x, r, p, c):\n        pass\n",
            "def hc_head(a):\n    pass\n",
        ),
        OLD_ATTENTION: ATTENTION,
    },
    "0.22": {
        NEW_MODEL: model_text(
            DEFERRED,
            "    def hc_post(self, x, r, p, c):\n        pass\n",
            "from vllm.model_executor.layers.mhc import HCHeadOp\n",
        ),
        NEW_ATTENTION: ATTENTION,
    },
    "0.23": {
        NEW_MODEL: model_text(
            DEFERRED,
            top="from vllm.model_executor.kernels.mhc.tilelang import (\n"
            "    hc_head_fused_kernel_tilelang,\n    mhc_post_tilelang,\n)\n",
        ),
        NEW_ATTENTION: ATTENTION,
    },
}


@pytest.mark.parametrize("family", LAYOUTS)
def test_v4_blocks_without_the_class_are_the_overlays_route(tmp_path, family):
    files = {REGISTRY: WITH_V4, **SHARED, **LAYOUTS[family]}
    assert v4_draft_route(tree(tmp_path, files)) == V4_ROUTE_OVERLAY


@pytest.mark.parametrize(
    "family, path, old, new",
    [
        ("0.23", NEW_MODEL, "    mhc_post_tilelang,\n", ""),  # deferred, no post-mix
        ("0.21", OLD_MODEL, "def hc_post", "def post"),
        ("0.20", OLD_MODEL, "def hc_head", "def head"),  # no head reduction
        ("0.22", NEW_MODEL, "get_expert_mapping", "expert_mapping"),
        ("0.22", NEW_MODEL, "hf_to_vllm_mapper", "mapper"),
        ("0.20", OLD_MODEL, MIXED, "x, positions"),  # a layer of another shape
        ("0.23", NEW_ATTENTION, "attn_metadata", "metadata"),
        ("0.23", NEW_ATTENTION, "self.swa_cache_layer", "self.cache"),
        ("0.20", BUILDER, "self.decode_swa_indices", "self.indices"),
        ("0.22", BUILDER, "self.decode_threshold", "self.threshold"),  # no split to align
    ],
)
def test_a_missing_block_leaves_v4_refused(tmp_path, family, path, old, new):
    files = {REGISTRY: WITH_V4, **SHARED, **LAYOUTS[family]}
    assert old in files[path]
    files[path] = files[path].replace(old, new)
    assert v4_draft_route(tree(tmp_path, files)) == V4_ROUTE_NO_CLASS


@pytest.mark.parametrize(
    "version, gated", [("0.20.2", True), ("0.21.0", True), ("0.22.0", False), ("0.24.0", False)]
)
def test_the_tap_model_list_without_v4_is_found_where_it_is(version, gated):
    """0.20-0.21 check a tapping method's target type against a fixed list without
    DeepSeek-V4 (the probe's fact that lets a V4 target pass it); 0.22 dropped it."""
    import vllm_builds

    from vllm_v4_patches.dspark import probe

    found = probe(TreeSource(str(vllm_builds.fetch_source(version))))
    assert found.aspects["v4"] == V4_ROUTE_OVERLAY
    assert found.facts["v4_taps_gate"] is gated
