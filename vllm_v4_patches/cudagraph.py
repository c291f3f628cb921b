"""Patch ``cudagraph``: demote piecewise cudagraph modes when nothing is compiled."""

from __future__ import annotations

import ast
import logging
from typing import TYPE_CHECKING, Any

from vllm_v4_patches.errors import ProbeError
from vllm_v4_patches.graph_modes import breakable_cudagraphs_enabled, without_piecewise
from vllm_v4_patches.patcher import split_receiver
from vllm_v4_patches.registry import PatchRecord, ProbeResult, Target
from vllm_v4_patches.sources import SourceReader, dotted, find_class, find_method

if TYPE_CHECKING:
    from vllm_v4_patches.patcher import Patcher

V1_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_MODULE = "vllm.v1.worker.gpu.model_runner"
V1_METHOD = "_check_and_update_cudagraph_mode"
V2_METHOD = "initialize_kv_cache"

RECORD = PatchRecord(
    id="cudagraph",
    toggle="VLLM_V4_PATCH_CUDAGRAPH",
    summary="Demote PIECEWISE / FULL_AND_PIECEWISE cudagraph modes when no submodule is compiled.",
    why=(
        "Piecewise cudagraph modes capture the pieces torch.compile splits the model "
        "into. With compilation mode VLLM_COMPILE but a model that has no compiled "
        "submodule (any out-of-tree or plugin model class, a draft model, an "
        "architecture vLLM does not special-case), there is nothing to capture "
        "piecewise, yet the runner keeps the piecewise mode: the V1 runner never "
        "tells resolve_cudagraph_mode_and_sizes whether piecewise capture is "
        "available (every release), and the V2 runner learnt to only in 0.30. Stock "
        "DeepSeek-V4 escapes only because vLLM turns breakable cudagraphs on for "
        "its architecture name."
    ),
    how=(
        "Just before the runner resolves its cudagraph mode (V1 "
        "GPUModelRunner._check_and_update_cudagraph_mode, V2 "
        "GPUModelRunner.initialize_kv_cache before 0.30), demote "
        "compilation_config.cudagraph_mode as CUDAGraphMode.without_piecewise() does "
        "(PIECEWISE -> NONE, FULL_AND_PIECEWISE -> FULL_DECODE_ONLY) when the mode "
        "is VLLM_COMPILE, breakable cudagraphs are off and no submodule is an active "
        "TorchCompileWithNoGuardsWrapper. The runner then resolves sizes and "
        "initialises its dispatcher keys (and the drafter's) from the demoted mode, "
        "so config and dispatcher agree. FULL and NONE modes are never touched. "
        "Known gap: a V2 runner with adaptive verification (0.29) re-sets "
        "FULL_AND_PIECEWISE inside initialize_kv_cache, after the demotion."
    ),
    upstream=(
        "vLLM 0.30.0: V2 passes piecewise_capture_available (has_compiled_submodule)",
        "V1: no upstream fix as of 0.33.0",
        "ROCm/ATOM#2137: the seed fix (plugin path)",
    ),
    removal_plan=(
        "The V2 variant reports not-needed from 0.30 by itself; drop the V1 variant "
        "once V1 passes piecewise_capture_available (the probe looks for it)."
    ),
    targets=(
        Target(V1_MODULE, f"GPUModelRunner.{V1_METHOD}", runner="V1"),
        Target(V2_MODULE, f"GPUModelRunner.{V2_METHOD}", runner="V2", versions="<0.30"),
    ),
    vllm_versions=">=0.20.0",
)

logger = logging.getLogger("vllm_v4_patches")


# -- probe ------------------------------------------------------------------


def probe(source: SourceReader) -> ProbeResult:
    return ProbeResult.per_runner(
        {
            "V1": _runner_verdict(source, V1_MODULE, V1_METHOD),
            "V2": _runner_verdict(source, V2_MODULE, V2_METHOD),
        }
    )


def _runner_verdict(source: SourceReader, module: str, method_name: str) -> str:
    text = source.read(module)
    cls = find_class(ast.parse(text), "GPUModelRunner") if text else None
    method = find_method(cls, method_name) if cls else None
    if method is None:
        return "absent"
    calls = [
        node
        for node in ast.walk(method)
        if isinstance(node, ast.Call)
        and dotted(node.func).endswith(".resolve_cudagraph_mode_and_sizes")
    ]
    if not calls:
        raise ProbeError(f"{module}: GPUModelRunner.{method_name} resolves no cudagraph mode")
    told = any(kw.arg == "piecewise_capture_available" for call in calls for kw in call.keywords)
    return "not-needed" if told else "needed"


# -- apply ------------------------------------------------------------------


def apply(patcher: Patcher, found: ProbeResult) -> str:
    done = []
    if found.facts.get("V1") == "needed":
        import importlib

        runner = importlib.import_module(V1_MODULE).GPUModelRunner
        patcher.wrap(runner, V1_METHOD, demote_before_v1_resolve)
        done.append(f"V1 wrapped GPUModelRunner.{V1_METHOD}")
    if found.facts.get("V2") == "needed":
        how = patcher.wrap_when_imported(
            V2_MODULE, "GPUModelRunner", V2_METHOD, demote_before_v2_resolve
        )
        done.append(f"V2 {how} GPUModelRunner.{V2_METHOD}")
    return "; ".join(done)


def demote_before_v1_resolve(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    runner, _, _ = split_receiver(instance, args)
    demote_if_nothing_compiled(runner.compilation_config, _v1_model(runner))
    return wrapped(*args, **kwargs)


def demote_before_v2_resolve(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    runner, _, _ = split_receiver(instance, args)
    demote_if_nothing_compiled(runner.compilation_config, getattr(runner, "model", None))
    return wrapped(*args, **kwargs)


def _v1_model(runner: Any) -> Any:
    # self.model may be a CUDAGraphWrapper / UBatchWrapper; get_model() unwraps it
    try:
        return runner.get_model()
    except Exception:
        return None


def demote_if_nothing_compiled(compilation_config: Any, model: Any) -> None:
    from vllm.config.compilation import CompilationMode

    mode = compilation_config.cudagraph_mode
    if mode is None or not mode.requires_piecewise_compilation():
        return  # NONE and FULL modes are never touched
    if compilation_config.mode != CompilationMode.VLLM_COMPILE or model is None:
        return  # other compilation modes: vLLM's config demotes them itself
    if breakable_cudagraphs_enabled() or has_compiled_submodule(model):
        return
    demoted = without_piecewise(mode)
    logger.warning(
        "vllm_v4_patches: cudagraph mode %s needs piecewise capture, but %s has no "
        "compiled submodule and breakable cudagraphs are off; using %s",
        mode.name,
        type(model).__name__,
        demoted.name,
    )
    compilation_config.cudagraph_mode = demoted


def has_compiled_submodule(model: Any) -> bool:
    """An active @support_torch_compile module anywhere in the model (vLLM 0.30's test)."""
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    return any(
        isinstance(module, TorchCompileWithNoGuardsWrapper)
        and not getattr(module, "do_not_compile", True)
        for module in model.modules()
    )
