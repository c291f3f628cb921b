"""vLLM cudagraph-mode facts two features read: whether breakable CUDA graphs are
on, and a mode without its piecewise half."""

from __future__ import annotations

from typing import Any


def without_piecewise(mode: Any) -> Any:
    """CUDAGraphMode.without_piecewise(), which only exists from vLLM 0.30."""
    from vllm.config.compilation import CUDAGraphMode

    if mode == CUDAGraphMode.PIECEWISE:
        return CUDAGraphMode.NONE
    if mode == CUDAGraphMode.FULL_AND_PIECEWISE:
        return CUDAGraphMode.FULL_DECODE_ONLY
    return mode


def breakable_cudagraphs_enabled() -> bool:
    """vLLM's breakable CUDA graphs (0.22+; turned on by vLLM itself for DeepSeek-V4
    from 0.23), read as vLLM reads them."""
    import vllm.envs as envs

    try:
        return bool(envs.VLLM_USE_BREAKABLE_CUDAGRAPH)
    except AttributeError:
        return False
