"""The overlay's DSpark Qwen3 draft model, for vLLM releases without one (< 0.25).

vLLM 0.25 added ``Qwen3DSparkForCausalLM``; older releases only have DFlash's Qwen3
draft. A DeepSpec DSpark checkpoint is that DFlash backbone plus two small heads,
so the class here is vLLM's DFlash Qwen3 draft with

* the Markov head (``markov_head.markov_w1``: target vocab x rank embedding of the
  previous token; ``markov_head.markov_w2``: draft vocab x rank projection to a
  logit bias, through the draft's logits processor like the LM head), and
* the confidence head (``confidence_head.proj``: one float32 logit from the final
  hidden state, concatenated with the Markov embedding when
  ``confidence_head_with_markov``),

exposing the hooks the drafter's sequential stage calls (``compute_draft_logits``,
``markov_embed``, ``markov_bias``, ``compute_confidence``, ``map_draft_to_target``),
the same names vLLM's own DSpark draft classes use.

vLLM's model registry imports this module lazily by name (``MODEL_REFERENCE``);
the class subclasses a vLLM class, so it is built on first attribute access.
"""

from __future__ import annotations

import functools
from typing import Any

CLASS_NAME = "DSparkQwen3ForCausalLM"
MODEL_REFERENCE = f"{__name__}:{CLASS_NAME}"
SUPPORTED_MARKOV_HEADS = ("vanilla",)


def __getattr__(name: str) -> Any:
    if name == CLASS_NAME:
        return draft_model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def draft_model_class() -> type:
    import torch
    from torch import nn
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    class MarkovHead(nn.Module):
        def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, prefix: str):
            super().__init__()
            self.markov_w1 = VocabParallelEmbedding(vocab_size, rank, prefix=f"{prefix}.markov_w1")
            self.markov_w2 = ParallelLMHead(draft_vocab_size, rank, prefix=f"{prefix}.markov_w2")

    class ConfidenceHead(nn.Module):
        def __init__(self, input_dim: int, with_markov: bool) -> None:
            super().__init__()
            self.with_markov = with_markov
            # float32 whatever the model dtype: it is one logit per slot, and the
            # verify-length choice compares products of these probabilities
            self.proj = nn.Linear(input_dim, 1, bias=True, dtype=torch.float32)

        def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
            features = torch.cat([hidden, markov_embed], dim=-1) if self.with_markov else hidden
            return self.proj(features.float()).squeeze(-1)

    class DSparkQwen3ForCausalLM(DFlashQwen3ForCausalLM):
        """vLLM's DFlash Qwen3 draft with DSpark's Markov and confidence heads."""

        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            config = self.config
            inner_prefix = f"{prefix}.model" if prefix else "model"
            self.model.markov_head = MarkovHead(
                config.vocab_size,
                config.draft_vocab_size,
                config.markov_rank,
                prefix=f"{inner_prefix}.markov_head",
            )
            self.model.confidence_head = None
            if getattr(config, "enable_confidence_head", False):
                with_markov = bool(getattr(config, "confidence_head_with_markov", False))
                width = config.hidden_size + (config.markov_rank if with_markov else 0)
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
            kept = ((name, w) for name, w in weights if not any(s in name for s in skipped))
            return super().load_weights(kept)

    DSparkQwen3ForCausalLM.__module__ = __name__
    return DSparkQwen3ForCausalLM


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
