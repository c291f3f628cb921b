"""The draft block's math in plain PyTorch: the Markov and confidence heads, per-slot
sampling, and a block drafted left to right.

DSpark drafts a block of N tokens from one parallel backbone pass (``base_logits``)
and then walks the slots left to right, adding a Markov-head bias that depends on the
token drafted in the previous slot. Because every slot is sampled from an exact
softmax given the tokens actually drafted before it, the block distribution
factorises autoregressively and standard token-wise rejection sampling stays
lossless, *provided the verifier receives exactly those per-slot distributions*.
That is why :func:`draft_block` returns the corrected, temperature-scaled
probabilities it sampled from: they are what a V1 drafter's
``take_last_draft_probs()`` must hand to vLLM's rejection sampler.

A confidence head predicts, per slot, the probability that the slot is accepted
given that all earlier ones were; the cumulative product (the survival) feeds the
paper's verify-length scheduler (``dspark.verify_lengths``). The rejection sampler
the lossless tests check against is a test oracle (``tests/rejection_oracle.py``).

Package rule: nothing here imports torch (or vLLM) at module import time, so the
overlay stays import-light; every function imports torch itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from vllm_v4_patches.dspark.checkpoint.spec import MARKOV_HEAD_TYPES

if TYPE_CHECKING:
    import torch

MarkovKind = Literal["vanilla", "gated", "rnn"]


@dataclass(frozen=True)
class MarkovHead:
    """Parameters of the Markov head (the sequential stage).

    ``w1`` is the ``Embedding(V, r)`` weight and ``w2`` the ``Linear(r, V)`` weight,
    both ``[V, r]`` as stored in checkpoints. ``gate_*`` is ``gate_proj: Linear(H + r,
    r)`` (gated variant); ``joint_*`` is ``joint_proj: Linear(2r + H, 3r)`` (rnn
    variant), whose output splits into gate, candidate and output, in that order.
    """

    w1: torch.Tensor
    w2: torch.Tensor
    kind: MarkovKind = "vanilla"
    gate_weight: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None
    joint_weight: torch.Tensor | None = None
    joint_bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # Fail at construction, not deep inside the drafting loop.
        if self.kind not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"unknown Markov head kind {self.kind!r}; expected {MARKOV_HEAD_TYPES}"
            )
        if self.w1.shape != self.w2.shape:
            raise ValueError(f"w1 {tuple(self.w1.shape)} and w2 {tuple(self.w2.shape)} differ")
        if self.kind == "gated" and self.gate_weight is None:
            raise ValueError("a gated Markov head needs gate_weight")
        if self.kind == "rnn" and self.joint_weight is None:
            raise ValueError("an rnn Markov head needs joint_weight")

    @property
    def rank(self) -> int:
        return int(self.w1.shape[1])


@dataclass(frozen=True)
class ConfidenceHead:
    """``c_k = sigmoid(weight . [h_k ; W1[prev_k]] + bias)``.

    ``weight`` is ``[H + r]`` or ``[1, H + r]`` (the DSV4 checkpoint layout, no bias);
    a weight of length ``H`` reads the hidden state only (DeepSpec's
    ``confidence_head_with_markov = False``).
    """

    weight: torch.Tensor
    bias: torch.Tensor | float | None = None


@dataclass(frozen=True)
class DraftBlock:
    """One drafted block.

    ``probs`` is the exact per-slot distribution each token was sampled from (``None``
    for greedy drafting, where the verifier must treat the draft as one-hot);
    ``confidence`` is ``None`` when no confidence head is given.
    """

    tokens: torch.Tensor  # [B, N] int64
    probs: torch.Tensor | None  # [B, N, V]
    confidence: torch.Tensor | None  # [B, N]
    fused: bool = False  # drafted by the fused GPU kernel rather than the loop
    sharded: bool = False  # walked over this rank's vocabulary shard of the bias (TP > 1)


# --------------------------------------------------------------------------- Markov head


def markov_embed(head: MarkovHead, prev_tokens: torch.Tensor) -> torch.Tensor:
    """``W1[prev]``: the low-rank code of the previous token, ``[B, r]``."""
    return head.w1[prev_tokens]


def project_to_vocab(head: MarkovHead, features: torch.Tensor) -> torch.Tensor:
    """``W2(features)``: rank-r features to a vocabulary bias, ``[B, V]``."""
    import torch

    return torch.nn.functional.linear(features, head.w2)


def vanilla_bias(head: MarkovHead, prev_tokens: torch.Tensor) -> torch.Tensor:
    """``W2(W1[prev])``: a bigram correction, independent of the backbone state."""
    return project_to_vocab(head, markov_embed(head, prev_tokens))


def gated_features(
    code: torch.Tensor, hidden: torch.Tensor, gate_weight: torch.Tensor, gate_bias: Any
) -> torch.Tensor:
    """``sigmoid(gate_proj([h_k ; code])) * code``: what the gated head hands W2.

    The gate lets the backbone state decide how much of the bigram code to apply.
    """
    import torch

    gate_input = torch.cat([hidden, code], dim=-1)
    gate = torch.sigmoid(torch.nn.functional.linear(gate_input, gate_weight, gate_bias))
    return gate * code


def rnn_features(
    code: torch.Tensor,
    hidden: torch.Tensor,
    state: torch.Tensor,
    joint_weight: torch.Tensor,
    joint_bias: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step: ``(tanh(o), s_k)``, W2's input and the new state.

    ``[g, c, o] = joint_proj([s_{k-1} ; code ; h_k])``;
    ``s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c)``.
    The state carries information from every earlier drafted token, not just the last.
    """
    import torch

    joint_input = torch.cat([state, code, hidden], dim=-1)
    joint = torch.nn.functional.linear(joint_input, joint_weight, joint_bias)
    gate_logit, candidate, output = joint.split(code.shape[-1], dim=-1)
    keep = torch.sigmoid(gate_logit)
    new_state = keep * state + (1.0 - keep) * torch.tanh(candidate)
    return torch.tanh(output), new_state


def gated_bias(head: MarkovHead, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``W2(sigmoid(gate_proj([h_k ; W1[prev]])) * W1[prev])``."""
    code = markov_embed(head, prev_tokens)
    return project_to_vocab(head, gated_features(code, hidden, head.gate_weight, head.gate_bias))


def initial_rnn_state(head: MarkovHead, hidden: torch.Tensor) -> torch.Tensor:
    """``s_0 = 0``, shaped ``[B, r]`` like the batch of ``hidden`` ``[B, ..., H]``."""
    import torch

    return torch.zeros(hidden.shape[0], head.rank, dtype=head.w1.dtype, device=head.w1.device)


def rnn_bias(
    head: MarkovHead,
    prev_tokens: torch.Tensor,
    hidden: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step; returns ``(W2(tanh(o)), s_k)`` (see :func:`rnn_features`)."""
    code = markov_embed(head, prev_tokens)
    output, new_state = rnn_features(code, hidden, state, head.joint_weight, head.joint_bias)
    return project_to_vocab(head, output), new_state


def markov_bias(
    head: MarkovHead,
    prev_tokens: torch.Tensor,
    hidden: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bias for one slot of any variant; returns ``(bias [B, V], next state)``.

    Only the rnn variant has a state; pass ``None`` at slot 0 to start from zero.
    """
    if head.kind == "vanilla":
        return vanilla_bias(head, prev_tokens), None
    if head.kind == "gated":
        return gated_bias(head, prev_tokens, hidden), None
    if state is None:
        state = initial_rnn_state(head, hidden)
    return rnn_bias(head, prev_tokens, hidden, state)


# ------------------------------------------------------------------------ confidence head


def slot_confidence(
    confidence_head: ConfidenceHead, hidden: torch.Tensor, prev_code: torch.Tensor
) -> torch.Tensor:
    """Per-slot conditional acceptance ``c_k``, ``[B]``."""
    import torch

    weight = confidence_head.weight.reshape(-1)
    if weight.shape[0] == hidden.shape[-1]:
        features = hidden  # hidden-only head: no Markov code in the input
    else:
        features = torch.cat([hidden, prev_code], dim=-1)
    logit = features @ weight
    if confidence_head.bias is not None:
        logit = logit + torch.as_tensor(confidence_head.bias, dtype=logit.dtype).reshape(())
    return torch.sigmoid(logit)


def survival(confidence: torch.Tensor) -> torch.Tensor:
    """``a_k = prod_{i<=k} c_i``: the probability that slots ``0..k`` are all accepted."""
    import torch

    return torch.cumprod(confidence, dim=-1)


# ------------------------------------------------------------------------------ drafting


def exponential_race(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample ``argmax_v p_v / E_v`` with ``E_v = -log u_v`` i.i.d. Exp(1).

    The winner of an exponential race is distributed exactly as ``p / sum(p)``, so the
    rows need not be normalised and zero-probability tokens can never win.
    """
    import torch

    tiny = torch.finfo(uniforms.dtype).tiny
    # u == 0 would give E = inf and a score of 0 for every token; clamping keeps the
    # race well defined without changing the law (u is continuous).
    exponentials = -torch.log(uniforms.clamp_min(tiny))
    return (probs / exponentials).argmax(dim=-1)


def tempered_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``softmax(logits / T)`` per row; rows with ``T <= 0`` become one-hot argmax.

    A zero temperature means greedy: the argmax is drawn with probability one, so the
    one-hot row is the distribution that token was actually drawn from.
    """
    import torch

    greedy_rows = temperature <= 0
    if not bool(greedy_rows.any()):
        return torch.softmax(logits / temperature.unsqueeze(-1).to(logits.dtype), dim=-1)
    safe_temperature = torch.where(greedy_rows, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / safe_temperature.unsqueeze(-1).to(logits.dtype), dim=-1)
    one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1])
    return torch.where(greedy_rows.unsqueeze(-1), one_hot.to(probs.dtype), probs)


def sample_slot(
    corrected_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    uniforms: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one slot's token from its Markov-corrected logits ``[B, V]``.

    Returns ``(token [B], probs [B, V] or None)``: greedy (argmax, no probs) when
    ``temperature`` is None, else an exponential-race sample from
    ``softmax(corrected / T)`` together with that exact distribution.
    """
    if temperature is None:
        return corrected_logits.argmax(dim=-1), None
    probs = tempered_probs(corrected_logits, temperature)
    return exponential_race(probs, uniforms), probs


def draft_block(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    hidden: torch.Tensor,
    head: MarkovHead,
    confidence_head: ConfidenceHead | None = None,
    temperature: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> DraftBlock:
    """Draft N tokens left to right from the backbone's ``base_logits [B, N, V]``.

    Slot k's previous token is ``anchor [B]`` for k = 0 and the token drafted at k - 1
    otherwise; the Markov bias of that token is added to the base logits. With
    ``temperature=None`` the draft is greedy (argmax, ``probs=None``). Otherwise each
    slot is sampled from ``softmax(corrected / T)`` (``T`` is ``[B]``) and exactly that
    distribution is returned in ``probs``. Sampling noise is ``noise`` (uniforms
    ``[B, N, V]``) when given, else drawn from ``generator``; keep it independent of
    the verifier's noise, or the residual sample is correlated with the draft.
    """
    import torch

    from vllm_v4_patches.dspark.markov_chain import walk_slots

    batch, num_slots, vocab = base_logits.shape
    if temperature is not None and noise is None:
        noise = torch.rand(batch, num_slots, vocab, generator=generator, dtype=base_logits.dtype)

    def bias_step(previous: Any, slot: int, state: Any) -> tuple[Any, Any, Any]:
        bias, state = markov_bias(head, previous, hidden[:, slot], state)
        return bias, state, markov_embed(head, previous)

    def pick(corrected: Any, slot: int) -> tuple[Any, Any]:
        return sample_slot(corrected, temperature, None if noise is None else noise[:, slot])

    walked = walk_slots(base_logits, anchor, bias_step, pick)
    confidence = None
    if confidence_head is not None:
        confidence = torch.stack(
            [
                slot_confidence(confidence_head, hidden[:, slot], code)
                for slot, code in enumerate(walked.embeddings)
            ],
            dim=1,
        )
    return DraftBlock(tokens=walked.tokens, probs=walked.probs, confidence=confidence)
