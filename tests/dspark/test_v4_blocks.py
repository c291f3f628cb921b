"""The release's DeepSeek-V4 blocks as the overlay's own V4 draft class uses them
(``dspark.v4_blocks``), on 0.20-0.24.

The probe half reads the real source trees of those releases. The run-time half
drives stand-in layers, heads and attention modules shaped as each release's are:
the real ones need CUDA, TileLang and V4's custom ops, which this machine lacks."""

from __future__ import annotations

import ast
import types

import pytest
import torch

from vllm_v4_patches.dspark import v4_blocks
from vllm_v4_patches.sources import TreeSource, find_class, find_method

NEW_MODEL, OLD_MODEL = v4_blocks.MODEL_MODULES
# per release: the model module, the layer's layout, where the last post-mix lives,
# and the head reduction the run-time lookup takes first
RELEASES = {
    "0.20.2": (OLD_MODEL, "mixed", None, "hc_head"),
    "0.21.0": (OLD_MODEL, "deferred", "layer", "hc_head"),
    "0.22.0": (NEW_MODEL, "deferred", "layer", "HCHeadOp"),
    "0.23.0": (NEW_MODEL, "deferred", "module", "hc_head_fused_kernel_tilelang"),
    "0.24.0": (NEW_MODEL, "deferred", "module", "hc_head_fused_kernel_tilelang"),
}


@pytest.mark.parametrize("version", RELEASES)
def test_each_release_before_025_has_its_blocks_where_the_route_looks(version):
    """The probe names the module, and the layouts it accepts are the ones each
    release really has (so the run-time lookups below meet what they expect)."""
    import vllm_builds

    module, layout, post, head = RELEASES[version]
    source = TreeSource(str(vllm_builds.fetch_source(version)))
    assert v4_blocks.model_module(source) == module
    tree = ast.parse(source.read(module))
    layer = find_class(tree, v4_blocks.LAYER_CLASS)
    args = tuple(a.arg for a in find_method(layer, "forward").args.args[1:])
    assert args == (
        v4_blocks.MIXED_LAYER_ARGS if layout == "mixed" else v4_blocks.DEFERRED_LAYER_ARGS
    )
    own_post = find_method(layer, v4_blocks.LAYER_POST) is not None
    module_post = v4_blocks.MODULE_POST in v4_blocks.top_names(tree)
    if post == "layer":
        assert own_post
    if post == "module":
        assert module_post and not own_post
    names = v4_blocks.top_names(tree)
    assert [name for name in v4_blocks.HEAD_NAMES if name in names][0] == head


def test_a_release_without_v4_has_no_blocks():
    import vllm_builds

    assert v4_blocks.model_module(TreeSource(str(vllm_builds.fetch_source("0.19.1")))) is None


# -- run time: stand-ins shaped as the releases' ----------------------------------------


def mhc_post_tilelang(hidden, residual, post_mix, res_mix):
    """0.23+'s post-mix lives in the layer's module (this one, for ModuleLayer)."""
    return hidden * 10 + residual


class MixedLayer(torch.nn.Module):
    """0.20: the layer mixes its own streams."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, x, positions, input_ids):
        return x + self.index + positions[:, None, None]


class DeferredLayer(torch.nn.Module):
    """0.21-0.22: the layer returns its streams, residual and mixes, and owns the
    post-mix its caller applies after the last layer."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.seen: list = []

    def forward(self, x, positions, input_ids, post_mix, res_mix, residual):
        self.seen.append((post_mix, res_mix, residual))
        tag = torch.full((1,), float(self.index))
        return x + 1, x, tag, -tag

    def hc_post(self, hidden, residual, post_mix, res_mix):
        return hidden * 100 + residual + post_mix


class ModuleLayer(DeferredLayer):
    """0.23+: as 0.21's layer, with the post-mix in its model module."""

    hc_post = None  # type: ignore[assignment]


def streams() -> torch.Tensor:
    return torch.zeros(3, 4, 8)


def test_mixed_layers_run_in_order_and_return_their_streams():
    layers = torch.nn.ModuleList(MixedLayer(i) for i in (1, 2, 3))
    positions = torch.tensor([0, 5, 9])
    out = v4_blocks.run_layers(layers, streams(), positions, None)
    assert not v4_blocks.defers_post_mix(layers[0])
    assert torch.equal(out[:, 0, 0], 6 + 3 * positions.float())


def test_deferred_layers_hand_on_their_mixes_and_the_last_post_mix_is_the_layers():
    layers = torch.nn.ModuleList(DeferredLayer(i) for i in (1, 2))
    out = v4_blocks.run_layers(layers, streams(), torch.zeros(3), None)
    assert v4_blocks.defers_post_mix(layers[0])
    assert layers[0].seen == [(None, None, None)]
    post_mix, res_mix, residual = layers[1].seen[0]
    assert float(post_mix) == 1 and float(res_mix) == -1 and float(residual.sum()) == 0
    # the last layer's (streams 2, residual 1, post_mix 2) through its own hc_post
    assert float(out[0, 0, 0]) == 2 * 100 + 1 + 2


def test_a_layer_without_its_own_post_mix_uses_its_modules():
    layers = torch.nn.ModuleList(ModuleLayer(i) for i in (1, 2))
    out = v4_blocks.run_layers(layers, streams(), torch.zeros(3), None)
    assert float(out[0, 0, 0]) == 2 * 10 + 1
    tap = v4_blocks.mixed_streams(layers[0], (torch.ones(2, 4, 8), torch.ones(2, 4, 8), 0, 0))
    assert float(tap[0, 0, 0]) == 11


class NativeLayer(DeferredLayer):
    """0.22 off CUDA: the layer's native path mixes its streams and returns no
    residual or mixes; its ``hc_post`` must not run then."""

    def forward(self, x, positions, input_ids, post_mix, res_mix, residual):
        return x + self.index, None, None, None

    def hc_post(self, hidden, residual, post_mix, res_mix):
        raise AssertionError("the native path's streams are mixed already")


def test_a_layer_that_mixed_its_own_streams_is_not_post_mixed_again():
    layers = torch.nn.ModuleList(NativeLayer(i) for i in (1, 2))
    out = v4_blocks.run_layers(layers, streams(), torch.zeros(3), None)
    assert float(out[0, 0, 0]) == 3


def test_the_head_is_the_first_of_the_known_names_and_a_class_is_built():
    class HeadOp:
        def __call__(self, *args):
            return "op"

    module = types.ModuleType("stand_in")
    module.hc_head = lambda *args: "function"
    module.HCHeadOp = HeadOp
    assert v4_blocks.head_reduction(module)() == "function"
    del module.hc_head
    head = v4_blocks.head_reduction(module)
    assert isinstance(head, HeadOp) and head() == "op"
    del module.HCHeadOp
    with pytest.raises(RuntimeError, match="hc_head"):
        v4_blocks.head_reduction(module)


class Cache:
    prefix, block_size = "model.layers.4.attn.swa_cache", 64


class Inserting(torch.nn.Module):
    """An attention module holding the cache and the fused insert (recorded)."""

    n_local_heads, head_dim = 2, 16

    def __init__(self) -> None:
        super().__init__()
        self.swa_cache_layer = Cache()
        self.calls: list = []

    def _fused_qnorm_rope_kv_insert(self, q, kv, positions, attn_metadata):
        self.calls.append((q, kv, positions, attn_metadata))


class Outer(torch.nn.Module):
    """0.20-0.22: the layer's attn holds the wrapper that inserts."""

    def __init__(self) -> None:
        super().__init__()
        self.mla_attn = Inserting()


@pytest.mark.parametrize("nested", [True, False])
def test_context_rows_go_through_the_releases_own_insert(nested):
    layer = types.SimpleNamespace(attn=Outer() if nested else Inserting())
    owner = layer.attn.mla_attn if nested else layer.attn
    assert v4_blocks.kv_owner(layer) is owner
    kv = torch.randn(5, 16, dtype=torch.bfloat16)
    positions, slots = torch.arange(5), torch.tensor([64, 65, 66, -1, 130])
    v4_blocks.write_context_kv(layer, kv, positions, slots)
    ((query, passed_kv, passed_positions, metadata),) = owner.calls
    assert query.shape == (5, 2, 16) and query.dtype == kv.dtype and not query.any()
    assert passed_kv is kv and passed_positions is positions
    assert set(metadata) == {Cache.prefix}
    assert metadata[Cache.prefix].slot_mapping is slots
    assert metadata[Cache.prefix].block_size == 64
