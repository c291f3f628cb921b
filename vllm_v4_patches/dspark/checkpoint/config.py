"""Parse a DSpark draft's config, in either format, into one ``DSparkDraftSpec``;
and the spec of a draft config vLLM has already loaded (``draft_spec``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from vllm_v4_patches.dspark.checkpoint.spec import (
    CONFIG_ERROR,
    DEEPSPEC_QWEN3_ARCHITECTURE,
    FORMAT_DEEPSEEK_V4,
    FORMAT_DEEPSEEK_V41,
    FORMAT_DEEPSPEC_QWEN3,
    MARKOV_HEAD_TYPES,
    V4_KEY_NAMES,
    V4_WEIGHT_PREFIX,
    DSparkDraftSpec,
    short,
)
from vllm_v4_patches.dspark.checkpoint.v4_weights import group_dspark_v4_weights


class _ConfigReader:
    """Typed access to one config mapping; every failure is one ValueError line."""

    def __init__(self, config: Mapping[str, Any], what: str = CONFIG_ERROR) -> None:
        if not isinstance(config, Mapping):
            raise ValueError(f"{what}: expected a JSON object, got {type(config).__name__}")
        self.config = config
        self.what = what

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.what}: {message}")

    def has(self, key: str) -> bool:
        return self.config.get(key) is not None

    def require(self, key: str, accepted: str) -> Any:
        if not self.has(key):
            raise self.fail(f"missing required key {key!r} ({accepted})")
        return self.config[key]

    def integer(
        self,
        key: str,
        *,
        minimum: int,
        maximum: int | None = None,
        default: int | None = None,
    ) -> int:
        accepted = _int_range_text(minimum, maximum)
        if not self.has(key):
            if default is not None:
                return default
            raise self.fail(f"missing required key {key!r} ({accepted})")
        value = self.config[key]
        # bool is an int subclass; True as a block size is a config bug, not 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{key}={short(value)} is not {accepted}")
        if value < minimum or (maximum is not None and value > maximum):
            raise self.fail(f"{key}={short(value)} is not {accepted}")
        return value

    def boolean(self, key: str, *, default: bool) -> bool:
        if not self.has(key):
            return default
        value = self.config[key]
        if not isinstance(value, bool):
            raise self.fail(f"{key}={short(value)} is not a boolean (true or false)")
        return value

    def layer_ids(self, key: str, *, lowest: int, num_target_layers: int | None) -> tuple[int, ...]:
        highest = None if num_target_layers is None else num_target_layers - 1
        accepted = "a non-empty, strictly increasing list of integers"
        if lowest == -1:
            accepted += " (-1 = embedding output)"
        value = self.require(key, accepted)
        if not isinstance(value, (list, tuple)) or not value:
            raise self.fail(f"{key}={short(value)} is not {accepted}")
        for layer_id in value:
            if isinstance(layer_id, bool) or not isinstance(layer_id, int):
                raise self.fail(f"{key}={short(value)} has {short(layer_id)}; not {accepted}")
        if any(later <= earlier for earlier, later in zip(value[:-1], value[1:], strict=True)):
            raise self.fail(f"{key}={short(value)} is not {accepted}")
        for layer_id in value:
            if layer_id < lowest or (highest is not None and layer_id > highest):
                allowed = _layer_range_text(lowest, highest)
                where = (
                    "" if num_target_layers is None else f" (target has {num_target_layers} layers)"
                )
                raise self.fail(f"{key}={short(value)} has {layer_id} outside {allowed}{where}")
        return tuple(value)


def parse_deepspec_qwen3_config(
    config: Mapping[str, Any],
    *,
    target_num_layers: int | None = None,
) -> DSparkDraftSpec:
    """Parse a DeepSpec ``Qwen3DSparkModel`` draft ``config.json``.

    ``target_num_layers`` (the target's ``num_hidden_layers``) bounds
    ``target_layer_ids``; without it the draft's own ``num_target_layers`` is used.
    """
    reader = _ConfigReader(config)
    architectures = reader.require(
        "architectures", f"a list containing {DEEPSPEC_QWEN3_ARCHITECTURE}"
    )
    if not isinstance(architectures, (list, tuple)) or (
        DEEPSPEC_QWEN3_ARCHITECTURE not in architectures
    ):
        raise reader.fail(
            f"architectures={short(architectures)} does not contain "
            f"{DEEPSPEC_QWEN3_ARCHITECTURE}"
        )
    return _parse_deepspec_keys(reader, target_num_layers)


def _parse_deepspec_keys(reader: _ConfigReader, target_num_layers: int | None) -> DSparkDraftSpec:
    hidden_size = reader.integer("hidden_size", minimum=1)
    vocab_size = reader.integer("vocab_size", minimum=1)
    num_draft_layers = reader.integer("num_hidden_layers", minimum=1)
    declared_target_layers = (
        reader.integer("num_target_layers", minimum=1) if reader.has("num_target_layers") else None
    )
    if (
        target_num_layers is not None
        and declared_target_layers is not None
        and target_num_layers != declared_target_layers
    ):
        raise reader.fail(
            f"num_target_layers={declared_target_layers} does not match the target's "
            f"num_hidden_layers={target_num_layers}"
        )
    num_target_layers = (
        target_num_layers if target_num_layers is not None else declared_target_layers
    )
    block_size = reader.integer("block_size", minimum=1)
    mask_token_id = reader.integer("mask_token_id", minimum=0, maximum=vocab_size - 1)
    target_layer_ids = reader.layer_ids(
        "target_layer_ids", lowest=-1, num_target_layers=num_target_layers
    )
    markov_rank = reader.integer("markov_rank", minimum=0)
    markov_head_type = None
    if markov_rank > 0:
        markov_head_type = reader.require(
            "markov_head_type", f"one of {', '.join(MARKOV_HEAD_TYPES)} when markov_rank > 0"
        )
        if markov_head_type not in MARKOV_HEAD_TYPES:
            raise reader.fail(
                f"markov_head_type={short(markov_head_type)} is not one of "
                f"{', '.join(MARKOV_HEAD_TYPES)}"
            )
    enable_confidence_head = reader.boolean("enable_confidence_head", default=False)
    with_markov = enable_confidence_head and reader.boolean(
        "confidence_head_with_markov", default=False
    )
    if with_markov and markov_rank == 0:
        raise reader.fail(
            "confidence_head_with_markov=true needs markov_rank >= 1 (it reads the Markov "
            "embedding); got markov_rank=0"
        )
    return DSparkDraftSpec(
        anchor_first=anchor_layout(reader),
        format=FORMAT_DEEPSPEC_QWEN3,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=target_layer_ids,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        enable_confidence_head=enable_confidence_head,
        confidence_head_with_markov=with_markov,
        hidden_size=hidden_size,
        num_draft_layers=num_draft_layers,
        vocab_size=vocab_size,
        weight_prefix="",
        num_target_layers=num_target_layers,
    )


def parse_deepseek_v4_config(
    config: Mapping[str, Any],
    *,
    inference_config: Mapping[str, Any] | None = None,
    weight_names: Iterable[str] | None = None,
) -> DSparkDraftSpec:
    """Parse the DSpark keys of a DeepSeek-V4 target ``config.json``.

    ``inference_config`` is ``inference/config.json`` when present: some
    checkpoints keep ``n_mtp_layers`` (and sometimes the ``dspark_*`` keys) only
    there, so both are read and must agree. ``weight_names`` lets the stage count
    come from the ``mtp.{i}.`` prefixes when no config states it.
    """
    reader = _ConfigReader(config)
    merged = dict(config)
    if inference_config is not None:
        inference = _ConfigReader(inference_config, f"{CONFIG_ERROR} (inference/config.json)")
        for key, value in inference.config.items():
            if not (key.startswith("dspark_") or key == "n_mtp_layers") or value is None:
                continue
            if reader.has(key) and config[key] != value:
                raise reader.fail(
                    f"{key}={short(config[key])} in config.json disagrees with "
                    f"{short(value)} in inference/config.json"
                )
            merged[key] = value
        reader = _ConfigReader(merged)
    hidden_size = reader.integer("hidden_size", minimum=1)
    vocab_size = reader.integer("vocab_size", minimum=1)
    num_target_layers = reader.integer("num_hidden_layers", minimum=1)
    block_size = reader.integer("dspark_block_size", minimum=1)
    markov_rank = reader.integer("dspark_markov_rank", minimum=1)
    noise_token_id = reader.integer(
        V4_KEY_NAMES["mask_token_id"], minimum=0, maximum=vocab_size - 1
    )
    # DSV4 taps are capture-after (V4) or attention-input (V4.1) indices of real
    # layers; there is no embedding-output tap in this format.
    target_layer_ids = reader.layer_ids(
        V4_KEY_NAMES["target_layer_ids"], lowest=0, num_target_layers=num_target_layers
    )
    enable_confidence_head = reader.boolean("enable_confidence_head", default=True)
    num_stages = reader.integer("n_mtp_layers", minimum=1) if reader.has("n_mtp_layers") else None
    if weight_names is not None:
        counted = group_dspark_v4_weights(weight_names).num_stages
        if num_stages is not None and counted != num_stages:
            raise reader.fail(
                f"n_mtp_layers={num_stages} but the checkpoint has {counted} mtp.* stages"
            )
        num_stages = counted
    is_v41 = merged.get("model_type") == "deepseek_v41"
    return DSparkDraftSpec(
        anchor_first=anchor_layout(reader),
        format=FORMAT_DEEPSEEK_V41 if is_v41 else FORMAT_DEEPSEEK_V4,
        block_size=block_size,
        mask_token_id=noise_token_id,
        target_layer_ids=target_layer_ids,
        markov_rank=markov_rank,
        markov_head_type="vanilla",  # the only Markov head DSV4 ships
        enable_confidence_head=enable_confidence_head,
        confidence_head_with_markov=enable_confidence_head,  # proj is [1, H + r]
        hidden_size=hidden_size,
        num_draft_layers=num_stages,
        vocab_size=vocab_size,
        weight_prefix=V4_WEIGHT_PREFIX,
        num_target_layers=num_target_layers,
    )


def anchor_layout(reader: _ConfigReader) -> bool:
    """Whether the draft's block is anchor-first, from the keys exporters write:
    speculators' ``sample_from_anchor`` (top level or in ``dflash_config``; false is
    the fill-in layout) and vLLM's ``dspark_bonus_anchor`` (true is fill-in). A
    config with neither is anchor-first, as DeepSpec and DeepSeek-V4 export."""
    nested = reader.config.get("dflash_config")
    if isinstance(nested, dict) and not _ConfigReader(nested).boolean(
        "sample_from_anchor", default=True
    ):
        return False
    if not reader.boolean("sample_from_anchor", default=True):
        return False
    return not reader.boolean("dspark_bonus_anchor", default=False)


def draft_spec(hf_config: Any) -> DSparkDraftSpec:
    """The spec of a draft config vLLM has loaded (its ``hf_config``), from its keys.

    The architecture is not read: by the time serving asks, vLLM (0.20-0.24, which
    loads the draft as a DFlash config) or the overlay (choosing its own draft class)
    may have renamed it. A config with ``dspark_*`` keys is DeepSeek-V4's; any other
    is read as a DeepSpec draft. A malformed key raises one ``ValueError`` line.
    """
    to_dict = getattr(hf_config, "to_dict", None)
    keys = to_dict() if callable(to_dict) else dict(vars(hf_config))
    if any(str(key).startswith("dspark_") for key in keys):
        return parse_deepseek_v4_config(keys)
    return _parse_deepspec_keys(_ConfigReader(keys), target_num_layers=None)


def parse_draft_config(
    config: Mapping[str, Any],
    *,
    target_config: Mapping[str, Any] | None = None,
    inference_config: Mapping[str, Any] | None = None,
) -> DSparkDraftSpec:
    """Dispatch on the format: a ``Qwen3DSparkModel`` draft or V4 ``dspark_*`` keys."""
    reader = _ConfigReader(config)
    architectures = config.get("architectures") or []
    if isinstance(architectures, (list, tuple)) and DEEPSPEC_QWEN3_ARCHITECTURE in architectures:
        target_layers = None
        if target_config is not None:
            target_layers = _ConfigReader(target_config, f"{CONFIG_ERROR} (target)").integer(
                "num_hidden_layers", minimum=1
            )
        spec = parse_deepspec_qwen3_config(config, target_num_layers=target_layers)
        if target_config is not None:
            _shares_target_widths(reader, config, target_config)
        return spec
    if any(str(key).startswith("dspark_") for key in config):
        return parse_deepseek_v4_config(config, inference_config=inference_config)
    raise reader.fail(
        f"architectures={short(architectures)} is not {DEEPSPEC_QWEN3_ARCHITECTURE} and no "
        "dspark_block_size key (DeepSeek-V4 format) is present"
    )


def _shares_target_widths(
    reader: _ConfigReader, config: Mapping[str, Any], target_config: Mapping[str, Any]
) -> None:
    """A DeepSpec draft reads the target's hidden states and shares its embedding and
    LM head, so its vocabulary and hidden size are the target's."""
    for key in ("vocab_size", "hidden_size"):
        mine, theirs = config.get(key), target_config.get(key)
        if theirs is not None and mine != theirs:
            raise reader.fail(f"{key}={mine} does not match the target's {key}={theirs}")


def load_draft_spec(
    path: str | os.PathLike[str],
    *,
    target_path: str | os.PathLike[str] | None = None,
) -> DSparkDraftSpec:
    """Read ``config.json`` (and ``inference/config.json`` if any) from a checkpoint dir."""
    config = _read_json(os.path.join(path, "config.json"))
    inference_path = os.path.join(path, "inference", "config.json")
    inference = _read_json(inference_path) if os.path.exists(inference_path) else None
    target = None if target_path is None else _read_json(os.path.join(target_path, "config.json"))
    return parse_draft_config(config, target_config=target, inference_config=inference)


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise ValueError(f"{CONFIG_ERROR}: {path} is not valid JSON ({error.msg})") from None


def _int_range_text(minimum: int, maximum: int | None) -> str:
    if maximum is None:
        return f"an integer >= {minimum}"
    return f"an integer in {minimum}..{maximum}"


def _layer_range_text(lowest: int, highest: int | None) -> str:
    if highest is None:
        return f">= {lowest}"
    if lowest == -1:
        return f"-1 or 0..{highest}"
    return f"{lowest}..{highest}"
