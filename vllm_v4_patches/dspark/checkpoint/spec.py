"""What every DSpark checkpoint reader shares: the formats' names, the spec both
config formats parse into, and the one-line error helpers. No torch or vLLM import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEEPSPEC_QWEN3_ARCHITECTURE = "Qwen3DSparkModel"
FORMAT_DEEPSPEC_QWEN3 = "deepspec-qwen3"
FORMAT_DEEPSEEK_V4 = "deepseek-v4"
FORMAT_DEEPSEEK_V41 = "deepseek-v4.1"
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
V4_WEIGHT_PREFIX = "mtp."

# The keys vLLM's DFlash code reads from a draft config, by their DeepSpec
# (top-level) name, with the name a DeepSeek-V4 config gives each
V4_KEY_NAMES = {
    "target_layer_ids": "dspark_target_layer_ids",
    "mask_token_id": "dspark_noise_token_id",
}

CONFIG_ERROR = "dspark draft config"
WEIGHTS_ERROR = "dspark draft weights"
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
    # the block layout the draft was trained with: True for anchor-first (every slot a
    # prediction, DeepSpec's and DeepSeek-V4's own), False for DFlash's fill-in
    # (anchor as a bonus token, 1 + N slots), as ``anchor_layout`` reads it
    anchor_first: bool = True


def short(value: Any) -> str:
    """A one-line, bounded repr for error messages."""
    text = repr(value).replace("\n", " ")
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."
