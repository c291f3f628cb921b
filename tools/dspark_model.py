"""Pure-torch tiny Qwen3 target and DeepSpec-style DSpark draft (CPU reference).

Both models use the HF / DeepSpec tensor names, so the same safetensors load here,
in HF transformers (the target) and in vLLM. Nothing here imports vLLM.

Target (``TinyQwen3ForCausalLM``): a plain Qwen3 decoder (RMSNorm, per-head q/k
RMSNorm, neox RoPE, GQA, SwiGLU). ``forward`` returns the logits and the residual
stream after every layer: ``layer_outputs[0]`` is the embedding output and
``layer_outputs[i + 1]`` the (pre-final-norm) output of layer ``i``, so a DSpark
tap ``target_layer_ids = [l, ...]`` reads ``layer_outputs[l + 1]`` (``-1`` = the
embeddings), the same rows vLLM's aux-hidden-state capture returns.

Draft (``DSparkDraft``, ``docs/dspark.md`` section 1.1): context features
``H_ctx = hidden_norm(fc(concat taps))``; in every draft layer the keys / values are
``[k_norm(k_proj(H_ctx)) ; k_norm(k_proj(x_block))]`` (RoPE at each row's own
position; the context is *not* passed through the layer's ``input_layernorm``),
queries come only from the block ``[anchor, mask, ..., mask]`` at positions
``a .. a+gamma-1``; the block attends to itself without a causal mask and to context
positions ``< a``. After the final ``norm`` the shared LM head gives the base
logits ``U_k``; the vanilla Markov head adds ``markov_w2(markov_w1[prev])`` with
``prev = [anchor, d_1, ..., d_{gamma-1}]``; the confidence head is
``sigmoid(proj([h_k ; markov_w1[prev]]))`` (with bias, as in DeepSpec).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# the overlay package from this checkout: the drafting walk is the one serving uses
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_v4_patches.dspark.markov_chain import walk_slots  # noqa: E402

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Qwen3Dims:
    """The Qwen3 shape keys shared by the target and the draft configs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Qwen3Dims:
        rope = config.get("rope_parameters") or {}
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            head_dim=config.get("head_dim")
            or config["hidden_size"] // config["num_attention_heads"],
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 1e6))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like HF / vLLM so float64 callers see the same math.
        variance = x.float().pow(2).mean(-1, keepdim=True)
        normed = (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)
        return self.weight.to(x.dtype) * normed


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-layout cos / sin for ``positions`` (any shape) -> ``positions.shape + [d]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` is ``[B, heads, T, d]``; ``cos`` / ``sin`` are ``[B, T, d]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class Qwen3Attention(nn.Module):
    def __init__(self, dims: Qwen3Dims) -> None:
        super().__init__()
        self.dims = dims
        hidden, head_dim = dims.hidden_size, dims.head_dim
        self.q_proj = nn.Linear(hidden, dims.num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, dims.num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, dims.num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(dims.num_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, dims.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, dims.rms_norm_eps)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.dims.num_heads, self.dims.head_dim)
        return apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)

    def keys_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, _ = x.shape
        shape = (batch, length, self.dims.num_kv_heads, self.dims.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``mask``: bool ``[B, 1, Q, K]`` (True = visible); ``None`` = causal, Q == K."""
        groups = self.dims.num_heads // self.dims.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        batch, _, length, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class Qwen3MLP(nn.Module):
    def __init__(self, dims: Qwen3Dims) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dims.hidden_size, dims.intermediate_size, bias=False)
        self.up_proj = nn.Linear(dims.hidden_size, dims.intermediate_size, bias=False)
        self.down_proj = nn.Linear(dims.intermediate_size, dims.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3Layer(nn.Module):
    def __init__(self, dims: Qwen3Dims) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.self_attn = Qwen3Attention(dims)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.mlp = Qwen3MLP(dims)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x))


# --- target ---------------------------------------------------------------------------


class _Qwen3Backbone(nn.Module):
    def __init__(self, dims: Qwen3Dims) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(Qwen3Layer(dims) for _ in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, T, V]
    layer_outputs: list[torch.Tensor]  # num_layers + 1 tensors [B, T, H], pre-final-norm
    kv_cache: KVCache


class TinyQwen3ForCausalLM(nn.Module):
    """A Qwen3 causal LM with HF names (``model.layers.{i}.*``, ``lm_head``)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        self.dims = Qwen3Dims.from_config(config)
        self.model = _Qwen3Backbone(self.dims)
        self.lm_head = nn.Linear(self.dims.hidden_size, self.dims.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        start_position: int = 0,
        kv_cache: KVCache | None = None,
    ) -> TargetOutput:
        """Run ``input_ids`` ([B, T]) at positions ``start_position ..``.

        ``kv_cache`` holds the keys / values of positions ``0 .. start_position-1``
        (one entry per layer); the returned cache covers all positions so far.
        """
        batch, length = input_ids.shape
        positions = torch.arange(start_position, start_position + length).expand(batch, -1)
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.dims.head_dim, self.dims.rope_theta, hidden.dtype)
        mask = None
        if start_position > 0:
            # Rows see every cached position plus the causal part of the new chunk.
            key_positions = torch.arange(start_position + length)
            mask = (key_positions[None, :] <= positions[0][:, None]).view(1, 1, length, -1)
        layer_outputs = [hidden]
        new_cache: KVCache = []
        for index, layer in enumerate(self.model.layers):
            attention = layer.self_attn
            normed = layer.input_layernorm(hidden)
            q = attention.queries(normed, cos, sin)
            k, v = attention.keys_values(normed, cos, sin)
            if kv_cache is not None:
                k = torch.cat([kv_cache[index][0], k], dim=2)
                v = torch.cat([kv_cache[index][1], v], dim=2)
            new_cache.append((k, v))
            hidden = layer.feed_forward(hidden + attention.attend(q, k, v, mask))
            layer_outputs.append(hidden)
        logits = self.lm_head(self.model.norm(hidden))
        return TargetOutput(logits=logits, layer_outputs=layer_outputs, kv_cache=new_cache)

    @staticmethod
    def taps(
        layer_outputs: Sequence[torch.Tensor], target_layer_ids: Sequence[int]
    ) -> torch.Tensor:
        """Concatenated DSpark context features ``[..., len(ids) * H]`` (id ``-1`` = embeds)."""
        return torch.cat([layer_outputs[layer_id + 1] for layer_id in target_layer_ids], dim=-1)

    @torch.no_grad()
    def greedy_generate(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation of equal-length prompts ``[B, P]`` -> ``[B, P + N]``."""
        output = self(prompt_ids)
        tokens = [prompt_ids, output.logits[:, -1:].argmax(-1)]
        position = prompt_ids.shape[1]
        for _ in range(max_new_tokens - 1):
            output = self(tokens[-1], start_position=position, kv_cache=output.kv_cache)
            tokens.append(output.logits[:, -1:].argmax(-1))
            position += 1
        return torch.cat(tokens, dim=1)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str]) -> TinyQwen3ForCausalLM:
        from safetensors.torch import load_file

        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as handle:
            model = cls(json.load(handle))
        model.load_state_dict(load_file(os.path.join(model_dir, "model.safetensors")))
        return model.eval()


# --- draft ----------------------------------------------------------------------------


class MarkovHead(nn.Module):
    """Low-rank transition bias from the previous token (``docs/dspark.md`` section 2).

    vanilla: ``markov_w2(markov_w1[prev])``; gated: the code scaled by
    ``sigmoid(gate_proj([h ; code]))``; rnn: ``[g, c, o] = joint_proj([s ; code ; h])``,
    ``s' = sigmoid(g) s + (1 - sigmoid(g)) tanh(c)``, bias ``markov_w2(tanh(o))``.
    """

    def __init__(self, vocab_size: int, rank: int, hidden: int = 0, kind: str = "vanilla") -> None:
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def forward(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """The vanilla bias (training and the vanilla drafts)."""
        return self.markov_w2(self.markov_w1(prev_tokens))

    def step(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot's bias of any variant given that slot's hidden state; (bias, state)."""
        code = self.markov_w1(prev_tokens)
        if self.kind == "vanilla":
            return self.markov_w2(code), None
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, code], dim=-1)))
            return self.markov_w2(gate * code), None
        state = torch.zeros_like(code) if state is None else state
        gate_logit, candidate, output = self.joint_proj(torch.cat([state, code, hidden], -1)).chunk(
            3, -1
        )
        gate = torch.sigmoid(gate_logit)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)), state


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1, bias=True)


@dataclass
class DraftProposal:
    tokens: torch.Tensor  # [gamma] greedy drafts d_1 .. d_gamma
    logits: torch.Tensor  # [gamma, V] Markov-corrected logits each draft was taken from
    confidence: torch.Tensor  # [gamma] per-slot conditional acceptance estimate


class DSparkDraft(nn.Module):
    """A DeepSpec ``Qwen3DSparkModel`` draft; tensor names are the checkpoint's own."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        self.dims = Qwen3Dims.from_config(config)
        self.block_size = int(config["block_size"])
        self.mask_token_id = int(config["mask_token_id"])
        self.target_layer_ids = tuple(config["target_layer_ids"])
        self.markov_rank = int(config["markov_rank"])
        hidden = self.dims.hidden_size
        target_hidden = int(config.get("target_hidden_size") or hidden)
        self.embed_tokens = nn.Embedding(self.dims.vocab_size, hidden)
        self.layers = nn.ModuleList(Qwen3Layer(self.dims) for _ in range(self.dims.num_layers))
        self.norm = RMSNorm(hidden, self.dims.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * target_hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, self.dims.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, self.dims.vocab_size, bias=False)
        kind = config.get("markov_head_type") or "vanilla"
        self.markov_head = MarkovHead(self.dims.vocab_size, self.markov_rank, hidden, kind)
        self.confidence_head = ConfidenceHead(hidden + self.markov_rank)

    # ----- shared pieces

    def context_features(self, taps: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(taps))

    def block_input_ids(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """``[..., gamma]`` ids ``[anchor, mask, ..., mask]`` for anchors ``[...]``."""
        block = anchor_tokens.new_full((*anchor_tokens.shape, self.block_size), self.mask_token_id)
        block[..., 0] = anchor_tokens
        return block

    def backbone(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context: torch.Tensor,
        context_positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Final-normed block hidden states ``[B, Q, H]``.

        ``mask`` is bool ``[B, 1, Q, C + Q]`` over ``[context ; block]`` keys.
        """
        theta, head_dim = self.dims.rope_theta, self.dims.head_dim
        dtype = block_embeds.dtype
        block_cos, block_sin = rope_cos_sin(block_positions, head_dim, theta, dtype)
        context_cos, context_sin = rope_cos_sin(context_positions, head_dim, theta, dtype)
        hidden = block_embeds
        for layer in self.layers:
            attention = layer.self_attn
            normed = layer.input_layernorm(hidden)
            q = attention.queries(normed, block_cos, block_sin)
            k_block, v_block = attention.keys_values(normed, block_cos, block_sin)
            # Same K/V projection for context and block (KV injection).
            k_context, v_context = attention.keys_values(context, context_cos, context_sin)
            k = torch.cat([k_context, k_block], dim=2)
            v = torch.cat([v_context, v_block], dim=2)
            hidden = layer.feed_forward(hidden + attention.attend(q, k, v, mask))
        return self.norm(hidden)

    def confidence_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        features = torch.cat([hidden, self.markov_head.markov_w1(prev_tokens)], dim=-1)
        return self.confidence_head.proj(features).squeeze(-1)

    # ----- training form: many anchors per sequence in one pass

    def forward_anchors(
        self, input_ids: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Base logits ``[B, A, gamma, V]`` and hidden ``[B, A, gamma, H]``.

        ``input_ids`` / ``taps``: ``[B, T]`` / ``[B, T, m*H]``; ``anchors``: ``[B, A]``
        positions. Each block sees context rows ``< anchor`` and its own block only.
        """
        batch, length = input_ids.shape
        num_anchors = anchors.shape[1]
        gamma = self.block_size
        anchor_tokens = input_ids.gather(1, anchors)
        block_ids = self.block_input_ids(anchor_tokens).view(batch, num_anchors * gamma)
        offsets = torch.arange(gamma)
        block_positions = (anchors.unsqueeze(-1) + offsets).view(batch, -1)
        context_positions = torch.arange(length).expand(batch, -1)
        query_anchor = anchors.repeat_interleave(gamma, dim=1)  # [B, Q]
        sees_context = context_positions.unsqueeze(1) < query_anchor.unsqueeze(-1)  # [B, Q, T]
        query_block = torch.arange(num_anchors).repeat_interleave(gamma)
        sees_block = (query_block[:, None] == query_block[None, :]).expand(batch, -1, -1)
        mask = torch.cat([sees_context, sees_block], dim=-1).unsqueeze(1)
        hidden = self.backbone(
            self.embed_tokens(block_ids),
            block_positions,
            self.context_features(taps),
            context_positions,
            mask,
        )
        logits = self.lm_head(hidden)
        return (
            logits.view(batch, num_anchors, gamma, -1),
            hidden.view(batch, num_anchors, gamma, -1),
        )

    # ----- inference form: one anchor, from scratch (recompute reference)

    def draft_hidden(
        self,
        target_hidden_states_for_context: torch.Tensor,
        anchor_position: int,
        anchor_token: int,
    ) -> torch.Tensor:
        """Final-normed block hidden ``[gamma, H]`` for one anchor (see ``draft_logits``)."""
        # Taps may come from a differently-typed target run; compute in the draft's dtype.
        context_taps = target_hidden_states_for_context[:anchor_position].to(self.fc.weight.dtype)
        if context_taps.shape[0] != anchor_position:
            raise ValueError(
                f"need context taps for positions 0..{anchor_position - 1}, "
                f"got {context_taps.shape[0]} rows"
            )
        gamma = self.block_size
        block_ids = self.block_input_ids(torch.tensor([anchor_token]))
        block_positions = torch.arange(anchor_position, anchor_position + gamma).unsqueeze(0)
        context_positions = torch.arange(anchor_position).unsqueeze(0)
        # Every block row sees the whole context (all < anchor) and the whole block.
        mask = torch.ones(1, 1, gamma, anchor_position + gamma, dtype=torch.bool)
        embeds = self.embed_tokens(block_ids)
        hidden = self.backbone(
            embeds,
            block_positions,
            self.context_features(context_taps.unsqueeze(0)),
            context_positions,
            mask,
        )
        return hidden[0]

    @torch.no_grad()
    def draft_logits(
        self,
        target_hidden_states_for_context: torch.Tensor,
        anchor_position: int,
        anchor_token: int,
    ) -> torch.Tensor:
        """Base (pre-Markov) draft logits ``[gamma, V]`` for the block at ``anchor_position``.

        ``target_hidden_states_for_context`` is ``[N, m*H]``: the concatenated target
        taps (``TinyQwen3ForCausalLM.taps``) of positions ``0 .. N-1``, ``N >=
        anchor_position``; rows at or after the anchor are ignored. Slot ``k`` predicts
        the token at ``anchor_position + 1 + k``. Add ``markov_head(prev)`` for the
        Markov-corrected logits (``propose_greedy`` does the sequential loop).
        """
        hidden = self.draft_hidden(target_hidden_states_for_context, anchor_position, anchor_token)
        return self.lm_head(hidden)

    @torch.no_grad()
    def propose_greedy(
        self,
        target_hidden_states_for_context: torch.Tensor,
        anchor_position: int,
        anchor_token: int,
    ) -> DraftProposal:
        """Greedy chain: slot ``k`` uses ``prev`` = anchor, then the previous draft."""
        hidden = self.draft_hidden(target_hidden_states_for_context, anchor_position, anchor_token)
        base_logits = self.lm_head(hidden)

        def bias_step(previous: torch.Tensor, slot: int, state: Any) -> tuple[Any, Any, Any]:
            bias, state = self.markov_head.step(previous[0], hidden[slot], state)
            return bias[None], state, None

        def pick(corrected: torch.Tensor, slot: int) -> tuple[torch.Tensor, None]:
            return corrected.argmax(dim=-1), None

        anchor = torch.tensor([anchor_token])
        walked = walk_slots(base_logits[None], anchor, bias_step, pick, keep_corrected=True)
        tokens = walked.tokens[0]
        previous = torch.cat([anchor, tokens[:-1]])
        confidence = torch.sigmoid(self.confidence_logits(hidden, previous))
        return DraftProposal(tokens=tokens, logits=walked.corrected[0], confidence=confidence)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str]) -> DSparkDraft:
        from safetensors.torch import load_file

        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as handle:
            model = cls(json.load(handle))
        model.load_state_dict(load_file(os.path.join(model_dir, "model.safetensors")))
        return model.eval()


# --- offline speculative decoding -------------------------------------------------------


@dataclass
class SpecDecodeResult:
    tokens: list[int]  # generated tokens only
    accepted_lengths: list[int]  # tokens emitted per target verify step (incl. bonus)

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.accepted_lengths) / max(len(self.accepted_lengths), 1)


@torch.no_grad()
def greedy_decode(
    target: TinyQwen3ForCausalLM, prompt: Sequence[int], max_new_tokens: int
) -> list[int]:
    ids = torch.tensor([list(prompt)])
    return target.greedy_generate(ids, max_new_tokens)[0, len(prompt) :].tolist()


@torch.no_grad()
def greedy_speculative_decode(
    target: TinyQwen3ForCausalLM,
    draft: DSparkDraft,
    prompt: Sequence[int],
    max_new_tokens: int,
) -> SpecDecodeResult:
    """DeepSpec's reference loop (``docs/dspark.md`` 4.4) with a full target recompute per step.

    The recompute keeps it obviously correct: each step the target runs over the
    committed tokens plus the drafts, which yields both the verify logits and the
    taps of every committed position for the next block's context.
    """
    committed = list(prompt)
    output = target(torch.tensor([committed]))
    committed.append(int(output.logits[0, -1].argmax()))  # prefill's token: first anchor
    accepted_lengths: list[int] = []
    while len(committed) - len(prompt) < max_new_tokens:
        anchor_position = len(committed) - 1
        taps = target.taps(output.layer_outputs, draft.target_layer_ids)[0]
        proposal = draft.propose_greedy(taps, anchor_position, committed[-1])
        drafts = proposal.tokens.tolist()
        output = target(torch.tensor([committed + drafts]))
        # Target's choice for positions anchor+1 .. anchor+gamma+1.
        verified = output.logits[0, anchor_position:].argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == verified[accepted]:
            accepted += 1
        committed.extend(drafts[:accepted] + [verified[accepted]])
        accepted_lengths.append(accepted + 1)
    generated = committed[len(prompt) :][:max_new_tokens]
    return SpecDecodeResult(tokens=generated, accepted_lengths=accepted_lengths)


def mean_acceptance(results: Sequence[SpecDecodeResult]) -> float:
    steps = sum(len(result.accepted_lengths) for result in results)
    return sum(sum(result.accepted_lengths) for result in results) / max(steps, 1)


def exp_position_weights(block_size: int, decay: float) -> torch.Tensor:
    """DeepSpec's per-slot loss weights ``exp(-k / decay)``, ``k = 0 .. gamma-1``."""
    return torch.tensor([math.exp(-slot / decay) for slot in range(block_size)])


def write_markov_variant(
    draft_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], kind: str, seed: int = 0
) -> str:
    """Copy a vanilla draft with a ``gated`` or ``rnn`` Markov head added (test drafts).

    The new projections are seeded random, set so that the bias stays near the
    trained vanilla one and the drafts are still accepted: the gate starts mostly
    open (bias +1) and varies with the hidden state; the rnn output reads the
    previous token's code through an identity block. Written once per ``out_dir``.
    """

    from safetensors.torch import load_file

    out = os.fspath(out_dir)
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    with open(os.path.join(draft_dir, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    tensors = load_file(os.path.join(draft_dir, "model.safetensors"))
    rank, hidden = int(config["markov_rank"]), int(config["hidden_size"])
    dtype = tensors["markov_head.markov_w1.weight"].dtype
    generator = torch.Generator().manual_seed(seed)

    def noise(*shape: int) -> torch.Tensor:
        return 0.1 * torch.randn(*shape, generator=generator)

    if kind == "gated":
        tensors["markov_head.gate_proj.weight"] = noise(rank, hidden + rank).to(dtype)
        tensors["markov_head.gate_proj.bias"] = (1.0 + noise(rank)).to(dtype)
    elif kind == "rnn":
        joint = noise(3 * rank, 2 * rank + hidden)
        joint[2 * rank :, rank : 2 * rank] += torch.eye(rank)  # output <- code
        tensors["markov_head.joint_proj.weight"] = joint.to(dtype)
        tensors["markov_head.joint_proj.bias"] = noise(3 * rank).to(dtype)
    else:
        raise ValueError(f"kind {kind!r}: expected gated or rnn")
    config["markov_head_type"] = kind
    return _write_draft_copy(draft_dir, out, config, tensors)


def write_dflash_variant(draft_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> str:
    """Copy a DeepSpec DSpark draft as a DFlash draft vLLM serves with its own
    ``dflash`` method (no overlay): the same block layers, ``DFlashDraftModel``, the
    mask token and target layers under ``dflash_config``, no Markov or confidence
    head. Its drafts are not DSpark's; it exists to run vLLM's DFlash machinery on
    the same shapes without the overlay. Written once per ``out_dir``."""

    from safetensors.torch import load_file

    out = os.fspath(out_dir)
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    with open(os.path.join(draft_dir, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    heads = ("markov_head.", "confidence_head.")
    tensors = load_file(os.path.join(draft_dir, "model.safetensors"))
    tensors = {name: t for name, t in tensors.items() if not name.startswith(heads)}
    config["architectures"] = ["DFlashDraftModel"]
    config["dflash_config"] = {
        "mask_token_id": config["mask_token_id"],
        "target_layer_ids": config["target_layer_ids"],
    }
    for key in ("markov_rank", "markov_head_type", "enable_confidence_head"):
        config.pop(key, None)
    config.pop("confidence_head_with_markov", None)
    return _write_draft_copy(draft_dir, out, config, tensors)


def _write_draft_copy(
    draft_dir: str | os.PathLike[str], out: str, config: dict, tensors: dict
) -> str:
    """``draft_dir`` copied to ``out`` with this config and these tensors, staged
    beside it and renamed into place, so a half-written copy is never found."""
    import shutil

    from safetensors.torch import save_file

    staging = out + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(draft_dir, staging)
    with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    save_file(tensors, os.path.join(staging, "model.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    return out
