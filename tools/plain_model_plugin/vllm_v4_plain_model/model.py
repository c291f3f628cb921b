"""vLLM's Llama with its inner model excluded from torch.compile (imports vLLM)."""

from typing import Any

from vllm.compilation.decorators import ignore_torch_compile
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


@ignore_torch_compile
class PlainLlamaModel(LlamaModel):
    """LlamaModel run eagerly whatever the compilation mode."""


class PlainLlamaForCausalLM(LlamaForCausalLM):
    def _init_model(
        self, vllm_config: Any, prefix: str = "", layer_type: type = LlamaDecoderLayer
    ) -> PlainLlamaModel:
        return PlainLlamaModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
