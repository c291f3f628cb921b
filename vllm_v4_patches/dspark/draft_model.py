"""The overlay's DSpark Qwen3 draft model, for vLLM releases without one (< 0.25).

vLLM 0.25 added ``Qwen3DSparkForCausalLM``; older releases only have DFlash's Qwen3
draft. A DeepSpec DSpark checkpoint is that DFlash backbone plus two small heads,
so the class here is vLLM's DFlash Qwen3 draft with

* the Markov head (``markov_head.markov_w1``: target vocab x rank embedding of the
  previous token; ``markov_head.markov_w2``: draft vocab x rank projection to a
  logit bias, through the draft's logits processor like the LM head), in DeepSpec's
  three variants: vanilla, gated (``markov_head.gate_proj``) and rnn
  (``markov_head.joint_proj``), and
* the confidence head (``confidence_head.proj``: one float32 logit from the final
  hidden state, concatenated with the Markov embedding when
  ``confidence_head_with_markov``),

exposing the hooks the drafter's sequential stage calls (``compute_draft_logits``,
``markov_embed``, ``markov_bias``, ``compute_confidence``, ``map_draft_to_target``),
the same names vLLM's own DSpark draft classes use, plus ``markov_features``, which
the gated and rnn heads need (they read the slot's hidden state, and rnn carries a
state from slot to slot). vLLM's own DSpark class (0.25+) has the vanilla head only,
so there the V1 drafter gives gated and rnn drafts this class instead, registered
under the overlay's own architecture name.

vLLM's model registry imports this module lazily by name (``MODEL_REFERENCE``);
the class subclasses a vLLM class, so it is built on first attribute access.
"""

from __future__ import annotations

import functools
from typing import Any

CLASS_NAME = "DSparkQwen3ForCausalLM"
MODEL_REFERENCE = f"{__name__}:{CLASS_NAME}"
# tensors of the gated/rnn heads; loaded here because DFlash's loader would take
# "gate_proj" for the MLP's stacked gate_up_proj
_OWN_TENSORS = ("markov_head.gate_proj.", "markov_head.joint_proj.")


def __getattr__(name: str) -> Any:
    if name == CLASS_NAME:
        return draft_model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def confidence_head_class() -> type:
    """The confidence head's module (torch only): one logit per slot from the slot's
    hidden state, with the Markov embedding of the previous token where
    ``with_markov``. DeepSpec heads have a bias; DeepSeek-V4's has none."""
    import torch
    from torch import nn

    class ConfidenceHead(nn.Module):
        def __init__(self, input_dim: int, with_markov: bool, bias: bool = True) -> None:
            super().__init__()
            self.with_markov = with_markov
            # float32 whatever the model dtype: it is one logit per slot, and the
            # verify-length choice compares products of these probabilities
            self.proj = nn.Linear(input_dim, 1, bias=bias, dtype=torch.float32)

        def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
            features = torch.cat([hidden, markov_embed], dim=-1) if self.with_markov else hidden
            return self.proj(features.float()).squeeze(-1)

    return ConfidenceHead


@functools.cache
def markov_head_class() -> type:
    """The Markov head's module (``markov_w1``, ``markov_w2`` and the gated or rnn
    projection), shared by the overlay's Qwen3 and DeepSeek-V4 draft classes."""
    import torch
    from torch import nn
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    from vllm_v4_patches.dspark import draft_math

    class MarkovHead(nn.Module):
        def __init__(self, config: Any, spec: Any, prefix: str) -> None:
            super().__init__()
            rank, hidden = spec.markov_rank, spec.hidden_size
            self.kind = spec.markov_head_type or "vanilla"
            self.markov_w1 = VocabParallelEmbedding(
                config.vocab_size, rank, prefix=f"{prefix}.markov_w1"
            )
            draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
            self.markov_w2 = ParallelLMHead(draft_vocab, rank, prefix=f"{prefix}.markov_w2")
            # small replicated projections: the stage runs once per slot, in order
            if self.kind == "gated":
                self.gate_proj = nn.Linear(hidden + rank, rank, bias=True)
            elif self.kind == "rnn":
                self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank, bias=True)

        def features(
            self, code: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            """What markov_w2 projects for this slot, and the rnn state after it."""
            if self.kind == "vanilla":
                return code, None
            if self.kind == "gated":
                gate = self.gate_proj
                return draft_math.gated_features(code, hidden, gate.weight, gate.bias), None
            if state is None:
                state = torch.zeros_like(code)
            joint = self.joint_proj
            return draft_math.rnn_features(code, hidden, state, joint.weight, joint.bias)

    return MarkovHead


@functools.cache
def draft_model_class() -> type:
    import torch
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    from vllm_v4_patches.dspark.checkpoint import draft_spec

    MarkovHead = markov_head_class()
    ConfidenceHead = confidence_head_class()

    class DSparkQwen3ForCausalLM(DFlashQwen3ForCausalLM):
        """vLLM's DFlash Qwen3 draft with DSpark's Markov and confidence heads."""

        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            config = self.config
            inner_prefix = f"{prefix}.model" if prefix else "model"
            spec = draft_spec(config)
            head_prefix = f"{inner_prefix}.markov_head"
            self.model.markov_head = MarkovHead(config, spec, prefix=head_prefix)
            self.model.confidence_head = None
            if spec.enable_confidence_head:
                with_markov = spec.confidence_head_with_markov
                width = spec.hidden_size + (spec.markov_rank if with_markov else 0)
                self.model.confidence_head = ConfidenceHead(width, with_markov)
            _keep_query_projection_weights(self.model.layers)

        def compute_draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
            # draft-vocabulary logits: the Markov bias is added in draft space and
            # the sampled ids are mapped to target ids afterwards
            return self.logits_processor(self.lm_head, hidden_states)

        def map_draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
            if self.draft_id_to_target_id is None:
                return draft_ids
            return draft_ids + self.draft_id_to_target_id[draft_ids]

        def markov_embed(self, token_ids: torch.Tensor) -> torch.Tensor:
            return self.model.markov_head.markov_w1(token_ids)

        def markov_bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
            return self.logits_processor(self.model.markov_head.markov_w2, markov_embed)

        def markov_features(
            self,
            markov_embed: torch.Tensor,
            hidden_states: torch.Tensor,
            state: torch.Tensor | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            """What ``markov_w2`` projects for one slot, given the previous token's
            code and this slot's hidden state, and the rnn head's state after it
            (else None)."""
            return self.model.markov_head.features(markov_embed, hidden_states, state)

        def compute_confidence(
            self, hidden_states: torch.Tensor, markov_embed: torch.Tensor
        ) -> torch.Tensor:
            return torch.sigmoid(self.model.confidence_head(hidden_states, markov_embed))

        def load_weights(self, weights: Any) -> Any:
            # DeepSpec checkpoints may carry a training-only mask embedding (the mask
            # is a vocabulary row), and confidence weights the config switched off
            skipped = ("mask_embedding",) + (
                () if self.model.confidence_head is not None else ("confidence_head",)
            )
            kept, own = [], {}
            for name, weight in weights:
                if any(part in name for part in _OWN_TENSORS):
                    own[name] = weight
                elif not any(part in name for part in skipped):
                    kept.append((name, weight))
            loaded = super().load_weights(kept)
            return _load_own_tensors(self.model, own, loaded)

    DSparkQwen3ForCausalLM.__module__ = __name__
    return DSparkQwen3ForCausalLM


def _load_own_tensors(model: Any, tensors: dict, loaded: Any) -> Any:
    """Copy the gated/rnn head tensors in by name; add them to vLLM's loaded set."""
    import torch

    parameters = dict(model.named_parameters())
    names = set()
    for name, tensor in tensors.items():
        local = name[name.index("markov_head.") :]
        parameter = parameters.get(local)
        if parameter is None or parameter.shape != tensor.shape:
            raise ValueError(
                f"draft weight {name} {tuple(tensor.shape)} does not fit this draft's "
                f"markov_head_type={model.markov_head.kind!r}"
            )
        with torch.no_grad():
            parameter.copy_(tensor)
        names.add(f"model.{local}")
    missing = {n for n in parameters if n.startswith(_OWN_TENSORS)} - {
        n.removeprefix("model.") for n in names
    }
    if missing:
        raise ValueError(f"the draft checkpoint lacks {', '.join(sorted(missing))}")
    return loaded if loaded is None else set(loaded) | names


def _keep_query_projection_weights(layers: Any) -> None:
    """Keep each draft layer's fused QKV weight after loading on CPU.

    Before 0.25 vLLM's DFlash draft attention multiplies by ``qkv_proj.weight``
    directly, but on CPU the unquantized linear method repacks the weight for
    oneDNN and replaces it with an empty tensor, so the first draft forward fails
    ("size mismatch ... vec (0)"); 0.25 calls the layer instead. Here the layer is
    still repacked, and the weight stays for that direct use.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for layer in layers:
        projection = layer.self_attn.qkv_proj
        if type(projection.quant_method) is UnquantizedLinearMethod:
            projection.quant_method.process_weights_after_loading = lambda module: (
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            )
