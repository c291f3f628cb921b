"""``dspark``'s runner hooks: the V1 runner of a DSpark engine builds and drives the
overlay's drafter.

While a DSpark runner's ``__init__`` runs, its drafter classes build the DSpark
drafter; the target's taps come from the draft's layer ids; each engine step ends
the warm-up where it is over and hands scheduled verification the step's drafts
(synchronous) or scheduler output (async); attention metadata builds publish the
batch's request ids. Every hook passes non-DSpark runners straight through.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from vllm_v4_patches.dspark import DRAFTER_NAMES, RUNNER_MODULE
from vllm_v4_patches.dspark.config_hooks import is_dspark, validate_draft_checkpoint
from vllm_v4_patches.patcher import split_receiver

if TYPE_CHECKING:
    from vllm_v4_patches.patcher import Patcher


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
    _v4_stages_graph_mode(vllm_config)
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


def _v4_stages_graph_mode(vllm_config: Any) -> None:
    # before __init__: the runner's dispatchers and its load_model read the mode
    from vllm_v4_patches.dspark.v4_proposer import drafts_deepseek_v4

    if drafts_deepseek_v4(vllm_config.speculative_config.draft_model_config.hf_config):
        from vllm_v4_patches.dspark import v4_cudagraphs

        v4_cudagraphs.keep_off_piecewise(vllm_config)


def warm_after_start(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    core, call_args, _ = split_receiver(instance, args)
    vllm_config = call_args[0] if call_args else kwargs["vllm_config"]
    if is_dspark(vllm_config.speculative_config):
        from vllm_v4_patches.dspark import warmup

        warmup.warm_engine_core(core, vllm_config)
    return result


def build_dspark_drafter(vllm_config: Any, device: Any, runner: Any = None) -> Any:
    from vllm_v4_patches.dspark.v4_proposer import drafts_deepseek_v4, v4_proposer_class

    draft_config = vllm_config.speculative_config.draft_model_config.hf_config
    if drafts_deepseek_v4(draft_config):
        return v4_proposer_class()(vllm_config, device, runner)
    from vllm_v4_patches.dspark.proposer import proposer_class

    return proposer_class()(vllm_config, device, runner)


def dspark_target_taps(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    runner, _, _ = split_receiver(instance, args)
    if not is_dspark(runner.speculative_config):
        return wrapped(*args, **kwargs)
    from vllm_v4_patches.dspark.checkpoint import draft_spec

    spec = draft_spec(runner.speculative_config.draft_model_config.hf_config)
    return aux_layers(spec)


def aux_layers(spec: Any) -> tuple[int, ...]:
    """vLLM's aux index i is the stream entering layer i, i.e. the output of layer
    i - 1. DeepSpec and V4 checkpoints name the layer whose output they tap;
    V4.1 names the layer whose (attention) input it taps."""
    from vllm_v4_patches.dspark.checkpoint import FORMAT_DEEPSEEK_V41

    shift = 0 if spec.format == FORMAT_DEEPSEEK_V41 else 1
    return tuple(layer_id + shift for layer_id in spec.target_layer_ids)


def _dspark_drafter(runner: Any) -> Any:
    drafter = getattr(runner, "drafter", None)
    return drafter if getattr(drafter, "draft_method", None) == "dspark" else None


def run_engine_step(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    runner, call_args, receiver = split_receiver(instance, args)
    drafter = _dspark_drafter(runner)
    if drafter is None:
        return wrapped(*args, **kwargs)
    scheduler_output = call_args[0] if call_args else kwargs["scheduler_output"]
    from vllm_v4_patches.dspark import verify, warmup

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
            seeded=verify.seeded_requests(runner),
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
    from vllm_v4_patches.dspark import verify

    cut = drafter.verification.cut_drafts(
        drafts.req_ids,
        drafts.draft_token_ids,
        drafter.last_confidence,
        seeded=verify.seeded_requests(runner),
    )
    return drafts if cut is None else type(drafts)(drafts.req_ids, cut)


def publish_request_ids(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    runner, _, _ = split_receiver(instance, args)
    if _dspark_drafter(runner) is None:
        return wrapped(*args, **kwargs)
    from vllm_v4_patches import request_ids

    with request_ids.published(runner.input_batch.req_ids):
        return wrapped(*args, **kwargs)
