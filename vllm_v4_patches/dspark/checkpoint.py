"""DSpark draft checkpoints: parse both config formats into one ``DSparkDraftSpec``.

Two formats exist (``docs/dspark.md`` section 8):

* **DeepSpec Qwen3** (``deepseek-ai/dspark_qwen3_*``): a standalone HF model with
  ``architectures: ["Qwen3DSparkModel"]``, the ordinary Qwen3 keys describing the
  *draft* (``num_hidden_layers`` = draft layers) and the DSpark keys ``block_size``,
  ``mask_token_id``, ``target_layer_ids``, ``num_target_layers`` (the target's layer
  count), ``num_anchors`` (training only), ``markov_rank``, ``markov_head_type``,
  ``enable_confidence_head``, ``confidence_head_with_markov``. Weights carry no
  prefix (``layers.*``, ``fc``, ``hidden_norm``, ``norm``, ``markov_head.*``, ...).
* **DeepSeek-V4** (-Flash-DSpark, -0731, V4-Pro, V4.1): the draft lives inside the
  target checkpoint. The target's ``config.json`` has ``dspark_block_size``,
  ``dspark_markov_rank``, ``dspark_target_layer_ids``, ``dspark_noise_token_id``
  (optionally ``enable_confidence_head``); the stage count is ``n_mtp_layers`` of
  ``inference/config.json`` or the number of ``mtp.{i}.`` weight prefixes
  (``num_nextn_predict_layers`` is *not* the stage count). The V4 layers themselves
  are out of scope here; :func:`group_dspark_v4_weights` only maps and checks names.

Defaults follow what loaders do when an optional key is absent: vLLM treats a
missing ``enable_confidence_head`` as false for Qwen3 drafts and as true for V4,
and a missing ``confidence_head_with_markov`` as false. DeepSpec itself always
writes ``markov_head_type`` when ``markov_rank > 0``, so it is required then.

Every malformed config raises one ``ValueError`` whose one-line message names the
key and what is accepted. No torch or vLLM import: this module is read by tools
and tests that must not pay for (or depend on) either.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEEPSPEC_QWEN3_ARCHITECTURE = "Qwen3DSparkModel"
FORMAT_DEEPSPEC_QWEN3 = "deepspec-qwen3"
FORMAT_DEEPSEEK_V4 = "deepseek-v4"
FORMAT_DEEPSEEK_V41 = "deepseek-v4.1"
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
V4_WEIGHT_PREFIX = "mtp."

# The keys serving reads from a loaded draft config, by their DeepSpec (top-level)
# name, with the name a DeepSeek-V4 config gives each
V4_KEY_NAMES = {
    "target_layer_ids": "dspark_target_layer_ids",
    "mask_token_id": "dspark_noise_token_id",
}

_CONFIG_ERROR = "dspark draft config"
_WEIGHTS_ERROR = "dspark draft weights"
_REPR_LIMIT = 60  # keeps a huge or odd value from turning the message into a dump


@dataclass(frozen=True)
class DSparkDraftSpec:
    """What a serving loop needs to know about a DSpark draft, whatever its format.

    ``mask_token_id`` is the id embedded at the non-anchor block slots (DeepSpec's
    ``mask_token_id``, DSV4's ``dspark_noise_token_id``). ``target_layer_ids`` keep
    the checkpoint's own semantics (DeepSpec / V4: output of that layer, ``-1`` the
    embedding output; V4.1: attention input), see ``docs/dspark.md`` section 1.3.
    ``num_draft_layers`` is ``None`` only for a V4 config read without
    ``n_mtp_layers`` or weight names, where the stage count is not known yet.
    """

    format: str
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    markov_head_type: str | None  # None when markov_rank == 0 (no sequential stage)
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    hidden_size: int
    num_draft_layers: int | None
    vocab_size: int
    weight_prefix: str
    num_target_layers: int | None = None


class _ConfigReader:
    """Typed access to one config mapping; every failure is one ValueError line."""

    def __init__(self, config: Mapping[str, Any], what: str = _CONFIG_ERROR) -> None:
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
            raise self.fail(f"{key}={_short(value)} is not {accepted}")
        if value < minimum or (maximum is not None and value > maximum):
            raise self.fail(f"{key}={_short(value)} is not {accepted}")
        return value

    def boolean(self, key: str, *, default: bool) -> bool:
        if not self.has(key):
            return default
        value = self.config[key]
        if not isinstance(value, bool):
            raise self.fail(f"{key}={_short(value)} is not a boolean (true or false)")
        return value

    def layer_ids(self, key: str, *, lowest: int, num_target_layers: int | None) -> tuple[int, ...]:
        highest = None if num_target_layers is None else num_target_layers - 1
        accepted = "a non-empty, strictly increasing list of integers"
        if lowest == -1:
            accepted += " (-1 = embedding output)"
        value = self.require(key, accepted)
        if not isinstance(value, (list, tuple)) or not value:
            raise self.fail(f"{key}={_short(value)} is not {accepted}")
        for layer_id in value:
            if isinstance(layer_id, bool) or not isinstance(layer_id, int):
                raise self.fail(f"{key}={_short(value)} has {_short(layer_id)}; not {accepted}")
        if any(later <= earlier for earlier, later in zip(value[:-1], value[1:], strict=True)):
            raise self.fail(f"{key}={_short(value)} is not {accepted}")
        for layer_id in value:
            if layer_id < lowest or (highest is not None and layer_id > highest):
                allowed = _layer_range_text(lowest, highest)
                where = (
                    "" if num_target_layers is None else f" (target has {num_target_layers} layers)"
                )
                raise self.fail(f"{key}={_short(value)} has {layer_id} outside {allowed}{where}")
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
            f"architectures={_short(architectures)} does not contain "
            f"{DEEPSPEC_QWEN3_ARCHITECTURE}"
        )
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
                f"markov_head_type={_short(markov_head_type)} is not one of "
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
        inference = _ConfigReader(inference_config, f"{_CONFIG_ERROR} (inference/config.json)")
        for key, value in inference.config.items():
            if not (key.startswith("dspark_") or key == "n_mtp_layers") or value is None:
                continue
            if reader.has(key) and config[key] != value:
                raise reader.fail(
                    f"{key}={_short(config[key])} in config.json disagrees with "
                    f"{_short(value)} in inference/config.json"
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


def draft_key(hf_config: Any, key: str) -> Any:
    """A key of ``V4_KEY_NAMES`` from a loaded draft config (vLLM's ``hf_config``)
    under whichever format's name it carries, or None."""
    value = getattr(hf_config, key, None)
    return getattr(hf_config, V4_KEY_NAMES[key], None) if value is None else value


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
            target_layers = _ConfigReader(target_config, f"{_CONFIG_ERROR} (target)").integer(
                "num_hidden_layers", minimum=1
            )
        spec = parse_deepspec_qwen3_config(config, target_num_layers=target_layers)
        if target_config is not None:
            _shares_target_widths(reader, config, target_config)
        return spec
    if any(str(key).startswith("dspark_") for key in config):
        return parse_deepseek_v4_config(config, inference_config=inference_config)
    raise reader.fail(
        f"architectures={_short(architectures)} is not {DEEPSPEC_QWEN3_ARCHITECTURE} and no "
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
        raise ValueError(f"{_CONFIG_ERROR}: {path} is not valid JSON ({error.msg})") from None


def deepspec_qwen3_weight_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a DeepSpec Qwen3 draft with this config holds, with its shape.

    ``embed_tokens`` / ``lm_head`` are copies of the target's (DeepSpec saves
    them; vLLM aliases the target's when they are absent, so they are optional
    for loading). ``confidence_head.proj`` has a bias in DeepSpec.
    """
    spec = parse_deepspec_qwen3_config(config)
    reader = _ConfigReader(config)
    hidden = spec.hidden_size
    num_heads = reader.integer("num_attention_heads", minimum=1)
    num_kv_heads = reader.integer("num_key_value_heads", minimum=1, default=num_heads)
    head_dim = reader.integer("head_dim", minimum=1, default=hidden // num_heads)
    intermediate = reader.integer("intermediate_size", minimum=1)
    target_hidden = reader.integer("target_hidden_size", minimum=1, default=hidden)
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (spec.vocab_size, hidden),
        "lm_head.weight": (spec.vocab_size, hidden),
        "fc.weight": (hidden, target_hidden * len(spec.target_layer_ids)),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for layer in range(spec.num_draft_layers or 0):
        prefix = f"layers.{layer}."
        shapes.update(
            {
                prefix + "input_layernorm.weight": (hidden,),
                prefix + "post_attention_layernorm.weight": (hidden,),
                prefix + "self_attn.q_proj.weight": (num_heads * head_dim, hidden),
                prefix + "self_attn.k_proj.weight": (num_kv_heads * head_dim, hidden),
                prefix + "self_attn.v_proj.weight": (num_kv_heads * head_dim, hidden),
                prefix + "self_attn.o_proj.weight": (hidden, num_heads * head_dim),
                prefix + "self_attn.q_norm.weight": (head_dim,),
                prefix + "self_attn.k_norm.weight": (head_dim,),
                prefix + "mlp.gate_proj.weight": (intermediate, hidden),
                prefix + "mlp.up_proj.weight": (intermediate, hidden),
                prefix + "mlp.down_proj.weight": (hidden, intermediate),
            }
        )
    if spec.markov_rank > 0:
        shapes["markov_head.markov_w1.weight"] = (spec.vocab_size, spec.markov_rank)
        shapes["markov_head.markov_w2.weight"] = (spec.vocab_size, spec.markov_rank)
        if spec.markov_head_type == "gated":
            shapes["markov_head.gate_proj.weight"] = (spec.markov_rank, hidden + spec.markov_rank)
            shapes["markov_head.gate_proj.bias"] = (spec.markov_rank,)
        elif spec.markov_head_type == "rnn":
            joint_in = 2 * spec.markov_rank + hidden
            shapes["markov_head.joint_proj.weight"] = (3 * spec.markov_rank, joint_in)
            shapes["markov_head.joint_proj.bias"] = (3 * spec.markov_rank,)
    if spec.enable_confidence_head:
        width = hidden + (spec.markov_rank if spec.confidence_head_with_markov else 0)
        shapes["confidence_head.proj.weight"] = (1, width)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


_WEIGHTS_ERROR = "dspark draft weights"
_SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")


def check_deepspec_weights(path: str | os.PathLike[str]) -> None:
    """The draft's safetensors files hold every tensor its ``config.json`` asks for,
    at its shape, and are whole: read from the files' headers, nothing is loaded.
    One line naming the file or the tensor otherwise. ``embed_tokens`` and
    ``lm_head`` may be absent (vLLM shares the target's)."""
    import glob

    folder = os.fspath(path)
    config = _read_json(os.path.join(folder, "config.json"))
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"{_WEIGHTS_ERROR}: no *.safetensors file in {folder}")
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        for name, shape in _safetensors_shapes(file).items():
            found[name.removeprefix("model.")] = (shape, file)
    for name, shape in deepspec_qwen3_weight_shapes(config).items():
        if name not in found:
            if name in _SHARED_WITH_TARGET:
                continue
            raise ValueError(
                f"{_WEIGHTS_ERROR}: {folder} has no tensor {name}, which its config.json "
                "asks for"
            )
        stored, file = found[name]
        if stored != shape:
            raise ValueError(
                f"{_WEIGHTS_ERROR}: {name} in {file} has shape {stored}; its config.json "
                f"implies {shape}"
            )


def _safetensors_shapes(file: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header, after checking that the file
    holds every byte the header points at."""
    import struct

    size = os.path.getsize(file)
    try:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > size - 8:
                raise ValueError("the header runs past the end of the file")
            header = json.loads(handle.read(length))
        ends = [entry["data_offsets"][1] for k, entry in header.items() if k != "__metadata__"]
        if 8 + length + max(ends, default=0) > size:
            raise ValueError("the file is shorter than its tensors (truncated?)")
        return {k: tuple(e["shape"]) for k, e in header.items() if k != "__metadata__"}
    except (ValueError, KeyError, TypeError, struct.error) as error:
        raise ValueError(
            f"{_WEIGHTS_ERROR}: {file} is not a readable safetensors file ({error})"
        ) from None


# --- DeepSeek-V4 ``mtp.{stage}.*`` weight names -------------------------------------

_V4_NAME = re.compile(r"^mtp\.(\d+)\.(.+)$")
# Roles of the non-layer tensors. Matched on the whole stage-relative path, never on
# a suffix: ``markov_head.markov_w1`` must not be taken for an FFN ``w1`` shard.
_V4_HEAD_ROLES: tuple[tuple[str, str], ...] = (
    ("main_proj.", "main_proj"),
    ("main_norm.", "main_norm"),
    ("norm.", "norm"),
    ("hc_head_fn", "hc_head"),
    ("hc_head_base", "hc_head"),
    ("hc_head_scale", "hc_head"),
    ("markov_head.markov_w1.", "markov_w1"),
    ("markov_head.embed.", "markov_w1"),  # V4.1 name
    ("markov_head.markov_w2.", "markov_w2"),
    ("markov_head.head.", "markov_w2"),  # V4.1 name
    ("confidence_head.", "confidence_head"),
)
_FIRST_STAGE_ROLES = ("main_proj", "main_norm")
_LAST_STAGE_ROLES = ("norm", "hc_head", "markov_w1", "markov_w2", "confidence_head")
_REQUIRED_ROLES = {
    "main_proj": "context projection",
    "main_norm": "context norm",
    "norm": "final norm",
    "markov_w1": "Markov head W1",
    "markov_w2": "Markov head W2",
}


@dataclass(frozen=True)
class DSparkV4WeightLayout:
    """The ``mtp.*`` tensors of a DSV4 checkpoint, grouped.

    ``stage_layers[s]`` lists stage ``s``'s decoder-block tensors (attention, FFN,
    mHC); ``heads`` maps a role (``main_proj``, ``main_norm``, ``norm``,
    ``hc_head``, ``markov_w1``, ``markov_w2``, ``confidence_head``) to its full
    tensor names. A missing confidence head means the head is disabled.
    """

    num_stages: int
    stage_layers: tuple[tuple[str, ...], ...]
    heads: Mapping[str, tuple[str, ...]]

    @property
    def has_confidence_head(self) -> bool:
        return bool(self.heads.get("confidence_head"))

    @property
    def markov_w1(self) -> str:
        return _weight_tensor(self.heads["markov_w1"])

    @property
    def markov_w2(self) -> str:
        return _weight_tensor(self.heads["markov_w2"])


def dspark_v4_weight_role(name: str) -> tuple[int, str, str] | None:
    """``(stage, role, rest)`` for an ``mtp.{stage}.rest`` name; ``None`` otherwise.

    ``role`` is a head role (see :class:`DSparkV4WeightLayout`) or ``"layer"``.
    """
    match = _V4_NAME.match(name)
    if match is None:
        return None
    stage, rest = int(match.group(1)), match.group(2)
    for prefix, role in _V4_HEAD_ROLES:
        if rest.startswith(prefix):
            return stage, role, rest
    return stage, "layer", rest


def group_dspark_v4_weights(
    names: Iterable[str],
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    spec: DSparkDraftSpec | None = None,
) -> DSparkV4WeightLayout:
    """Group and check the ``mtp.*`` names of a DSV4 checkpoint (others are ignored).

    Checks: stages numbered ``0..N-1`` without gaps; ``main_proj`` / ``main_norm``
    in stage 0 only; final norm, ``hc_head``, Markov and confidence heads in the last
    stage only; the required heads present. With ``shapes`` and ``spec``, the
    Markov and confidence tensors must be ``[V, r]`` and ``[1, H + r]``.
    """
    per_stage: dict[int, list[str]] = {}
    heads: dict[str, list[str]] = {}
    placed: list[tuple[str, int, str]] = []
    for name in names:
        parsed = dspark_v4_weight_role(name)
        if parsed is None:
            continue
        stage, role, _ = parsed
        per_stage.setdefault(stage, [])
        if role == "layer":
            per_stage[stage].append(name)
        else:
            heads.setdefault(role, []).append(name)
            placed.append((name, stage, role))
    if not per_stage:
        raise ValueError(f"{_WEIGHTS_ERROR}: no mtp.{{stage}}.* tensors found")
    stages = sorted(per_stage)
    if stages != list(range(len(stages))):
        raise ValueError(
            f"{_WEIGHTS_ERROR}: mtp.* stages are {', '.join(map(str, stages))}; "
            "expected 0..N-1 without gaps"
        )
    last = stages[-1]
    for name, stage, role in placed:
        if role in _FIRST_STAGE_ROLES and stage != 0:
            raise ValueError(f"{_WEIGHTS_ERROR}: {name} ({role}) must be in stage 0")
        if role in _LAST_STAGE_ROLES and stage != last:
            raise ValueError(f"{_WEIGHTS_ERROR}: {name} ({role}) must be in the last stage {last}")
    for role, what in _REQUIRED_ROLES.items():
        if role not in heads:
            stage = 0 if role in _FIRST_STAGE_ROLES else last
            raise ValueError(f"{_WEIGHTS_ERROR}: missing mtp.{stage}.{role}* ({what})")
    layout = DSparkV4WeightLayout(
        num_stages=len(stages),
        stage_layers=tuple(tuple(sorted(per_stage[stage])) for stage in stages),
        heads={role: tuple(sorted(found)) for role, found in heads.items()},
    )
    if spec is not None and spec.num_draft_layers is not None:
        if spec.num_draft_layers != layout.num_stages:
            raise ValueError(
                f"{_WEIGHTS_ERROR}: {layout.num_stages} mtp.* stages but the config says "
                f"n_mtp_layers={spec.num_draft_layers}"
            )
    if shapes is not None and spec is not None:
        _check_v4_head_shapes(layout, shapes, spec)
    return layout


def _check_v4_head_shapes(
    layout: DSparkV4WeightLayout, shapes: Mapping[str, Sequence[int]], spec: DSparkDraftSpec
) -> None:
    expected = {
        layout.markov_w1: (spec.vocab_size, spec.markov_rank),
        layout.markov_w2: (spec.vocab_size, spec.markov_rank),
    }
    if layout.has_confidence_head:
        expected[_weight_tensor(layout.heads["confidence_head"])] = (
            1,
            spec.hidden_size + spec.markov_rank,
        )
    for name, shape in expected.items():
        if name in shapes and tuple(shapes[name]) != shape:
            raise ValueError(
                f"{_WEIGHTS_ERROR}: {name} has shape {list(shapes[name])}; expected {list(shape)}"
            )


def _weight_tensor(names: Sequence[str]) -> str:
    """The ``.weight`` tensor among a head's names (quantised heads add ``.scale``)."""
    for name in names:
        if name.endswith(".weight"):
            return name
    return names[0]


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


def _short(value: Any) -> str:
    """A one-line, bounded repr for error messages."""
    text = repr(value).replace("\n", " ")
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."
