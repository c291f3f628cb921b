"""Token-wise rejection sampling written independently of vLLM, as a test oracle.

The lossless checks in ``test_dspark_math.py`` run twice: through vLLM's own V1
rejection sampler and through this reference (Leviathan et al. / Chen et al.,
batched), so that a fault in either shows as a disagreement with the enumerated
target law. Serving never uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_v4_patches.dspark import draft_math


@dataclass(frozen=True)
class VerifyResult:
    """Output of :func:`rejection_sample_reference`.

    ``tokens`` holds the emitted tokens left-aligned, padded with -1;
    ``num_emitted = num_accepted + 1`` (a correction or a bonus token always follows).
    """

    tokens: torch.Tensor  # [B, N + 1] int64
    num_accepted: torch.Tensor  # [B] int64
    num_emitted: torch.Tensor  # [B] int64


def _residual_distributions(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    verify_lengths: torch.Tensor,
) -> torch.Tensor:
    """Where to sample the token emitted at each slot if the chain stops there.

    Slot k < l_r: ``max(0, p_t - p_d)`` (after a rejection); slot k = l_r: plain
    ``p_t`` (the bonus after all verified drafts were accepted). Unnormalised.
    """
    import torch

    batch, num_slots = draft_tokens.shape
    drafted_probs = draft_probs
    if drafted_probs is None:
        # A greedy draft is a point mass on the drafted token.
        drafted_probs = torch.nn.functional.one_hot(draft_tokens, target_probs.shape[-1])
        drafted_probs = drafted_probs.to(target_probs.dtype)
    residual = (target_probs[:, :num_slots] - drafted_probs).clamp_min(0.0)
    # p_t <= p_d everywhere only if p_t == p_d, where rejection cannot happen; guard
    # against round-off leaving an all-zero row anyway.
    empty_rows = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty_rows, target_probs[:, :num_slots], residual)
    residual = torch.cat([residual, target_probs[:, num_slots:]], dim=1)
    slot_index = torch.arange(num_slots + 1, device=draft_tokens.device)
    is_bonus = (slot_index.unsqueeze(0) >= verify_lengths.unsqueeze(1)).unsqueeze(-1)
    return torch.where(is_bonus, target_probs, residual)


def rejection_sample_reference(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    accept_uniforms: torch.Tensor,
    residual_uniforms: torch.Tensor,
    verify_lengths: torch.Tensor | None = None,
) -> VerifyResult:
    """Token-wise speculative sampling (Leviathan et al. / Chen et al.), batched.

    ``target_probs [B, N + 1, V]``: slot k is the target distribution given the
    context and drafts ``< k`` (slot N feeds the bonus). Draft k is accepted when
    ``u_k * p_d(x_k) < p_t(x_k)`` (probability ``min(1, p_t / p_d)``); at the first
    rejection the emitted token is drawn from ``norm(max(0, p_t - p_d))``; if every
    verified draft is accepted a bonus is drawn from ``p_t`` at slot ``l_r``.
    ``draft_probs=None`` means greedy drafts (one-hot ``p_d``). ``verify_lengths``
    ``[B]`` (default N) verifies only the first ``l_r`` drafts, as a scheduler would.
    ``accept_uniforms [B, N]`` and ``residual_uniforms [B, N + 1, V]`` must come from
    streams independent of each other and of the draft sampling noise.
    """
    import torch

    batch, num_slots = draft_tokens.shape
    draft_tokens = draft_tokens.to(torch.long)
    if verify_lengths is None:
        verify_lengths = torch.full((batch,), num_slots, dtype=torch.long)
    verify_lengths = verify_lengths.to(torch.long)
    token_index = draft_tokens.unsqueeze(-1)
    target_of_draft = target_probs[:, :num_slots].gather(-1, token_index).squeeze(-1)
    if draft_probs is None:
        draft_of_draft = torch.ones_like(target_of_draft)
    else:
        draft_of_draft = draft_probs.gather(-1, token_index).squeeze(-1)
    accepted = (draft_of_draft > 0) & (accept_uniforms * draft_of_draft < target_of_draft)
    slot_index = torch.arange(num_slots, device=draft_tokens.device)
    accepted &= slot_index.unsqueeze(0) < verify_lengths.unsqueeze(1)
    # Only the unbroken prefix of acceptances counts: the first rejection ends the block.
    num_accepted = accepted.to(torch.long).cumprod(dim=-1).sum(dim=-1)

    emit_from = _residual_distributions(target_probs, draft_tokens, draft_probs, verify_lengths)
    final_candidates = draft_math.exponential_race(emit_from, residual_uniforms)  # [B, N + 1]
    final_token = final_candidates.gather(1, num_accepted.unsqueeze(1)).squeeze(1)

    tokens = torch.full((batch, num_slots + 1), -1, dtype=torch.long)
    keep = slot_index.unsqueeze(0) < num_accepted.unsqueeze(1)
    tokens[:, :num_slots] = torch.where(keep, draft_tokens, tokens[:, :num_slots])
    tokens.scatter_(1, num_accepted.unsqueeze(1), final_token.unsqueeze(1))
    return VerifyResult(tokens=tokens, num_accepted=num_accepted, num_emitted=num_accepted + 1)
