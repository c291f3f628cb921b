"""DSpark's greedy Markov walk where the bias weight is split over the vocabulary.

At tensor parallel size above 1 the overlay's draft class splits the Markov head's
projection ``markov_w2`` over the vocabulary, as vLLM splits an LM head. The loop
then gathers every slot's whole bias row from every rank, ``[B, V]`` per slot, to
take one argmax from it. Greedy drafting needs only that argmax: each rank adds its
own rows of the bias to the same columns of the base logits and takes its best, and
one all-reduce per slot (of one 64-bit key per request) gives every rank the best of
the ranks' bests. The key orders by logit, then by the lower token id, which is the
token an argmax over the whole row picks, and the shard's bias is computed by the
op the logits processor applies before it gathers, so the drafts are the loop's,
bit for bit. The walk itself is ``markov_chain.walk_slots``, as for every caller.

Nothing here imports torch at module import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_LOW_32 = 0xFFFFFFFF
_FLIP_MAGNITUDE = 0x7FFFFFFF


def pack_best(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """One int64 key per row whose maximum is the row with the larger logit, and of
    equal logits the lower token id: the float's bits made order-preserving as a
    signed int32 in the high half, the id's complement in the low half."""
    import torch

    bits = (logits.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    ordered = torch.where(bits < 0, bits ^ _FLIP_MAGNITUDE, bits).long()
    return (ordered << 32) | (_LOW_32 - token_ids.long())


def unpack_token(keys: torch.Tensor) -> torch.Tensor:
    return _LOW_32 - (keys & _LOW_32)


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of ``markov_w2``: vocabulary ids ``start`` to
    ``start + count`` (its padding rows past the vocabulary left out)."""

    layer: Any  # the vocabulary-parallel markov_w2
    start: int
    count: int
    group: Any  # the tensor-parallel process group the ranks reduce over

    def columns(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's columns of whole-vocabulary logits ``[..., V]``."""
        return logits[..., self.start : self.start + self.count]

    def bias(self, features: torch.Tensor) -> torch.Tensor:
        """This rank's columns of the Markov bias, as the logits processor computes
        them before it gathers."""
        return self.layer.quant_method.apply(self.layer, features)[:, : self.count]

    def best(self, corrected: torch.Tensor, slot: int) -> tuple[torch.Tensor, None]:
        """The whole vocabulary's argmax of one slot, from this rank's columns
        ``[B, count]`` of its corrected logits: a walk's ``pick``."""
        import torch
        import torch.distributed as dist

        if self.count:
            logits, columns = corrected.max(dim=-1)  # the first of equal maxima
        else:
            logits = torch.full(corrected.shape[:1], float("-inf"), device=corrected.device)
            columns = torch.zeros(corrected.shape[:1], dtype=torch.long, device=corrected.device)
        keys = pack_best(logits, columns + self.start)
        dist.all_reduce(keys, op=dist.ReduceOp.MAX, group=self.group)
        return unpack_token(keys), None


def vocab_shard(model: Any, vocab: int) -> VocabShard | None:
    """This rank's shard of the draft model's Markov bias weight where it is split
    over the vocabulary and gives the loop's bias unchanged (unquantized, logits
    neither scaled nor soft-capped, the draft's whole vocabulary), else None. Every
    condition is the same on every rank, so all ranks walk the same way."""
    head = getattr(getattr(model, "model", None), "markov_head", None)
    layer = getattr(head, "markov_w2", None)
    if layer is None or getattr(layer, "tp_size", 1) == 1:
        return None
    method = getattr(layer, "quant_method", None)
    if method is None or not type(method).__name__.startswith("Unquantized"):
        return None
    processor = getattr(model, "logits_processor", None)
    if getattr(processor, "scale", 1.0) != 1.0 or getattr(processor, "soft_cap", None):
        return None
    shard = getattr(layer, "shard_indices", None)
    if shard is None or shard.num_added_elements or getattr(layer, "org_vocab_size", 0) != vocab:
        return None
    from vllm.distributed import get_tp_group

    return VocabShard(
        layer, shard.org_vocab_start_index, shard.num_org_elements, get_tp_group().device_group
    )
