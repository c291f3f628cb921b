"""DeepSeek-V4's in-checkpoint draft: the ``mtp.{stage}.*`` weight names, grouped by
stage and role and checked. The V4 layers themselves are not served here."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_v4_patches.dspark.checkpoint.spec import V4_KEY_NAMES, WEIGHTS_ERROR, DSparkDraftSpec

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
        raise ValueError(f"{WEIGHTS_ERROR}: no mtp.{{stage}}.* tensors found")
    stages = sorted(per_stage)
    if stages != list(range(len(stages))):
        raise ValueError(
            f"{WEIGHTS_ERROR}: mtp.* stages are {', '.join(map(str, stages))}; "
            "expected 0..N-1 without gaps"
        )
    last = stages[-1]
    for name, stage, role in placed:
        if role in _FIRST_STAGE_ROLES and stage != 0:
            raise ValueError(f"{WEIGHTS_ERROR}: {name} ({role}) must be in stage 0")
        if role in _LAST_STAGE_ROLES and stage != last:
            raise ValueError(f"{WEIGHTS_ERROR}: {name} ({role}) must be in the last stage {last}")
    for role, what in _REQUIRED_ROLES.items():
        if role not in heads:
            stage = 0 if role in _FIRST_STAGE_ROLES else last
            raise ValueError(f"{WEIGHTS_ERROR}: missing mtp.{stage}.{role}* ({what})")
    layout = DSparkV4WeightLayout(
        num_stages=len(stages),
        stage_layers=tuple(tuple(sorted(per_stage[stage])) for stage in stages),
        heads={role: tuple(sorted(found)) for role, found in heads.items()},
    )
    if spec is not None and spec.num_draft_layers is not None:
        if spec.num_draft_layers != layout.num_stages:
            raise ValueError(
                f"{WEIGHTS_ERROR}: {layout.num_stages} mtp.* stages but the config says "
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
                f"{WEIGHTS_ERROR}: {name} has shape {list(shapes[name])}; expected {list(shape)}"
            )


def _weight_tensor(names: Sequence[str]) -> str:
    """The ``.weight`` tensor among a head's names (quantised heads add ``.scale``)."""
    for name in names:
        if name.endswith(".weight"):
            return name
    return names[0]


# quantised tensors and their scales: fp8 e4m3 linears carry one UE8M0 scale per
# 128x128 block, MXFP4 experts (two codes per I8 byte) one E8M0 scale per 32 inputs
_FP8, _FP4_PACKED = "F8_E4M3", "I8"


def check_v4_weights(path: str, spec: DSparkDraftSpec) -> DSparkV4WeightLayout:
    """A DeepSeek-V4 checkpoint's DSpark stages, read from its safetensors headers
    (nothing is loaded): the stages and heads (``group_dspark_v4_weights``), the
    Markov and confidence heads' shapes against the config, ``main_proj``'s width
    against ``dspark_target_layer_ids``, and a scale of the right shape beside every
    quantised stage tensor. One line naming the tensor or key otherwise."""
    import glob
    import os

    from vllm_v4_patches.dspark.checkpoint.deepspec_weights import safetensors_entries

    files = sorted(glob.glob(os.path.join(os.fspath(path), "*.safetensors")))
    if not files:
        raise ValueError(f"{WEIGHTS_ERROR}: no *.safetensors file in {path}")
    entries: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        entries.update(
            (name, entry)
            for name, entry in safetensors_entries(file).items()
            if name.startswith("mtp.")
        )
    return check_v4_entries(entries, spec)


def read_v4_confidence_weight(path: str, spec: DSparkDraftSpec) -> Any | None:
    """The last stage's ``confidence_head.proj.weight`` (``[1, H + r]``) as a tensor,
    or None where the config switches the head off or the checkpoint has none.
    vLLM's V4 draft class drops this tensor; the overlay's V4 drafter scores it."""
    import glob
    import os

    from vllm_v4_patches.dspark.checkpoint.deepspec_weights import safetensors_entries

    layout = check_v4_weights(path, spec)
    if not (spec.enable_confidence_head and layout.has_confidence_head):
        return None
    name = _weight_tensor(layout.heads["confidence_head"])
    for file in sorted(glob.glob(os.path.join(os.fspath(path), "*.safetensors"))):
        if name in safetensors_entries(file):
            from safetensors import safe_open

            with safe_open(file, framework="pt") as tensors:
                return tensors.get_tensor(name)
    return None


def check_v4_entries(
    entries: Mapping[str, tuple[str, Sequence[int]]], spec: DSparkDraftSpec
) -> DSparkV4WeightLayout:
    """``check_v4_weights`` on the ``mtp.*`` entries (name -> (dtype, shape))."""
    shapes = {name: tuple(shape) for name, (_, shape) in entries.items()}
    layout = group_dspark_v4_weights(entries, shapes=shapes, spec=spec)
    _check_context_width(layout, shapes, spec)
    _check_scales(entries)
    return layout


def _check_context_width(
    layout: DSparkV4WeightLayout, shapes: Mapping[str, Sequence[int]], spec: DSparkDraftSpec
) -> None:
    name = _weight_tensor(layout.heads["main_proj"])
    width = spec.hidden_size * len(spec.target_layer_ids)
    stored = tuple(shapes[name])
    if stored[-1] != width:
        key = V4_KEY_NAMES["target_layer_ids"]
        raise ValueError(
            f"{WEIGHTS_ERROR}: {name} takes {stored[-1]} inputs, but {key}="
            f"{list(spec.target_layer_ids)} gives {len(spec.target_layer_ids)} taps of "
            f"hidden_size {spec.hidden_size} ({width})"
        )


def _check_scales(entries: Mapping[str, tuple[str, Sequence[int]]]) -> None:
    for name, (dtype, shape) in entries.items():
        if dtype not in (_FP8, _FP4_PACKED) or not name.endswith(".weight"):
            continue
        scale = name.removesuffix(".weight") + ".scale"
        rows, columns = shape
        if dtype == _FP8:
            expected = (-(-rows // 128), -(-columns // 128))
        else:
            expected = (rows, -(-2 * columns // 32))
        if scale not in entries:
            raise ValueError(f"{WEIGHTS_ERROR}: {name} ({dtype}) has no scale tensor {scale}")
        if tuple(entries[scale][1]) != expected:
            raise ValueError(
                f"{WEIGHTS_ERROR}: {scale} has shape {list(entries[scale][1])}; "
                f"{name} ({dtype} {list(shape)}) needs {list(expected)}"
            )
