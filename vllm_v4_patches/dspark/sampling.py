"""DSpark's sequential stage over a loaded vLLM draft model.

The draft model supplies the pieces (base logits, Markov embedding and bias,
confidence); this module chains them left to right and samples. It works on any
model exposing ``compute_draft_logits`` (or ``compute_logits``), ``markov_embed``,
``markov_bias`` and optionally ``compute_confidence`` / ``map_draft_to_target``,
which is what vLLM's DSpark draft classes (0.25+) expose; a model with
``markov_step`` (the overlay's draft class: gated and rnn heads) gets each slot's
hidden state and its own state through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_v4_patches.dspark.heads import DraftBlock, sample_slot

if TYPE_CHECKING:
    import torch


def temperatures_for(proposer: Any, sampling_metadata: Any) -> torch.Tensor | None:
    """Per-request temperatures, or None when every draft is greedy (always so
    before vLLM 0.22, which drafts greedily and passes no sampling metadata).

    Greedy requests carry temperature 0 in vLLM's sampling metadata; their rows
    stay greedy (a one-hot distribution) inside a probabilistic batch.
    """
    if sampling_metadata is None or not getattr(
        proposer, "_enable_probabilistic_draft_probs", False
    ):
        return None
    if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
        return None
    return sampling_metadata.temperature


def draft_with_markov_head(
    model: Any,
    hidden_states: torch.Tensor,
    anchors: torch.Tensor,
    num_slots: int,
    temperature: torch.Tensor | None,
) -> DraftBlock:
    """Draft ``num_slots`` tokens per request from the block's hidden states.

    ``hidden_states`` is ``[B * N, H]``, request-major; slot 0's previous token is
    the request's anchor, slot k's the token drafted at k - 1.
    """
    import torch

    batch = anchors.shape[0]
    base_logits = _base_logits(model, hidden_states)
    base_logits = base_logits.view(batch, num_slots, base_logits.shape[-1])
    slot_hidden = hidden_states.view(batch, num_slots, hidden_states.shape[-1])
    step = getattr(model, "markov_step", None)  # gated/rnn heads need the hidden state
    previous, state = anchors, None
    tokens, distributions, embeddings = [], [], []
    for slot in range(num_slots):
        embedding = model.markov_embed(previous)
        if step is None:
            bias = model.markov_bias(embedding)
        else:
            bias, state = step(embedding, slot_hidden[:, slot], state)
        corrected = base_logits[:, slot].float() + bias.float()
        uniforms = None if temperature is None else torch.rand_like(corrected)
        draft_ids, probs = sample_slot(corrected, temperature, uniforms)
        previous = _to_target_ids(model, draft_ids)
        tokens.append(previous)
        distributions.append(probs)
        embeddings.append(embedding)
    confidence = _confidence(model, hidden_states, embeddings, batch)
    return DraftBlock(
        tokens=torch.stack(tokens, dim=1),
        probs=None if temperature is None else torch.stack(distributions, dim=1),
        confidence=confidence,
    )


def _base_logits(model: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    compute = getattr(model, "compute_draft_logits", None) or model.compute_logits
    return compute(hidden_states)


def _to_target_ids(model: Any, draft_ids: torch.Tensor) -> torch.Tensor:
    mapping = getattr(model, "map_draft_to_target", None)
    return draft_ids if mapping is None else mapping(draft_ids)


def _confidence(
    model: Any, hidden_states: torch.Tensor, embeddings: list, batch: int
) -> torch.Tensor | None:
    import torch

    inner = getattr(model, "model", None)
    if getattr(inner, "confidence_head", None) is None:
        return None
    markov = torch.stack(embeddings, dim=1).flatten(0, 1)
    return model.compute_confidence(hidden_states, markov).view(batch, -1)
