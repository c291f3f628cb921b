"""DSpark's sequential stage: the one left-to-right walk over a draft block.

Slot k's Markov bias depends on the token drafted at slot k - 1 (the anchor for
slot 0), so the slots are picked in order. Every caller walks the block here and
differs only in its pieces: how a head turns the previous token into a bias (a
vanilla, gated or rnn head, a vLLM draft model, the fused kernel's weights) and how
a slot's token is picked (argmax, an exponential race with the verifier's exact
distribution, Gumbel-max). Serving (``sampling``), the functional heads (``draft_math``),
the fused kernel's PyTorch reference (``markov_kernel.reference``) and the
distillation tool (``tools/dspark_model.py``) all call ``walk_slots``.

Nothing here imports torch at module import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# (previous tokens [B], slot, state) -> (bias [B, V], next state, Markov embedding [B, r])
BiasStep = Callable[[Any, int, Any], tuple[Any, Any, Any]]
# (corrected logits [B, V], at least fp32, slot) -> (tokens [B], distribution [B, V] or None)
PickToken = Callable[[Any, int], tuple[Any, Any]]


@dataclass(frozen=True)
class WalkedBlock:
    """What one walk over a block produced, slot by slot."""

    tokens: torch.Tensor  # [B, N] int64, after ``to_previous``
    probs: torch.Tensor | None  # [B, N, V]: the distributions picked from, if any
    embeddings: list  # N tensors [B, r]: each slot's Markov embedding
    corrected: torch.Tensor | None  # [B, N, V] corrected logits, when kept


def walk_slots(
    base_logits: torch.Tensor,
    anchors: torch.Tensor,
    bias_step: BiasStep,
    pick: PickToken,
    to_previous: Callable[[Any], Any] | None = None,
    keep_corrected: bool = False,
) -> WalkedBlock:
    """Walk ``base_logits [B, N, V]`` left to right from ``anchors [B]``.

    Each slot adds ``bias_step``'s bias to its base logits (at least in fp32) and picks
    a token;
    ``to_previous`` maps the picked ids to the ids the next slot conditions on (a
    draft vocabulary's ids to the target's) and gives the tokens returned.
    """
    import torch

    # at least fp32: a 16-bit model's logits and bias are added and compared in fp32
    dtype = torch.promote_types(base_logits.dtype, torch.float32)
    previous, state = anchors.long(), None
    tokens, distributions, embeddings, corrected_slots = [], [], [], []
    for slot in range(base_logits.shape[1]):
        bias, state, embedding = bias_step(previous, slot, state)
        corrected = base_logits[:, slot].to(dtype) + bias.to(dtype)
        picked, distribution = pick(corrected, slot)
        previous = picked if to_previous is None else to_previous(picked)
        tokens.append(previous.long())
        distributions.append(distribution)
        embeddings.append(embedding)
        if keep_corrected:
            corrected_slots.append(corrected)
    sampled = distributions and distributions[0] is not None
    return WalkedBlock(
        tokens=torch.stack(tokens, dim=1),
        probs=torch.stack(distributions, dim=1) if sampled else None,
        embeddings=embeddings,
        corrected=torch.stack(corrected_slots, dim=1) if keep_corrected else None,
    )
