"""DSpark's sequential stage on the GPU: the Markov head and the confidence head.

After the parallel backbone has produced base logits for all N slots of a draft
block, DSpark picks the drafts left to right: slot k adds a rank-r bias that
depends on the token chosen at slot k-1 (the anchor for slot 0), then takes the
argmax (or a Gumbel-max sample). The confidence head scores each slot from the
backbone hidden state and the same Markov embedding (docs/dspark.md sections 2-3).

The work per slot is a [B, r] x [r, V] product plus an argmax over V. With
DeepSeek-V4-Flash sizes (V = 129280, r = 256) the bias weight is 66 MB of bf16,
so the stage is bound by reading that weight and the base logits once per slot.
The fused Triton path does exactly that read and keeps the [B, V] logits out of
memory: a tiled GEMM whose epilogue adds the base logits and keeps only each
tile's per-row (max, argmax). The tiles merge those into one packed 64-bit key per
row with an atomic max (value high, inverted index low, so ties go to the lowest
index as in torch.argmax), the next slot decodes its previous token from the keys,
and one last launch writes tokens and confidences: N + 2 launches (key fill, N
slots, finish). The K-loop kernel can instead keep per-tile partials and reduce
them in a small launch per slot (2 per slot). No host sync either way, so the
whole N-slot loop can be captured in one CUDA graph.

Three per-slot kernels (MarkovKernelConfig.kernel; pick_kernel takes the best the
GPU and inputs allow):
- 'gluon' (Hopper, 16-bit, the default at B > 16): persistent, one program per
  multiprocessor and row block; the row block's embeddings stay in shared memory
  while the program walks a contiguous run of 64-column V-tiles through a ring of
  bulk (TMA) copies, one whole-rank wgmma per tile seeded with the base logits. The
  schedule is written out in Gluon so that tile i's product overlaps the fold of
  tile i-1 and the refill of its stage; programmatic dependent launch lets each
  slot's kernel launch and fetch its first tiles while the previous slot drains.
- 'stream': the same walk in plain Triton (default at B <= 16, and where Gluon is
  missing). Triton waits for each product before the epilogue and puts CTA-wide
  barriers around every copy, so loads, products and epilogues serialise.
- 'k_loop': one program per (V-tile, row block), a K-looped GEMM (any CUDA GPU).

Measured on one H200 (DeepSeek-V4-Flash sizes, N = 5, bf16, CUDA graphs),
time/bound with bound = bytes / copy bandwidth: k_loop 1.27 (B=1), 1.34 (8),
1.40 (32), 1.49 (64), 1.69 (128), 2.14 (256); the defaults 1.16, 1.20, 1.22,
1.22, 1.32, 1.41 (benchmarks/dspark_markov_gpu.py has the table and what lost).

Nothing here imports torch or triton at module import: the overlay package is
imported by every interpreter start, so the heavy modules load on first call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from vllm_v4_patches.dspark.markov_kernel.config import (
    MarkovKernelConfig,
    default_config,
    gluon_available,
    pick_backend,
    pick_kernel,
    triton_available,
)
from vllm_v4_patches.dspark.markov_kernel.launch import (
    greedy_markov_draft_triton,
    sampled_markov_draft_triton,
)
from vllm_v4_patches.dspark.markov_kernel.reference import (
    anchor_in_table,
    greedy_markov_draft_reference,
    sampled_markov_draft_reference,
)

__all__ = [
    "MarkovKernelConfig",
    "anchor_in_table",
    "default_config",
    "gluon_available",
    "greedy_markov_draft",
    "greedy_markov_draft_reference",
    "greedy_markov_draft_triton",
    "pick_backend",
    "pick_kernel",
    "sampled_markov_draft",
    "sampled_markov_draft_reference",
    "sampled_markov_draft_triton",
    "triton_available",
]


def greedy_markov_draft(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy drafts and confidences of one DSpark block (vanilla Markov head).

    Shapes: base_logits [B, N, V], anchor [B] int64, markov_w1 [V, R] (embedding),
    markov_w2 [V, R] (weight of Linear(R, V)), hidden [B, N, H], confidence_w [H + R].
    Returns tokens [B, N] int64 and confidence [B, N] float32.
    """
    if pick_backend(base_logits) == "triton":
        return greedy_markov_draft_triton(
            base_logits, anchor, markov_w1, markov_w2, hidden, confidence_w
        )
    return greedy_markov_draft_reference(
        base_logits, anchor, markov_w1, markov_w2, hidden, confidence_w
    )


def sampled_markov_draft(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    temperature: torch.Tensor,
    gumbel_noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled drafts by Gumbel-max with per-row temperature, plus confidences.

    temperature [B] float32 (0 means greedy for that row); gumbel_noise [B, N, V]
    standard Gumbel samples, passed in so that a test can fix them. Slot k picks
    argmax(logits_k + temperature * noise_k), the same token as
    argmax(logits_k / temperature + noise_k) for temperature > 0, without a division.
    """
    if pick_backend(base_logits) == "triton":
        return sampled_markov_draft_triton(
            base_logits,
            anchor,
            markov_w1,
            markov_w2,
            hidden,
            confidence_w,
            temperature,
            gumbel_noise,
        )
    return sampled_markov_draft_reference(
        base_logits,
        anchor,
        markov_w1,
        markov_w2,
        hidden,
        confidence_w,
        temperature,
        gumbel_noise,
    )
