"""``dspark``'s config-time hooks: how a dspark speculative config reaches V1.

Per release (the routes ``dspark.probe`` finds): before 0.25 a dspark config is
accepted as vLLM's dflash method with the draft marked and its DSpark keys exposed
where vLLM's DFlash code reads them, and V2 is kept off for it; on 0.25-0.28 the
runner choice may fall back to V1 where V2 cannot run; from 0.29 V1's unsupported
list lets dspark through. A local draft's config is validated first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from vllm_v4_patches.dspark import (
    DRAFT_METHOD_MARK,
    DSPARK_ARCHITECTURE,
    DSPARK_ARCHITECTURES,
    UNSUPPORTED_ENTRY,
    V4_MODEL_TYPE,
    V4_ROUTE_CLASS,
    V4_ROUTE_OVERLAY,
)
from vllm_v4_patches.patcher import split_receiver


def is_dspark(speculative_config: Any) -> bool:
    if speculative_config is None:
        return False
    if speculative_config.method == "dspark":
        return True
    draft = getattr(speculative_config, "draft_model_config", None)
    return getattr(getattr(draft, "hf_config", None), DRAFT_METHOD_MARK, None) == "dspark"


def accept_dspark_as_dflash(
    wrapped: Any, instance: Any, args: tuple, kwargs: dict, v4_taps_gate: bool = False
) -> Any:
    """``SpeculativeConfig.__init__``: a dspark request runs as vLLM's dflash method.
    With ``v4_taps_gate`` (the probe found 0.20-0.21's list of target model types
    with tap members, which lacks DeepSeek-V4), a V4 target passes that list: the
    overlay's V4 route adds the tap members to the V4 target class (``v4_taps``)."""
    if kwargs.get("method") != "dspark":
        return wrapped(*args, **kwargs)
    spec = _check_stand_in_request(kwargs)
    target = kwargs.get("target_model_config")
    with taps_gate_passed(target if v4_taps_gate else None):
        result = wrapped(*args, **{**kwargs, "method": "dflash"})
    config, _, _ = split_receiver(instance, args)
    _mark_dspark_draft(config.draft_model_config.hf_config, spec)
    return result


# a listed type the V4 target is shown as while the gate runs: its closest relative
TAPS_GATE_STAND_IN = "deepseek_v3"


@contextlib.contextmanager
def taps_gate_passed(target_model_config: Any) -> Iterator[None]:
    """For the length of the block, a V4 target's text config says
    ``TAPS_GATE_STAND_IN`` as its model type: 0.20-0.21 check the type against a
    fixed list, and nothing else in the speculative config reads the target's type
    for dflash. Restored however the block ends."""
    if not _is_v4_target(target_model_config):
        yield
        return
    text_config = target_model_config.hf_text_config
    own = text_config.__dict__.get("model_type", _ABSENT)
    text_config.model_type = TAPS_GATE_STAND_IN
    try:
        yield
    finally:
        if own is _ABSENT:
            del text_config.model_type
        else:
            text_config.model_type = own


_ABSENT = object()


def _is_v4_target(target_model_config: Any) -> bool:
    text_config = getattr(target_model_config, "hf_text_config", None)
    return getattr(text_config, "model_type", None) == V4_MODEL_TYPE


# dspark speculative configs whose V4 target is hidden while VllmConfig validates its
# fields, by id (a pydantic config is unhashable), with the target to give back
_HIDDEN_TARGETS: dict[int, Any] = {}


def hide_v4_target_from_revalidation(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``VllmConfig.__init__`` (0.20-0.21, where the probe finds the tap-model list):
    pydantic runs a nested config's after-validators again when VllmConfig validates
    its fields, so SpeculativeConfig's list check meets the V4 target a second time,
    outside ``accept_dspark_as_dflash`` (0.20.2 on the H200 refused it so). While the
    fields are validated, a dspark config's V4 target is hidden: in that validator only
    the list check reads it. ``VllmConfig.__post_init__`` gets it back before it runs,
    and it is back however the call ends."""
    speculative_config = kwargs.get("speculative_config")
    target = getattr(speculative_config, "target_model_config", None)
    if not (is_dspark(speculative_config) and _is_v4_target(target)):
        return wrapped(*args, **kwargs)
    _HIDDEN_TARGETS[id(speculative_config)] = target
    speculative_config.target_model_config = None
    try:
        return wrapped(*args, **kwargs)
    finally:
        _give_target_back(speculative_config)


def target_back_before_post_init(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``VllmConfig.__post_init__``: the hidden target is back before vLLM's own
    checks and derivations read the speculative config."""
    config, _, _ = split_receiver(instance, args)
    _give_target_back(getattr(config, "speculative_config", None))
    return wrapped(*args, **kwargs)


def _give_target_back(speculative_config: Any) -> None:
    target = _HIDDEN_TARGETS.pop(id(speculative_config), None)
    if target is not None:
        speculative_config.target_model_config = target


def _check_stand_in_request(kwargs: dict) -> Any:
    """One line for a request the stand-in route cannot serve; returns the local
    draft's spec (None for a draft that is not a local folder)."""
    import vllm.envs as envs
    from vllm import __version__

    if not kwargs.get("model"):
        raise ValueError(
            f"speculative_config.model: method 'dspark' on vLLM {__version__} needs a DSpark "
            f"draft checkpoint ({DSPARK_ARCHITECTURE}), or for the stages inside a "
            "DeepSeek-V4 checkpoint, that checkpoint"
        )
    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise ValueError(
            f"VLLM_USE_V2_MODEL_RUNNER=1: vLLM {__version__}'s V2 model runner has no DSpark; "
            "method 'dspark' runs on the V1 runner (unset it or set it to 0)"
        )
    target = kwargs.get("target_model_config")
    spec = validate_draft_paths(kwargs["model"], getattr(target, "model", None))
    if spec is not None:
        # before vLLM's DFlash config sees it: without the overlay's V4 class it
        # would name a DFlash architecture no registry holds (H200, 0.24.0)
        check_for_v1(spec, kwargs["model"], kwargs.get("num_speculative_tokens"))
    return spec


def _mark_dspark_draft(hf_config: Any, spec: Any = None) -> None:
    """Check the draft is one the overlay's class runs, and mark it as DSpark. A
    DeepSeek-V4 checkpoint's stage count is in its weights and inference config, not
    its ``config.json``: the local spec's count goes onto the draft config for the
    overlay's V4 class."""
    from vllm_v4_patches.dspark import V4_STAND_IN_ARCHITECTURE

    architectures = list(getattr(hf_config, "architectures", None) or [])
    accepted = set(DSPARK_ARCHITECTURES) | {V4_STAND_IN_ARCHITECTURE}
    if not set(architectures) & accepted:
        raise ValueError(
            f"speculative_config.model: architectures={architectures} is not a DSpark draft "
            f"this vLLM can run; accepted: {DSPARK_ARCHITECTURE}"
        )
    expose_keys_to_dflash(hf_config)  # reads the spec: a malformed key fails in one line
    if spec is not None and spec.num_draft_layers and not getattr(hf_config, STAGES_KEY, None):
        setattr(hf_config, STAGES_KEY, spec.num_draft_layers)
    setattr(hf_config, DRAFT_METHOD_MARK, "dspark")


EXPOSED_MARK = "vllm_v4_exposed_dflash_keys"
STAGES_KEY = "n_mtp_layers"  # DeepSeek-V4's stage count (its inference config's key)


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
    from vllm_v4_patches.dspark.checkpoint import draft_spec

    spec = draft_spec(hf_config)
    values = {"target_layer_ids": list(spec.target_layer_ids), "mask_token_id": spec.mask_token_id}
    for key, value in values.items():
        if key not in dflash_config:
            dflash_config[key] = value
            added.append(key)
    hf_config.dflash_config = dflash_config
    setattr(hf_config, EXPOSED_MARK, tuple(added))
    return tuple(added)


def register_draft_class(
    registry_module: Any, architectures: tuple[str, ...], reference: str | None = None
) -> Any:
    """Make vLLM's registry resolve these architectures (the overlay's own name; on
    0.20-0.24 also the DeepSpec one and the name vLLM's dflash EAGLE config gives it)
    to the overlay's draft class (``reference``, ``module:Class``; the Qwen3 one by
    default); returns the undo."""
    from vllm_v4_patches.dspark.draft_model import MODEL_REFERENCE

    registry = registry_module.ModelRegistry
    previous = {arch: registry.models.get(arch) for arch in architectures}
    for arch in architectures:
        registry.register_model(arch, reference or MODEL_REFERENCE)

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
    validate_draft_checkpoint(config, runner="V1")
    return [feature for feature in unsupported if feature != UNSUPPORTED_ENTRY]


def validate_draft_checkpoint(vllm_config: Any, runner: str = "V2") -> tuple[str, ...]:
    """Check a dspark config's draft (once per draft config) for the ``runner`` that
    will draft it and expose its keys to vLLM's DFlash code; returns the keys the
    overlay added."""
    speculative = vllm_config.speculative_config
    draft = getattr(speculative, "draft_model_config", None)
    if draft is not None and hasattr(draft.hf_config, EXPOSED_MARK):
        return getattr(draft.hf_config, EXPOSED_MARK)
    spec = validate_draft_paths(speculative.model, vllm_config.model_config.model)
    if spec is not None:
        if runner == "V1":
            check_for_v1(spec, speculative.model, speculative.num_speculative_tokens)
        warn_past_block(speculative.num_speculative_tokens, spec.block_size, speculative.model)
    return expose_keys_to_dflash(draft.hf_config) if draft is not None else ()


def check_for_v1(spec: Any, draft: str, num_tokens: int | None) -> None:
    """Every refusal of a local draft the V1 drafter would serve, one line each:
    the fill-in layout, V4 stages without their route, V4 at another N, and V4
    weights that do not fit the config."""
    refuse_fill_in_layout_on_v1(spec.anchor_first, draft)
    refuse_in_checkpoint_draft_on_v1(spec.format, draft)
    refuse_other_v4_block_on_v1(spec.format, num_tokens, spec.block_size, draft)
    check_in_checkpoint_weights(spec, draft)


def refuse_fill_in_layout_on_v1(anchor_first: bool, draft: str) -> None:
    """The V1 drafter drafts anchor-first blocks (every one of the N slots a
    prediction). A draft exported with DFlash's fill-in block (the anchor a bonus
    token, 1 + N slots) would be served in the wrong layout and accept almost
    nothing, silently (upstream vLLM #56792); one line instead."""
    if anchor_first:
        return
    raise ValueError(
        f"speculative_config.model={draft}: its config.json declares the fill-in block "
        "layout (sample_from_anchor=false or dspark_bonus_anchor=true: the anchor is a "
        "bonus token, 1 + N slots); vllm_v4_patches' V1 drafter drafts anchor-first "
        "blocks only (sample_from_anchor true or absent), so it would accept almost no "
        "draft; vLLM >= 0.25's V2 runner serves the fill-in layout"
    )


V4_ON_V1_SETTING = "VLLM_V4_DSPARK_V4_ON_V1"
V4_ON_V1_CHOICES = ("off", "on")


def refuse_in_checkpoint_draft_on_v1(draft_format: str, draft: str) -> None:
    """A DeepSeek-V4 target's own DSpark stages go to the overlay's V4 drafter
    (``v4_proposer``, through vLLM's V4 draft class, or on 0.20-0.24 the overlay's
    own, ``v4_stages``) only when asked for: on the GPU it is proven lossless at N = 5
    only (which releases and cudagraph modes: ``docs/dspark.md`` section 13). Otherwise, and on a
    release with neither class, one line."""
    from vllm_v4_patches.dspark import checkpoint
    from vllm_v4_patches.toggles import read_choice

    if draft_format not in (checkpoint.FORMAT_DEEPSEEK_V4, checkpoint.FORMAT_DEEPSEEK_V41):
        return
    if draft_format == checkpoint.FORMAT_DEEPSEEK_V41:
        raise ValueError(
            f"speculative_config.model={draft}: DeepSeek-V4.1's DSpark stages run on "
            "vLLM's V2 model runner (unset VLLM_USE_V2_MODEL_RUNNER); vllm_v4_patches' "
            "V1 route is built for DeepSeek-V4's stages only"
        )

    route = v4_route()
    if route not in (V4_ROUTE_CLASS, V4_ROUTE_OVERLAY):
        from vllm import __version__

        from vllm_v4_patches.dspark import V4_DRAFT_MODULE

        raise ValueError(
            f"speculative_config.model={draft}: the DSpark stages inside a DeepSeek-V4 "
            f"checkpoint need vLLM's DeepSeek-V4 draft class ({V4_DRAFT_MODULE}, vLLM "
            ">= 0.25) or the V4 blocks the overlay builds its own from (vLLM 0.20-0.24); "
            f"vLLM {__version__} has neither, so vllm_v4_patches drafts only "
            "DeepSpec-format DSpark drafts here"
        )
    choice = read_choice(V4_ON_V1_SETTING, V4_ON_V1_CHOICES, "refusing the V1 route")
    if choice != "on" and route == V4_ROUTE_OVERLAY:
        from vllm import __version__

        raise ValueError(
            f"speculative_config.model={draft}: vLLM {__version__} has no DSpark of its "
            "own; vllm_v4_patches' draft class for the DSpark stages inside a "
            "DeepSeek-V4 checkpoint is off by default, shown lossless on a GPU at N = 5 "
            "on 0.20.2, 0.22.1 and 0.24.0, with CUDA graphs on 0.22.1 and 0.24.0 only "
            f"({V4_ON_V1_SETTING}=on serves it)"
        )
    if choice != "on":
        raise ValueError(
            f"speculative_config.model={draft}: the DSpark stages inside a DeepSeek-V4 "
            "checkpoint run on vLLM's V2 model runner (unset VLLM_USE_V2_MODEL_RUNNER); "
            "the overlay's V1 route for them is off by default, proven lossless on the GPU "
            f"in eager mode only ({V4_ON_V1_SETTING}=on serves it)"
        )


def refuse_other_v4_block_on_v1(
    draft_format: str, num_tokens: int | None, block_size: int, draft: str
) -> None:
    """The V1 route drafts a DeepSeek-V4 checkpoint's stages at N equal to their
    ``dspark_block_size`` only: that N passed the lossless matrix on the H200, while
    N = 7 (above the block) did not, and vLLM 0.25 takes N below the block, which
    upstream users report garbled. One line for any other N."""
    from vllm_v4_patches.dspark import checkpoint

    v4_formats = (checkpoint.FORMAT_DEEPSEEK_V4, checkpoint.FORMAT_DEEPSEEK_V41)
    if draft_format not in v4_formats or num_tokens is None or num_tokens == block_size:
        return
    raise ValueError(
        f"speculative_config.num_speculative_tokens={num_tokens}: vllm_v4_patches' V1 "
        f"route drafts the DSpark stages of {draft} at num_speculative_tokens="
        f"{block_size} only (their dspark_block_size), the one shown lossless there"
    )


def v4_route() -> str:
    """The probe's answer for the installed vLLM (``dspark.v4_draft_route``)."""
    from vllm_v4_patches.dspark import v4_draft_route
    from vllm_v4_patches.sources import InstalledSource

    return v4_draft_route(InstalledSource())


def warn_past_block(num_tokens: int | None, block_size: int, draft: str) -> bool:
    """One line where more tokens are drafted than the draft's block was trained for:
    verification keeps the output exact, but slots past the block draft from
    positions the draft never saw, so acceptance drops. Returns whether it warned."""
    if num_tokens is None or num_tokens <= block_size:
        return False
    import logging

    logging.getLogger("vllm_v4_patches").warning(
        "vllm_v4_patches: dspark: num_speculative_tokens=%d exceeds the draft's "
        "block_size=%d (%s/config.json); output stays exact, but slots past %d draft "
        "from positions the draft was not trained on (accepts 1..%d serve best)",
        num_tokens,
        block_size,
        draft,
        block_size,
        block_size,
    )
    return True


def validate_draft_paths(draft: str | None, target: str | None) -> Any:
    """A malformed local DSpark draft config fails here, in one line naming the key,
    rather than somewhere inside model loading; returns the local draft's
    ``DSparkDraftSpec`` (None for a draft that is not a local folder)."""
    import os

    from vllm_v4_patches.dspark import checkpoint

    if not (draft and os.path.isfile(os.path.join(draft, "config.json"))):
        return None
    has_target = target and os.path.isfile(os.path.join(target, "config.json"))
    spec = checkpoint.load_draft_spec(draft, target_path=target if has_target else None)
    if spec.format == checkpoint.FORMAT_DEEPSPEC_QWEN3:
        checkpoint.check_deepspec_weights(draft)
    return spec


def check_in_checkpoint_weights(spec: Any, draft: str) -> None:
    """A DeepSeek-V4 checkpoint's stages that the overlay's V1 drafter will serve,
    checked from their safetensors headers. Where vLLM's V2 runner serves them, its
    own loader judges the checkpoint: the overlay refuses nothing there."""
    from vllm_v4_patches.dspark import checkpoint

    if spec.format != checkpoint.FORMAT_DEEPSPEC_QWEN3:
        checkpoint.check_v4_weights(draft, spec)


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
            validate_draft_checkpoint(config, runner="V1")
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
