"""The Markov stage in PyTorch, slot by slot in fp32: the drafter's fallback where
the fused kernel does not run (CPU, tensor parallel, gated or rnn heads) and the
oracle the kernel's tokens are tested against."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def greedy_markov_draft_reference(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot-by-slot PyTorch version of greedy_markov_draft, all arithmetic in fp32."""
    return _draft_reference(base_logits, anchor, markov_w1, markov_w2, hidden, confidence_w)


def sampled_markov_draft_reference(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    temperature: torch.Tensor,
    gumbel_noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot-by-slot PyTorch version of sampled_markov_draft, all arithmetic in fp32."""
    return _draft_reference(
        base_logits,
        anchor,
        markov_w1,
        markov_w2,
        hidden,
        confidence_w,
        temperature,
        gumbel_noise,
    )


def anchor_in_table(anchor: torch.Tensor, markov_w1: torch.Tensor) -> torch.Tensor:
    """The anchors as row indices of ``markov_w1``: an id outside the table reads the
    nearest row.

    Under async scheduling vLLM hands the drafter -1 as the next token of a request
    whose sampled tokens it discards this step (the token is not on the host yet);
    that request's drafts are dropped, but the kernels gather by this id unchecked,
    and a row before the table is an illegal address. One clamp on the device, no
    synchronisation.
    """
    return anchor.clamp(0, markov_w1.shape[0] - 1)


def _draft_reference(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    temperature: torch.Tensor | None = None,
    gumbel_noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    from vllm_v4_patches.dspark.markov_chain import walk_slots

    anchor = anchor_in_table(anchor, markov_w1)
    # fp32 weights: bf16 products are exact in fp32, so only the summation order
    # separates this from the kernel's fp32-accumulating tensor-core product.
    w2_t = markov_w2.float().t()
    weight = confidence_w.float()

    def bias_step(previous: Any, slot: int, state: Any) -> tuple[Any, Any, Any]:
        embedding = markov_w1[previous].float()
        return embedding @ w2_t, None, embedding

    def pick(corrected: Any, slot: int) -> tuple[Any, Any]:
        if gumbel_noise is not None:  # Gumbel-max, as the kernel's epilogue samples
            corrected = corrected + gumbel_noise[:, slot].float() * temperature.float()[:, None]
        return corrected.argmax(dim=-1), None

    walked = walk_slots(base_logits, anchor, bias_step, pick)
    confidence = [
        torch.sigmoid(torch.cat([hidden[:, slot].float(), embedding], dim=-1) @ weight)
        for slot, embedding in enumerate(walked.embeddings)
    ]
    return walked.tokens, torch.stack(confidence, dim=1)
