"""A DeepSeek-V4 checkpoint's DSpark stages as a draft model, built from the
release's own V4 blocks (``v4_blocks``), for releases that have V4 but no V4 draft
class (0.20-0.24).

The stages (``mtp.{s}.*``) are V4 decoder layers numbered past the target's, so
their attention is sliding-window only. Stage 0 also holds the context combiner
(``main_proj``, ``main_norm``: the target's taps to one row per position), the last
stage the head stack (``norm``, ``hc_head_*``, ``markov_head``). The embedding and
LM head are the target's (the V1 drafter shares them: the checkpoint's stages
have none). Weight names follow the target's own loading rules: a stage's layer
tensors are renamed to a target layer's and handed to the release's V4 loader.

The module imports vLLM's V4 model module on first use only (``stages_class``).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from vllm_v4_patches.dspark import v4_blocks

CLASS_NAME = "DSparkV4Stages"
MODEL_REFERENCE = f"{__name__}:{CLASS_NAME}"
STAGE_TENSOR = re.compile(r"mtp\.(\d+)\.(.+)")
# the stage tensors that are not a decoder layer's: the combiner and the head stack
DRAFT_LEVEL = (
    "main_proj.",
    "main_norm.",
    "norm.",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
    "markov_head.",
)
CONFIDENCE = "confidence_head."  # read by the drafter itself (v4_proposer)


def __getattr__(name: str) -> Any:
    if name == CLASS_NAME:
        return stages_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def stage_tensor_place(name: str) -> tuple[str, str] | None:
    """Where a checkpoint tensor goes: ``("layer", "layers.{s}.…")`` for a stage's
    decoder layer (its index among the stages), ``("draft", "…")`` for the combiner
    and head stack, None for the target's tensors and the confidence head."""
    match = STAGE_TENSOR.fullmatch(name)
    if match is None:
        return None
    stage, rest = int(match.group(1)), match.group(2)
    if rest.startswith(CONFIDENCE):
        return None
    if rest.startswith(DRAFT_LEVEL):
        return "draft", rest
    return "layer", f"layers.{stage}.{rest}"


def stage_count(config: Any, spec: Any) -> int:
    """The checkpoint's stage count: the draft config's ``n_mtp_layers`` (the
    stand-in route puts the local checkpoint's count there), else the spec's."""
    count = getattr(config, "n_mtp_layers", None) or spec.num_draft_layers
    if not count:
        raise ValueError(
            "dspark: n_mtp_layers: the DeepSeek-V4 checkpoint's DSpark stage count is "
            "not in its draft config; serve it from a local folder (its inference "
            "config and weights give the count)"
        )
    return int(count)


@functools.cache
def stages_class() -> type:
    import torch
    from torch import nn
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from vllm_v4_patches.dspark.checkpoint import draft_spec
    from vllm_v4_patches.dspark.draft_model import markov_head_class

    v4 = v4_blocks.installed_model_module()
    MarkovHead = markov_head_class()

    class StageStack(nn.Module):
        """The stages and their heads; borrows the release's V4 loader for the
        decoder layers (the names it reads are set here)."""

        load_layer_weights = v4.DeepseekV4Model.load_weights
        get_expert_mapping = v4.DeepseekV4Model.get_expert_mapping

        def __init__(self, vllm_config: Any, config: Any, prefix: str) -> None:
            super().__init__()
            spec = draft_spec(config)
            self.config = config
            self.quant_config = vllm_config.quant_config
            self.parallel_config = vllm_config.parallel_config
            self.hc_mult, self.hc_eps = config.hc_mult, config.hc_eps
            self.rms_norm_eps = config.rms_norm_eps
            hidden = config.hidden_size
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, hidden, prefix=f"{prefix}.embed_tokens"
            )
            self.main_proj = ReplicatedLinear(
                hidden * len(spec.target_layer_ids),
                hidden,
                bias=False,
                return_bias=False,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.main_proj",
            )
            self.main_norm = RMSNorm(hidden, eps=config.rms_norm_eps)
            # layer prefixes past the target's: their own caches, sliding window only
            first = config.num_hidden_layers
            layer_config = get_current_vllm_config()
            # three side streams for the input GEMMs, as the release's V4 model has
            aux_streams = [torch.cuda.Stream() for _ in range(3)]
            self.layers = nn.ModuleList(
                v4.DeepseekV4DecoderLayer(
                    layer_config,
                    prefix=f"{prefix}.layers.{first + i}",
                    aux_stream_list=aux_streams,
                )
                for i in range(stage_count(config, spec))
            )
            self.start_layer, self.end_layer = 0, len(self.layers)
            self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
            streams = self.hc_mult * hidden
            self.hc_head_fn = nn.Parameter(
                torch.empty(self.hc_mult, streams, dtype=torch.float32), requires_grad=False
            )
            self.hc_head_base = nn.Parameter(
                torch.empty(self.hc_mult, dtype=torch.float32), requires_grad=False
            )
            self.hc_head_scale = nn.Parameter(
                torch.empty(1, dtype=torch.float32), requires_grad=False
            )
            self.hc_head = v4_blocks.head_reduction(v4)
            self.markov_head = MarkovHead(config, spec, prefix=f"{prefix}.markov_head")
            self.confidence_head = None

        def forward(self, input_ids: Any, positions: Any, inputs_embeds: Any) -> Any:
            if inputs_embeds is None:
                inputs_embeds = self.embed_tokens(input_ids)
            streams = inputs_embeds.unsqueeze(-2).repeat(1, self.hc_mult, 1)
            streams = v4_blocks.run_layers(self.layers, streams, positions, input_ids)
            # the head hidden before the final norm: what the drafter's heads read
            return self.hc_head(
                streams,
                self.hc_head_fn,
                self.hc_head_scale,
                self.hc_head_base,
                self.rms_norm_eps,
                self.hc_eps,
            )

    for name in v4_blocks.LOADER_HELPERS:  # what the release's loader calls, if any
        if hasattr(v4.DeepseekV4Model, name):
            setattr(StageStack, name, getattr(v4.DeepseekV4Model, name))

    class DSparkV4Stages(nn.Module):
        """DeepSeek-V4's own DSpark stages on the V1 drafter (releases without
        vLLM's V4 draft class)."""

        has_own_embed_tokens = False
        has_own_lm_head = False
        draft_id_to_target_id = None

        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__()
            config = vllm_config.speculative_config.draft_model_config.hf_config
            self.config = config
            inner = f"{prefix}.model" if prefix else "model"
            self.model = StageStack(vllm_config, config, inner)
            head = f"{prefix}.lm_head" if prefix else "lm_head"
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=head)
            self.logits_processor = LogitsProcessor(config.vocab_size)

        def embed_input_ids(self, input_ids: Any) -> Any:
            return self.model.embed_tokens(input_ids)

        def combine_hidden_states(self, taps: Any) -> Any:
            return self.model.main_norm(self.model.main_proj(taps))

        def get_draft_kv_cache_layer_names(self) -> list[str]:
            return [v4_blocks.kv_owner(layer).swa_cache_layer.prefix for layer in self.model.layers]

        @torch.inference_mode()
        def precompute_and_store_context_kv(
            self, context: Any, positions: Any, slots_per_layer: list | None = None
        ) -> None:
            """Each stage's context K/V from the combined taps, at that stage's
            slots (None: the profile run, which projects without writing)."""
            for index, layer in enumerate(self.model.layers):
                attn = v4_blocks.kv_owner(layer)
                rows, _ = attn.fused_wqa_wkv(context)
                kv = attn.kv_norm(rows[..., attn.q_lora_rank :])
                slots = None if slots_per_layer is None else slots_per_layer[index]
                if slots is not None:
                    v4_blocks.write_context_kv(layer, kv, positions, slots)

        def forward(self, input_ids: Any, positions: Any, inputs_embeds: Any = None) -> Any:
            return self.model(input_ids, positions, inputs_embeds)

        def compute_logits(self, hidden_states: Any) -> Any:
            return self.logits_processor(self.lm_head, self.model.norm(hidden_states))

        def compute_draft_logits(self, hidden_states: Any) -> Any:
            return self.compute_logits(hidden_states)

        def map_draft_to_target(self, draft_ids: Any) -> Any:
            return draft_ids

        def markov_embed(self, token_ids: Any) -> Any:
            return self.model.markov_head.markov_w1(token_ids)

        def markov_bias(self, markov_embed: Any) -> Any:
            return self.logits_processor(self.model.markov_head.markov_w2, markov_embed)

        def load_weights(self, weights: Any) -> set[str]:
            mapper = self.target_mapper()
            layer_tensors, draft_tensors = [], []
            for name, tensor in weights:
                place = stage_tensor_place(name)
                if place is not None:
                    (layer_tensors if place[0] == "layer" else draft_tensors).append(
                        (place[1], tensor)
                    )
            # the target's rules (scale suffixes, expert and stacked names) on
            # target-style names; its mapper puts them under "model."
            mapped_layers = [
                (name.removeprefix("model."), tensor)
                for name, tensor in mapper.apply(layer_tensors)
            ]
            loaded = set(self.model.load_layer_weights(mapped_layers))
            parameters = dict(self.model.named_parameters())
            for name, tensor in mapper.apply(draft_tensors):
                local = name.removeprefix("model.")
                parameter = parameters[local]
                getattr(parameter, "weight_loader", default_weight_loader)(parameter, tensor)
                loaded.add(local)
            for layer in self.model.layers:
                layer.ffn.finalize_mega_moe_weights()
            return {f"model.{name}" for name in loaded}

        def target_mapper(self) -> Any:
            expert_dtype = getattr(self.config, "expert_dtype", "fp4")
            if expert_dtype == "fp4":
                return v4.DeepseekV4ForCausalLM.hf_to_vllm_mapper
            return v4._make_deepseek_v4_weights_mapper(expert_dtype)

    DSparkV4Stages.__module__ = __name__
    return DSparkV4Stages
