"""Test-only vLLM plugin: ``PlainLlamaForCausalLM``, vLLM's Llama with no compiled
submodule, for the ``cudagraph`` patch's GPU case.

vLLM compiles a model through ``@support_torch_compile`` on its inner module; an
out-of-tree class whose inner module opts out (``@ignore_torch_compile``) is what
every plugin model without that decorator looks like to the runner: compilation
mode VLLM_COMPILE, yet nothing for piecewise CUDA graphs to capture. The weights
and tokens are the tiny Llama's, so its greedy output is comparable token for token.
"""

ARCHITECTURE = "PlainLlamaForCausalLM"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: runs in every vLLM process."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(
            ARCHITECTURE, "vllm_v4_plain_model.model:PlainLlamaForCausalLM"
        )
