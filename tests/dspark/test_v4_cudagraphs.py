"""The V4 route's cudagraph mode under vLLM's breakable CUDA graphs, against the
installed vLLM's real config, dispatcher and V1 mode resolution.

The runner is a small stand-in carrying a real VllmConfig and CudagraphDispatcher, as
in ``tests/patches/test_cudagraph.py``: a real GPU model runner needs a GPU, and the
CPU runner forces cudagraphs off. The draft's config is a namespace with the keys
that tell a V4 checkpoint's own stages from a DeepSpec draft, marked as already
checked (the check reads the checkpoint, which is not what these tests are about).
"""

from __future__ import annotations

import logging
import sys
import types

import pytest

from vllm_v4_patches.dspark import v4_cudagraphs
from vllm_v4_patches.dspark.config_hooks import EXPOSED_MARK
from vllm_v4_patches.dspark.runner_hooks import install_dspark_drafter
from vllm_v4_patches.patcher import Patcher

BREAKABLE = "VLLM_USE_BREAKABLE_CUDAGRAPH"


def draft_config(v4: bool) -> types.SimpleNamespace:
    keys = {"dspark_block_size": 5, EXPOSED_MARK: ()}
    if v4:
        keys["hc_mult"] = 4  # DeepSeek-V4's residual streams: its own stages
    return types.SimpleNamespace(**keys)


def engine_config(mode_name: str, v4: bool = True):
    pytest.importorskip("torch")
    from graph_configs import cuda_like_config
    from vllm.config.compilation import CUDAGraphMode

    config = cuda_like_config(CUDAGraphMode[mode_name])
    draft = types.SimpleNamespace(hf_config=draft_config(v4))
    speculative = types.SimpleNamespace(
        method="dspark", draft_model_config=draft, num_speculative_tokens=5
    )
    # VllmConfig validates assignments to its fields; the namespace goes in beside them
    object.__setattr__(config, "speculative_config", speculative)
    return config


def runner_init_sees(config) -> tuple[str, set[str]]:
    """Run the overlay's runner-init hook with an __init__ that resolves the mode as
    the V1 runner does (its dispatcher built inside __init__, the mode resolved
    later): the mode it settled on and the dispatcher's keys."""
    runner = built_runner(config)
    dispatcher = runner.cudagraph_dispatcher
    keys = {mode.name for mode, found in dispatcher.cudagraph_keys.items() if found}
    return runner.compilation_config.cudagraph_mode.name, keys


def built_runner(config) -> types.SimpleNamespace:
    from vllm.config import set_current_vllm_config
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = types.SimpleNamespace()

    def init(vllm_config, device):
        with set_current_vllm_config(vllm_config):
            runner.cudagraph_dispatcher = CudagraphDispatcher(vllm_config)
        runner.compilation_config = vllm_config.compilation_config
        runner.vllm_config = vllm_config
        runner.parallel_config = vllm_config.parallel_config
        runner.uniform_decode_query_len = 6
        runner.kv_cache_config = None
        runner.max_num_reqs = 8
        runner.speculative_config = None
        runner.get_model = lambda: None

    import vllm.v1.worker.gpu_model_runner  # noqa: F401  the module the hook swaps in

    assert "vllm.v1.worker.gpu_model_runner" in sys.modules
    install_dspark_drafter(Patcher("dspark-test"), init, runner, (config, "cpu"), {})
    GPUModelRunner._check_and_update_cudagraph_mode(runner, [set()], [])
    return runner


@pytest.fixture(autouse=True)
def quiet_warmup(monkeypatch):
    monkeypatch.setenv("VLLM_V4_DSPARK_WARMUP", "off")  # no JIT-monitor hold in this process
    monkeypatch.delenv(v4_cudagraphs.SETTING, raising=False)


@pytest.mark.parametrize(
    ("mode", "demoted", "keys"),
    [("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", {"FULL"}), ("PIECEWISE", "NONE", set())],
)
def test_v4_stages_under_breakable_graphs_resolve_without_piecewise(
    monkeypatch, caplog, mode, demoted, keys
):
    monkeypatch.setenv(BREAKABLE, "1")
    with caplog.at_level(logging.WARNING, logger="vllm_v4_patches"):
        assert runner_init_sees(engine_config(mode)) == (demoted, keys)
    [line] = [r.getMessage() for r in caplog.records if "cudagraph mode" in r.getMessage()]
    assert f"{mode} -> {demoted}" in line and v4_cudagraphs.SETTING in line


def test_without_breakable_graphs_the_mode_is_stock(monkeypatch):
    """0.20-0.22: the compiled model's piecewise graphs, which the matrix passed."""
    monkeypatch.setenv(BREAKABLE, "0")
    mode, keys = runner_init_sees(engine_config("FULL_AND_PIECEWISE"))
    assert mode == "FULL_AND_PIECEWISE" and "PIECEWISE" in keys


def test_a_deepspec_draft_keeps_the_mode(monkeypatch):
    monkeypatch.setenv(BREAKABLE, "1")
    mode, keys = runner_init_sees(engine_config("FULL_AND_PIECEWISE", v4=False))
    assert mode == "FULL_AND_PIECEWISE" and "PIECEWISE" in keys


def test_the_setting_keeps_the_mode_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv(BREAKABLE, "1")
    monkeypatch.setenv(v4_cudagraphs.SETTING, "on")
    with caplog.at_level(logging.WARNING, logger="vllm_v4_patches"):
        mode, keys = runner_init_sees(engine_config("FULL_AND_PIECEWISE"))
    assert mode == "FULL_AND_PIECEWISE" and "PIECEWISE" in keys
    assert any(f"{v4_cudagraphs.SETTING}=on keeps" in r.getMessage() for r in caplog.records)


def test_a_bad_setting_is_one_line_and_the_mode_is_demoted(monkeypatch, caplog):
    monkeypatch.setenv(BREAKABLE, "1")
    monkeypatch.setenv(v4_cudagraphs.SETTING, "sometimes")
    with caplog.at_level(logging.WARNING, logger="vllm_v4_patches"):
        assert runner_init_sees(engine_config("FULL_AND_PIECEWISE"))[0] == "FULL_DECODE_ONLY"
    named = [r.getMessage() for r in caplog.records if "'sometimes'" in r.getMessage()]
    assert len(named) == 1 and "\n" not in named[0]
    assert v4_cudagraphs.SETTING in named[0] and "off, target, on" in named[0]


@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY", "NONE"])
def test_modes_without_piecewise_graphs_are_untouched(monkeypatch, mode):
    monkeypatch.setenv(BREAKABLE, "1")
    assert runner_init_sees(engine_config(mode))[0] == mode


# the runner rounds its capture sizes to multiples of 1 + N (6): five tokens pad to six
@pytest.mark.parametrize(
    ("choice", "expected"), [("target", ("NONE", 5)), ("on", ("PIECEWISE", 6))]
)
def test_target_keeps_the_runners_piecewise_graphs_and_the_drafter_runs_without(
    monkeypatch, choice, expected
):
    """The overlay's V4 drafter class, with a dispatcher the runner resolved: five
    draft tokens go to a padded piecewise replay, or unpadded and without graphs."""
    from vllm_v4_patches.dspark.v4_proposer import v4_proposer_class

    monkeypatch.setenv(BREAKABLE, "1")
    monkeypatch.setenv(v4_cudagraphs.SETTING, choice)
    runner = built_runner(engine_config("FULL_AND_PIECEWISE"))
    assert runner.compilation_config.cudagraph_mode.name == "FULL_AND_PIECEWISE"
    # the method reads these three only; __init__ sets the last from the setting
    drafter = object.__new__(v4_proposer_class())
    drafter.cudagraph_dispatcher = runner.cudagraph_dispatcher
    drafter.vllm_config = runner.vllm_config
    drafter.draft_graphs = v4_cudagraphs.drafter_graphs_allowed()
    mode, padded, _ = drafter._determine_batch_execution_and_padding(5)
    assert (mode.name, padded) == expected
