"""The fused Markov stage's kernel choice and launch options: which per-slot
kernel the GPU and inputs allow, its tile shape, and whether triton and Gluon are
there (looked up without importing them)."""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class MarkovKernelConfig:
    """Kernel choice, tile shape and launch options of the fused per-slot GEMM + argmax.

    kernel: which per-slot kernel runs (all three keep the [B, V] logits on chip):
        'gluon': persistent; each program keeps one row block's embeddings in shared
            memory and walks a contiguous run of V-tiles, whole rank per product, with
            bulk (TMA) copies into a ring of stages and the schedule written out in
            Gluon: tile i's product runs on the tensor cores while the warps fold tile
            i-1 and refill its stage. Hopper only; block_b / 16 warps.
        'stream': the same persistent walk in plain Triton, whose pipeliner waits for
            each product before the epilogue and refills stages after it.
        'k_loop': one program per (V-tile, row block) item, a K-looped GEMM; the
            programs of one V-tile run side by side and share that markov_w2 slice
            in L2. Any CUDA GPU, any dtype.
    tile_v: vocabulary columns per product; each yields one (max, argmax) per row.
    block_b: batch rows per program.
    block_k: rank slice per pipeline stage (k_loop; the persistent kernels take the
        whole rank).
    num_stages: software-pipeline depth (ring stages for the persistent kernels).
    atomic_argmax: programs merge their tile's best into one packed 64-bit key per
        row with an atomic max, and the next slot reads its token from there: no
        reduction launch between slots. Always on for the persistent kernels.
    prefetch_base: issue the base-logits load before the product (k_loop).
    alternate_direction: odd slots walk the V-tiles from the end, so they start on the
        part of markov_w2 the previous slot read last, which is still in L2.
    keep_weight_in_l2: load markov_w2 as evict-last and the logits as evict-first
        (k_loop; bulk copies take no such hint).
    programs_per_sm: programs of the persistent kernels per multiprocessor.
    pdl: programmatic dependent launch for the persistent kernels and the finish
        launch: each kernel launches while the previous one drains, and the Gluon
        kernel fetches its first tiles before waiting for the previous slot's keys.
    """

    tile_v: int = 128
    block_b: int = 16
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    atomic_argmax: bool = False
    prefetch_base: bool = False
    alternate_direction: bool = True
    keep_weight_in_l2: bool = True
    kernel: str = "k_loop"
    programs_per_sm: int = 1
    pdl: bool = False


def default_config(batch: int, kernel: str = "gluon") -> MarkovKernelConfig:
    """The tuned configuration for a batch size (H200, V = 129280, r = 256, bf16).

    kernel is the most capable kernel that the GPU and inputs allow (pick_kernel):
    'gluon' also picks 'stream' at batch <= 16, where that measured 1-3% faster.
    """
    if kernel == "gluon" and batch > 16:
        block_b = 64 if batch <= 64 else 128
        return MarkovKernelConfig(
            tile_v=64,
            block_b=block_b,
            block_k=256,
            num_warps=block_b // 16,
            num_stages=4 if block_b == 64 else 3,
            atomic_argmax=True,
            kernel="gluon",
            pdl=True,
        )
    if kernel in ("gluon", "stream"):
        if batch <= 16:
            shape = {"block_b": 16, "num_stages": 3, "programs_per_sm": 2, "pdl": False}
        elif batch <= 32:
            shape = {"block_b": 32, "num_stages": 5}
        elif batch <= 64:
            shape = {"block_b": 64, "num_stages": 3}
        else:
            shape = {"block_b": 128, "num_stages": 3, "num_warps": 8}
        options = {"tile_v": 64, "block_k": 256, "pdl": True, **shape}
        return MarkovKernelConfig(**options, atomic_argmax=True, kernel="stream")
    if batch <= 16:
        shape = {"tile_v": 256, "block_b": 16, "num_warps": 8}
    elif batch <= 32:
        shape = {"tile_v": 128, "block_b": 32, "num_warps": 4}
    elif batch <= 64:
        shape = {"tile_v": 128, "block_b": 64, "num_warps": 4}
    else:
        shape = {"tile_v": 128, "block_b": 128, "num_warps": 4}
    return MarkovKernelConfig(**shape, atomic_argmax=True, prefetch_base=True)


def pick_kernel(base_logits: torch.Tensor, markov_w2: torch.Tensor) -> str:
    """The most capable kernel for these CUDA inputs: 'gluon', 'stream' or 'k_loop'.

    The persistent kernels need Hopper's bulk copies and ~200 KB of shared memory a
    program, 16-bit logits and weights with the whole rank in one copy box
    (<= 256), and the 16-byte alignment of bases and row strides that copy
    descriptors need. The Gluon one also needs a power-of-two rank, one dtype for
    logits and weights, and Triton's Gluon front end.
    """
    import torch

    if torch.cuda.get_device_capability(base_logits.device) < (9, 0):
        return "k_loop"
    if base_logits.element_size() != 2 or markov_w2.element_size() != 2:
        return "k_loop"
    rank = markov_w2.shape[1]
    aligned = (
        base_logits.data_ptr() % 16 == 0
        and markov_w2.data_ptr() % 16 == 0
        and base_logits.stride(-1) == 1
        and all(base_logits.stride(dim) * 2 % 16 == 0 for dim in (0, 1))
        and base_logits.shape[-1] * 2 % 16 == 0
        and rank * 2 % 16 == 0
    )
    if not (aligned and rank <= 256):
        return "k_loop"
    if (
        gluon_available()
        and rank & (rank - 1) == 0
        and base_logits.dtype == markov_w2.dtype
        and markov_w2.dtype in (torch.bfloat16, torch.float16)
    ):
        return "gluon"
    return "stream"


@functools.cache
def triton_available() -> bool:
    """Whether triton can be imported, looked up once without importing it."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton has the Gluon front end with Hopper's copy and MMA ops."""
    try:
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
        import triton.experimental.gluon.nvidia.hopper  # noqa: F401
    except ImportError:
        return False
    return True


def pick_backend(base_logits: torch.Tensor) -> str:
    """'triton' for CUDA tensors when triton is installed, else 'torch' (the fallback)."""
    if base_logits.is_cuda and triton_available():
        return "triton"
    return "torch"
