"""The ``cudagraph`` patch against the installed vLLM's real config and dispatcher.

The runner method is called on a small stand-in object that carries a real
VllmConfig's CompilationConfig and a real CudagraphDispatcher: building a full
GPU model runner needs a GPU, and the CPU runner forces cudagraphs off.
"""

from __future__ import annotations

import types

import pytest

from vllm_v4_patches import cudagraph
from vllm_v4_patches.patcher import Patcher
from vllm_v4_patches.sources import InstalledSource


@pytest.fixture(scope="module")
def vllm_parts():
    torch = pytest.importorskip("torch")
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    from vllm.config.compilation import CUDAGraphMode

    class CompiledBlock(torch.nn.Module, TorchCompileWithNoGuardsWrapper):
        """Marks itself as an active @support_torch_compile module, as vLLM's decorator does."""

        def __init__(self, active: bool) -> None:
            torch.nn.Module.__init__(self)
            self.do_not_compile = not active

    return types.SimpleNamespace(
        torch=torch,
        Mode=CUDAGraphMode,
        Block=CompiledBlock,
    )


def model(parts, compiled: bool | None):
    """A model with an active compiled block, an inactive one (None), or a plain layer."""
    layers = [parts.torch.nn.Linear(2, 2)]
    if compiled is not None:
        layers.append(parts.Block(active=compiled))
    return parts.torch.nn.Sequential(*layers)


def runner(parts, mode, net):
    from graph_configs import cuda_like_config
    from vllm.config import set_current_vllm_config
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    config = cuda_like_config(mode)
    compilation = config.compilation_config
    with set_current_vllm_config(config):
        dispatcher = CudagraphDispatcher(config)
    return types.SimpleNamespace(
        compilation_config=compilation,
        vllm_config=config,
        parallel_config=config.parallel_config,
        uniform_decode_query_len=1,
        kv_cache_config=None,
        max_num_reqs=8,
        cudagraph_dispatcher=dispatcher,
        speculative_config=None,
        get_model=lambda: net,
    )


def resolve(parts, mode, net):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stand_in = runner(parts, mode, net)
    GPUModelRunner._check_and_update_cudagraph_mode(stand_in, [set()], [])
    keys = {m.name for m, k in stand_in.cudagraph_dispatcher.cudagraph_keys.items() if k}
    return stand_in.compilation_config.cudagraph_mode, keys


@pytest.fixture
def patched():
    patcher = Patcher("cudagraph")
    cudagraph.apply(patcher, cudagraph.probe(InstalledSource()))
    yield
    patcher.revert()


def test_probe_on_the_installed_vllm_finds_v1_buggy_and_v2_fixed():
    found = cudagraph.probe(InstalledSource())
    assert (found.verdict, found.variant) == ("needed", "V1")
    assert found.facts == {"V1": "needed", "V2": "not-needed"}


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_stock_keeps_a_piecewise_mode_with_nothing_compiled(vllm_parts, mode):
    resolved, keys = resolve(vllm_parts, vllm_parts.Mode[mode], model(vllm_parts, None))
    assert resolved == vllm_parts.Mode[mode]
    assert "PIECEWISE" in keys  # the dispatcher will try to replay piecewise graphs


@pytest.mark.parametrize(
    ("mode", "demoted", "keys"),
    [("PIECEWISE", "NONE", set()), ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", {"FULL"})],
)
@pytest.mark.parametrize("compiled", [None, False])  # no wrapper, or an inactive one
def test_patched_demotes_and_keeps_config_and_dispatcher_consistent(
    vllm_parts, patched, mode, demoted, keys, compiled
):
    resolved, found_keys = resolve(vllm_parts, vllm_parts.Mode[mode], model(vllm_parts, compiled))
    assert resolved == vllm_parts.Mode[demoted]
    assert found_keys == keys


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_patched_leaves_a_model_with_a_compiled_submodule_alone(vllm_parts, patched, mode):
    resolved, keys = resolve(vllm_parts, vllm_parts.Mode[mode], model(vllm_parts, True))
    assert resolved == vllm_parts.Mode[mode] and "PIECEWISE" in keys


@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY", "NONE"])
def test_patched_never_touches_full_or_none_modes(vllm_parts, mode):
    stock = resolve(vllm_parts, vllm_parts.Mode[mode], model(vllm_parts, None))
    patcher = Patcher("cudagraph")
    cudagraph.apply(patcher, cudagraph.probe(InstalledSource()))
    try:
        assert resolve(vllm_parts, vllm_parts.Mode[mode], model(vllm_parts, None)) == stock
    finally:
        patcher.revert()


def test_patched_leaves_breakable_cudagraphs_alone(vllm_parts, patched, monkeypatch):
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    resolved, _ = resolve(vllm_parts, vllm_parts.Mode.PIECEWISE, model(vllm_parts, None))
    assert resolved == vllm_parts.Mode.PIECEWISE


def test_v2_wrapper_demotes_before_the_runner_resolves(vllm_parts):
    """The V2 runner's initialize_kv_cache allocates a GPU KV cache, so the wrapper is
    called with a stand-in for it that records the mode it would resolve from."""
    stand_in = runner(vllm_parts, vllm_parts.Mode.FULL_AND_PIECEWISE, None)
    stand_in.model = model(vllm_parts, None)
    seen = []

    def initialize_kv_cache(*args, **kwargs):
        seen.append(stand_in.compilation_config.cudagraph_mode)

    cudagraph.demote_before_v2_resolve(initialize_kv_cache, stand_in, (), {})
    assert seen == [vllm_parts.Mode.FULL_DECODE_ONLY]


def test_v2_variant_is_armed_until_its_module_is_imported(monkeypatch):
    """On a release whose V2 runner is still buggy the V2 wrapper waits for the import."""
    import sys

    from vllm_v4_patches.registry import ProbeResult

    monkeypatch.delitem(sys.modules, cudagraph.V2_MODULE, raising=False)
    patcher = Patcher("cudagraph")
    facts = {"V1": "not-needed", "V2": "needed"}
    detail = cudagraph.apply(patcher, ProbeResult("needed", "-", "V2", facts))
    assert detail == "V2 armed GPUModelRunner.initialize_kv_cache"
    import vllm.v1.worker.gpu.model_runner as v2

    try:
        assert v2.GPUModelRunner.__dict__["initialize_kv_cache"].__wrapped__ is not None
    finally:
        patcher.revert()
    assert not hasattr(v2.GPUModelRunner.__dict__["initialize_kv_cache"], "__wrapped__")
