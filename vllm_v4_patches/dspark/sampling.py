"""DSpark's sequential stage over a loaded vLLM draft model.

The draft model supplies the pieces (base logits, Markov embedding and bias,
confidence); this module walks them left to right (``markov_chain.walk_slots``)
and samples. It works on any
model exposing ``compute_draft_logits`` (or ``compute_logits``), ``markov_embed``,
``markov_bias`` and optionally ``compute_confidence`` / ``map_draft_to_target``,
which is what vLLM's DSpark draft classes (0.25+) expose; a model with
``markov_features`` (the overlay's draft class: gated and rnn heads) turns the
Markov embedding, each slot's hidden state and its own state into what the bias
projects.

Greedy drafts of a vanilla Markov head on a CUDA device go through the fused
kernel (``markov_kernel``) where it computes exactly what the loop would: the
whole draft vocabulary's bias weight on this rank (tensor parallel size 1), no
draft-to-target id map, an unquantized bias weight, logits neither scaled nor
soft-capped; ``graphs`` replays that path from CUDA graphs. Where the bias weight
is split over the vocabulary (tensor parallel size above 1), greedy drafts of any
head walk this rank's shard and reduce each slot's best over the ranks
(``markov_shards``) instead of gathering the bias.
``VLLM_V4_DSPARK_MARKOV_KERNEL=eager`` launches the kernel every step instead, and
``torch`` keeps the PyTorch loop (gathering the bias at TP > 1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_v4_patches.dspark.draft_math import DraftBlock, sample_slot
from vllm_v4_patches.dspark.markov_chain import walk_slots
from vllm_v4_patches.dspark.markov_shards import vocab_shard

if TYPE_CHECKING:
    import torch

KERNEL_SETTING = "VLLM_V4_DSPARK_MARKOV_KERNEL"
# auto: the fused kernel, replayed from CUDA graphs where the engine runs graphs;
# eager: the fused kernel launched every step; torch: the PyTorch loop
KERNEL_CHOICES = ("auto", "eager", "torch")

logger = logging.getLogger("vllm_v4_patches")
_kernel_failed: list[Exception] = []  # the kernel's first failure in this process


def kernel_choice(env: dict[str, str] | None = None) -> str:
    from vllm_v4_patches.toggles import read_choice

    return read_choice(KERNEL_SETTING, KERNEL_CHOICES, "using auto", env)


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
    fused: bool = True,
    generators: dict[int, Any] | None = None,
) -> DraftBlock:
    """Draft ``num_slots`` tokens per request from the block's hidden states.

    ``hidden_states`` is ``[B * N, H]``, request-major; slot 0's previous token is
    the request's anchor, slot k's the token drafted at k - 1. ``generators`` are
    vLLM's seeded generators by batch row (sampling metadata).
    """

    batch = anchors.shape[0]
    base_logits = block_logits(model, hidden_states, batch, num_slots)
    shard = None
    if temperature is None and fused:
        block = fused_greedy_block(model, base_logits, anchors, hidden_states)
        if block is not None:
            return block
        shard = vocab_shard(model, base_logits.shape[-1])
    slot_hidden = hidden_states.view(batch, num_slots, hidden_states.shape[-1])
    features_of = getattr(model, "markov_features", None)  # gated/rnn heads: hidden state
    project = model.markov_bias if shard is None else shard.bias

    def bias_step(previous: Any, slot: int, state: Any) -> tuple[Any, Any, Any]:
        embedding = features = model.markov_embed(previous)
        if features_of is not None:
            features, state = features_of(embedding, slot_hidden[:, slot], state)
        return project(features), state, embedding

    def pick(corrected: Any, slot: int) -> tuple[Any, Any]:
        uniforms = None if temperature is None else slot_uniforms(corrected, generators)
        return sample_slot(corrected, temperature, uniforms)

    walked = walk_slots(
        base_logits if shard is None else shard.columns(base_logits),
        anchors,
        bias_step,
        pick if shard is None else shard.best,
        lambda ids: _to_target_ids(model, ids),
    )
    confidence = _confidence(model, hidden_states, walked.embeddings, batch)
    return DraftBlock(
        tokens=walked.tokens,
        probs=walked.probs,
        confidence=confidence,
        sharded=shard is not None,
    )


def slot_uniforms(like: torch.Tensor, generators: dict[int, Any] | None) -> torch.Tensor:
    """One slot's uniforms: a seeded request's row drawn from its own generator, so
    its drafts (and so its output) repeat run to run whatever shares its batch; the
    other rows from the global generator."""
    import torch

    uniforms = torch.rand_like(like)
    for row, generator in (generators or {}).items():
        if row < like.shape[0]:
            uniforms[row] = torch.rand(
                like.shape[1:], generator=generator, device=like.device, dtype=like.dtype
            )
    return uniforms


def greedy_stage(model: Any, num_slots: int) -> Callable[[Any, Any], DraftBlock | None]:
    """``(hidden_states, anchors) -> block`` of the fused greedy path, for ``graphs``
    to capture: no host synchronisation, no data-dependent shapes."""

    def stage(hidden_states: torch.Tensor, anchors: torch.Tensor) -> DraftBlock | None:
        base_logits = block_logits(model, hidden_states, anchors.shape[0], num_slots)
        return fused_greedy_block(model, base_logits, anchors, hidden_states)

    return stage


def fused_greedy_block(
    model: Any, base_logits: torch.Tensor, anchors: torch.Tensor, hidden_states: torch.Tensor
) -> DraftBlock | None:
    """The greedy block through the fused kernel, or None where it does not apply."""
    import torch

    batch, num_slots, _ = base_logits.shape
    tokens = fused_greedy_tokens(model, base_logits, anchors, hidden_states)
    if tokens is None:
        return None
    previous = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)
    embeddings = model.markov_embed(previous.flatten()).view(batch, num_slots, -1)
    confidence = _confidence(model, hidden_states, embeddings.unbind(1), batch)
    return DraftBlock(tokens=tokens, probs=None, confidence=confidence, fused=True)


def block_logits(
    model: Any, hidden_states: torch.Tensor, batch: int, num_slots: int
) -> torch.Tensor:
    """The draft's base logits as ``[B, N, V]``."""
    logits = _base_logits(model, hidden_states)
    return logits.view(batch, num_slots, logits.shape[-1])


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


def fused_greedy_tokens(
    model: Any, base_logits: torch.Tensor, anchors: torch.Tensor, hidden_states: torch.Tensor
) -> torch.Tensor | None:
    """``[B, N]`` greedy drafts from the fused GPU kernel, or None where it does not apply."""
    from vllm_v4_patches.dspark import markov_kernel

    if _kernel_failed or markov_kernel.pick_backend(base_logits) != "triton":
        return None
    weights = fusable_markov_weights(model, base_logits.shape[-1])
    if weights is None:
        return None
    markov_w1, markov_w2 = weights
    import torch

    batch, num_slots, _ = base_logits.shape
    hidden = hidden_states.view(batch, num_slots, -1)
    # the kernel also scores a bias-free confidence head; the model's own head (bias,
    # optional Markov input) is evaluated afterwards, so it is given zero weights
    unused = torch.zeros(hidden.shape[-1] + markov_w1.shape[-1], device=hidden.device)
    try:
        tokens, _ = markov_kernel.greedy_markov_draft(
            base_logits, anchors.long(), markov_w1, markov_w2, hidden, unused
        )
    except Exception as exc:  # a kernel that cannot build here must not stop serving
        _kernel_failed.append(exc)
        logger.warning(
            "vllm_v4_patches: dspark: the fused Markov kernel failed (%r); this process "
            "drafts with the PyTorch loop from now on",
            exc,
        )
        return None
    return tokens


def fusable_markov_weights(model: Any, vocab: int) -> tuple[Any, Any] | None:
    """``(markov_w1, markov_w2[:vocab])`` where the kernel computes what the loop
    would (``markov_embed`` then ``markov_bias``), else None."""
    head = getattr(getattr(model, "model", None), "markov_head", None)
    if head is None or getattr(head, "kind", "vanilla") != "vanilla":
        return None
    if getattr(model, "draft_id_to_target_id", None) is not None:
        return None  # drafts are draft-vocabulary ids; the next slot embeds target ids
    processor = getattr(model, "logits_processor", None)
    if getattr(processor, "scale", 1.0) != 1.0 or getattr(processor, "soft_cap", None):
        return None
    embed, project = getattr(head, "markov_w1", None), getattr(head, "markov_w2", None)
    if embed is None or project is None:
        return None
    for layer in (embed, project):
        if getattr(layer, "tp_size", 1) != 1:
            return None
        method = getattr(layer, "quant_method", None)
        if method is not None and not type(method).__name__.startswith("Unquantized"):
            return None
    markov_w1, markov_w2 = embed.weight, project.weight
    if not (markov_w2.is_floating_point() and markov_w2.shape[0] >= vocab):
        return None
    if markov_w1.shape[-1] != markov_w2.shape[-1]:
        return None
    return markov_w1, markov_w2[:vocab]
