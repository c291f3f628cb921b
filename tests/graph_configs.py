"""A real VllmConfig with the compilation settings a CUDA platform would leave, for
tests of cudagraph-mode resolution on a CPU machine."""

from __future__ import annotations

from typing import Any


def cuda_like_config(mode: Any) -> Any:
    """A VllmConfig whose cudagraph mode is ``mode``, compiled by vLLM, capturing
    sizes 1-8: the CPU platform rewrites these, a CUDA platform would leave them."""
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.config.compilation import CompilationMode

    config = VllmConfig(compilation_config=CompilationConfig())
    compilation = config.compilation_config
    compilation.mode = CompilationMode.VLLM_COMPILE
    compilation.splitting_ops = list(compilation._attention_ops)
    compilation.cudagraph_capture_sizes = [1, 2, 4, 8]
    compilation.max_cudagraph_capture_size = 8
    compilation.cudagraph_mode = mode
    return config
