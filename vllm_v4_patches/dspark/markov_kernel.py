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

import functools
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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


# ---------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# PyTorch reference (CPU fallback and correctness oracle)
# ---------------------------------------------------------------------------


def greedy_markov_draft_reference(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot-by-slot PyTorch version of greedy_markov_draft, all arithmetic in fp32."""
    return _draft_reference(base_logits, anchor, markov_w1, markov_w2, hidden, confidence_w)


def sampled_markov_draft_reference(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    temperature: torch.Tensor,
    gumbel_noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot-by-slot PyTorch version of sampled_markov_draft, all arithmetic in fp32."""
    return _draft_reference(
        base_logits,
        anchor,
        markov_w1,
        markov_w2,
        hidden,
        confidence_w,
        temperature,
        gumbel_noise,
    )


def anchor_in_table(anchor: torch.Tensor, markov_w1: torch.Tensor) -> torch.Tensor:
    """The anchors as row indices of ``markov_w1``: an id outside the table reads the
    nearest row.

    Under async scheduling vLLM hands the drafter -1 as the next token of a request
    whose sampled tokens it discards this step (the token is not on the host yet);
    that request's drafts are dropped, but the kernels gather by this id unchecked,
    and a row before the table is an illegal address. One clamp on the device, no
    synchronisation.
    """
    return anchor.clamp(0, markov_w1.shape[0] - 1)


def _draft_reference(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    temperature: torch.Tensor | None = None,
    gumbel_noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    batch, num_slots, _ = base_logits.shape
    anchor = anchor_in_table(anchor, markov_w1)
    # fp32 weights: bf16 products are exact in fp32, so only the summation order
    # separates this from the kernel's fp32-accumulating tensor-core product.
    w2_t = markov_w2.float().t()
    weight = confidence_w.float()
    tokens = torch.empty(batch, num_slots, dtype=torch.int64, device=base_logits.device)
    confidence = torch.empty(batch, num_slots, dtype=torch.float32, device=base_logits.device)
    prev = anchor
    for slot in range(num_slots):
        embedding = markov_w1[prev].float()
        logits = base_logits[:, slot].float() + embedding @ w2_t
        if gumbel_noise is not None:
            logits = logits + gumbel_noise[:, slot].float() * temperature.float()[:, None]
        tokens[:, slot] = logits.argmax(dim=-1)
        features = torch.cat([hidden[:, slot].float(), embedding], dim=-1)
        confidence[:, slot] = torch.sigmoid(features @ weight)
        prev = tokens[:, slot]
    return tokens, confidence


# ---------------------------------------------------------------------------
# Fused Triton path
# ---------------------------------------------------------------------------


def greedy_markov_draft_triton(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    config: MarkovKernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_markov_draft on CUDA tensors: 2 kernel launches per slot, no host sync."""
    return _draft_triton(
        base_logits, anchor, markov_w1, markov_w2, hidden, confidence_w, None, None, config
    )


def sampled_markov_draft_triton(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    temperature: torch.Tensor,
    gumbel_noise: torch.Tensor,
    config: MarkovKernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sampled_markov_draft on CUDA tensors: the noise is read in the GEMM epilogue."""
    return _draft_triton(
        base_logits,
        anchor,
        markov_w1,
        markov_w2,
        hidden,
        confidence_w,
        temperature,
        gumbel_noise,
        config,
    )


def _next_power_of_2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


# One packed key per row and slot, padded to its own 128-byte line so that the
# atomics of different rows do not queue on one L2 line.
_KEY_STRIDE = 16
_KEY_EMPTY = -(2**63)


def _draft_triton(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    temperature: torch.Tensor | None,
    gumbel_noise: torch.Tensor | None,
    config: MarkovKernelConfig | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    kernels = _build_kernels()
    batch, num_slots, vocab = base_logits.shape
    anchor = anchor_in_table(anchor, markov_w1)
    # The kernels index the last dimension of these with unit stride.
    markov_w1 = markov_w1.contiguous()
    markov_w2 = markov_w2.contiguous()
    config = config or default_config(batch, pick_kernel(base_logits, markov_w2))
    confidence_w = confidence_w.contiguous()
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()

    device = base_logits.device
    tokens = torch.empty(batch, num_slots, dtype=torch.int64, device=device)
    confidence = torch.empty(batch, num_slots, dtype=torch.float32, device=device)
    num_tiles = -(-vocab // config.tile_v)
    if config.atomic_argmax or config.kernel != "k_loop":
        keys = torch.full(
            (num_slots, batch, _KEY_STRIDE), _KEY_EMPTY, dtype=torch.int64, device=device
        )
        partial_max = partial_index = None
    else:
        keys = None
        partial_max = torch.empty(batch, num_tiles, dtype=torch.float32, device=device)
        partial_index = torch.empty(batch, num_tiles, dtype=torch.int32, device=device)

    for slot in range(num_slots):
        if slot == 0:
            prev, prev_from_keys = anchor, False
        elif keys is not None:
            prev, prev_from_keys = keys[slot - 1, :, 0], True
        else:
            prev, prev_from_keys = tokens[:, slot - 1], False
        slot_inputs = (base_logits, temperature, gumbel_noise, prev, prev_from_keys)
        if config.kernel == "gluon":
            _launch_gluon_stream(config, slot, *slot_inputs, markov_w1, markov_w2, keys[slot])
        elif config.kernel == "stream":
            _launch_stream_argmax(
                kernels, config, slot, *slot_inputs, markov_w1, markov_w2, keys[slot]
            )
        else:
            _launch_tile_argmax(
                kernels,
                config,
                slot,
                *slot_inputs,
                markov_w1,
                markov_w2,
                partial_max,
                partial_index,
                None if keys is None else keys[slot],
            )
        if keys is None:
            _launch_finish_slot(
                kernels,
                slot,
                partial_max,
                partial_index,
                prev,
                markov_w1,
                hidden,
                confidence_w,
                tokens,
                confidence,
            )
    if keys is not None:
        _launch_finish_block(
            kernels, keys, anchor, markov_w1, hidden, confidence_w, tokens, confidence, config.pdl
        )
    return tokens, confidence


def _launch_tile_argmax(
    kernels: _Kernels,
    config: MarkovKernelConfig,
    slot: int,
    base_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    gumbel_noise: torch.Tensor | None,
    prev: torch.Tensor,
    prev_from_keys: bool,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    partial_max: torch.Tensor | None,
    partial_index: torch.Tensor | None,
    slot_keys: torch.Tensor | None,
) -> None:
    import torch

    batch, _, vocab = base_logits.shape
    rank = markov_w2.shape[1]
    num_tiles = -(-vocab // config.tile_v)
    use_noise = gumbel_noise is not None
    slot_logits = base_logits[:, slot]
    # Unused pointer arguments still need a tensor; the logits stand in.
    slot_noise = gumbel_noise[:, slot] if use_noise else slot_logits
    row_temperature = temperature.float() if use_noise else slot_logits
    outputs = (
        (slot_keys, slot_keys, slot_keys.stride(0))
        if slot_keys is not None
        else (partial_max, partial_index, partial_max.stride(0))
    )
    rank_block = max(16, _next_power_of_2(rank))
    common = dict(
        TILE_V=config.tile_v,
        BLOCK_B=config.block_b,
        USE_NOISE=use_noise,
        PREV_FROM_KEYS=prev_from_keys,
        ATOMIC=config.atomic_argmax,
        W2_EVICTION="evict_last" if config.keep_weight_in_l2 else "",
        STREAM_EVICTION="evict_first" if config.keep_weight_in_l2 else "",
        DOT_PRECISION="ieee" if markov_w2.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    args = (
        slot_logits,
        slot_logits.stride(0),
        slot_logits.stride(1),
        slot_noise,
        slot_noise.stride(0),
        slot_noise.stride(1),
        row_temperature,
        prev,
        prev.stride(0),
        markov_w1,
        markov_w1.stride(0),
        markov_w2,
        markov_w2.stride(0),
        *outputs,
        batch,
        vocab,
        rank,
        int(config.alternate_direction and slot % 2 == 1),
    )
    num_row_blocks = -(-batch // config.block_b)
    kernels.tile_argmax[(num_tiles * num_row_blocks,)](
        *args,
        num_tiles,
        num_row_blocks,
        BLOCK_K=min(config.block_k, rank_block),
        PREFETCH_BASE=config.prefetch_base,
        **common,
    )


@functools.cache
@functools.cache
def _sm_count(device_index: int) -> int:
    """Multiprocessors of a CUDA device, read once (the persistent grids' size)."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch_stream_argmax(
    kernels: _Kernels,
    config: MarkovKernelConfig,
    slot: int,
    base_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    gumbel_noise: torch.Tensor | None,
    prev: torch.Tensor,
    prev_from_keys: bool,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    slot_keys: torch.Tensor,
) -> None:
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, _, vocab = base_logits.shape
    rank = markov_w2.shape[1]
    rank_block = max(16, _next_power_of_2(rank))
    num_tiles = -(-vocab // config.tile_v)
    programs, tiles_per_program, num_row_blocks = _stream_grid(
        config, batch, num_tiles, base_logits.device
    )
    slot_logits = base_logits[:, slot]
    use_noise = gumbel_noise is not None
    slot_noise = gumbel_noise[:, slot] if use_noise else slot_logits
    row_temperature = temperature.float() if use_noise else slot_logits
    # The pipeliner stages the noise tiles in shared memory too: at 128 rows three
    # stages of fp32 noise overflow it, two fit.
    num_stages = config.num_stages if not use_noise or config.block_b < 128 else 2
    kernels.stream_argmax[(programs,)](
        TensorDescriptor.from_tensor(slot_logits, [config.block_b, config.tile_v]),
        slot_noise,
        slot_noise.stride(0),
        slot_noise.stride(1),
        row_temperature,
        prev,
        prev.stride(0),
        markov_w1,
        markov_w1.stride(0),
        TensorDescriptor.from_tensor(markov_w2, [config.tile_v, rank_block]),
        slot_keys,
        slot_keys.stride(0),
        batch,
        vocab,
        rank,
        int(config.alternate_direction and slot % 2 == 1),
        num_tiles,
        tiles_per_program,
        num_row_blocks,
        TILE_V=config.tile_v,
        BLOCK_B=config.block_b,
        BLOCK_R=rank_block,
        USE_NOISE=use_noise,
        PREV_FROM_KEYS=prev_from_keys,
        NUM_STAGES=num_stages,
        USE_PDL=config.pdl,
        STREAM_EVICTION="evict_first" if config.keep_weight_in_l2 else "",
        DOT_PRECISION="ieee" if markov_w2.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=num_stages,
        launch_pdl=config.pdl,
    )


def _stream_grid(
    config: MarkovKernelConfig, batch: int, num_tiles: int, device: torch.device
) -> tuple[int, int, int]:
    """(programs, tiles per program, row blocks): about programs_per_sm programs per
    multiprocessor, each walking one contiguous run of V-tiles for one row block."""
    num_row_blocks = -(-batch // config.block_b)
    programs = _sm_count(device.index or 0) * config.programs_per_sm
    chunks = max(1, programs // num_row_blocks)
    tiles_per_program = -(-num_tiles // chunks)
    chunks = -(-num_tiles // tiles_per_program)
    return chunks * num_row_blocks, tiles_per_program, num_row_blocks


def _launch_gluon_stream(
    config: MarkovKernelConfig,
    slot: int,
    base_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    gumbel_noise: torch.Tensor | None,
    prev: torch.Tensor,
    prev_from_keys: bool,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    slot_keys: torch.Tensor,
) -> None:
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    kernel = _build_gluon_kernels()
    batch, _, vocab = base_logits.shape
    rank = markov_w2.shape[1]
    num_tiles = -(-vocab // config.tile_v)
    programs, tiles_per_program, num_row_blocks = _stream_grid(
        config, batch, num_tiles, base_logits.device
    )
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[markov_w2.dtype]
    slot_logits = base_logits[:, slot]
    w2_block = [config.tile_v, rank]
    base_block = [config.block_b, config.tile_v]
    w2_desc = TensorDescriptor.from_tensor(
        markov_w2, w2_block, gl.NVMMASharedLayout.get_default_for(w2_block, element)
    )
    base_desc = TensorDescriptor.from_tensor(
        slot_logits, base_block, gl.NVMMASharedLayout.get_default_for(base_block, element)
    )
    use_noise = gumbel_noise is not None
    slot_noise = gumbel_noise[:, slot] if use_noise else slot_logits
    row_temperature = temperature.float() if use_noise else slot_logits
    if use_noise and slot_noise.stride(-1) != 1:
        slot_noise = slot_noise.contiguous()
    num_warps = config.block_b // 16
    kernel[(programs,)](
        base_desc,
        w2_desc,
        slot_noise,
        slot_noise.stride(0),
        row_temperature,
        prev,
        prev.stride(0),
        markov_w1,
        markov_w1.stride(0),
        slot_keys,
        slot_keys.stride(0),
        batch,
        vocab,
        int(config.alternate_direction and slot % 2 == 1),
        num_tiles,
        tiles_per_program,
        num_row_blocks,
        TILE_V=config.tile_v,
        BLOCK_B=config.block_b,
        RANK=rank,
        STAGES=config.num_stages,
        NUM_WARPS=num_warps,
        USE_NOISE=use_noise,
        PREV_FROM_KEYS=prev_from_keys,
        USE_PDL=config.pdl,
        num_warps=num_warps,
        launch_pdl=config.pdl,
    )


def _launch_finish_slot(
    kernels: _Kernels,
    slot: int,
    partial_max: torch.Tensor,
    partial_index: torch.Tensor,
    prev: torch.Tensor,
    markov_w1: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    tokens: torch.Tensor,
    confidence: torch.Tensor,
) -> None:
    batch, num_tiles = partial_max.shape
    slot_hidden = hidden[:, slot]
    kernels.finish_slot[(batch,)](
        partial_max,
        partial_index,
        partial_max.stride(0),
        num_tiles,
        prev,
        prev.stride(0),
        markov_w1,
        markov_w1.stride(0),
        slot_hidden,
        slot_hidden.stride(0),
        confidence_w,
        tokens[:, slot],
        tokens.stride(0),
        confidence[:, slot],
        confidence.stride(0),
        hidden.shape[-1],
        markov_w1.shape[1],
        BLOCK_TILES=_next_power_of_2(num_tiles),
        BLOCK_RANK=_next_power_of_2(markov_w1.shape[1]),
        BLOCK_H=min(1024, _next_power_of_2(hidden.shape[-1])),
        num_warps=4,
    )


def _launch_finish_block(
    kernels: _Kernels,
    keys: torch.Tensor,
    anchor: torch.Tensor,
    markov_w1: torch.Tensor,
    hidden: torch.Tensor,
    confidence_w: torch.Tensor,
    tokens: torch.Tensor,
    confidence: torch.Tensor,
    pdl: bool,
) -> None:
    batch, num_slots = tokens.shape
    kernels.finish_block[(batch,)](
        keys,
        keys.stride(0),
        keys.stride(1),
        anchor,
        anchor.stride(0),
        markov_w1,
        markov_w1.stride(0),
        hidden,
        hidden.stride(0),
        hidden.stride(1),
        confidence_w,
        tokens,
        tokens.stride(0),
        confidence,
        confidence.stride(0),
        num_slots,
        hidden.shape[-1],
        markov_w1.shape[1],
        BLOCK_RANK=_next_power_of_2(markov_w1.shape[1]),
        BLOCK_H=min(1024, _next_power_of_2(hidden.shape[-1])),
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )


@functools.cache
def _build_gluon_kernels() -> Any:
    """The Gluon stream kernel for Hopper, defined once (compiled on first launch).

    Gluon is Triton's lower-level front end: layouts, shared memory, bulk copies,
    mbarriers and asynchronous warpgroup MMAs are written out, not inferred.
    """
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    @gluon.jit
    def issue_tile(
        step,
        first,
        count,
        reverse_tiles,
        row0,
        w2_desc,
        base_desc,
        w2_smem,
        base_smem,
        ready,
        TILE_V,
        STAGES,
    ):
        """Bulk-copy tile `step` of this program's run (W2 slice and base logits) into
        its ring stage; nothing when the run is shorter."""
        stage = step % STAGES
        tile = first + step + reverse_tiles * (count - 1 - 2 * step)
        pred = step < count
        bar = ready.index(stage)
        mbarrier.expect(bar, w2_desc.block_type.nbytes + base_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(
            w2_desc, [tile * TILE_V, 0], bar, w2_smem.index(stage), pred=pred
        )
        tma.async_copy_global_to_shared(
            base_desc, [row0, tile * TILE_V], bar, base_smem.index(stage), pred=pred
        )

    @gluon.jit
    def fold_tile(
        logits,
        tile,
        best,
        rows,
        row_ok,
        col_offsets,
        vocab,
        noise_ptr,
        noise_stride_b,
        temperature_ptr,
        TILE_V,
        USE_NOISE,
    ):
        """max(best, packed key of this tile's best column) per row."""
        cols = tile * TILE_V + col_offsets
        col_ok = cols < vocab
        if USE_NOISE:
            temperature = gl.load(temperature_ptr + rows, mask=row_ok, other=0.0)
            noise = gl.load(
                noise_ptr + rows.to(gl.int64)[:, None] * noise_stride_b + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            logits = logits + noise.to(gl.float32) * temperature[:, None]
        logits = gl.where(col_ok[None, :], logits, float("-inf"))
        value = gl.max(logits, axis=1)
        # The lowest column among equal maxima, as torch.argmax picks.
        col = gl.min(gl.where(logits == value[:, None], col_offsets[None, :], TILE_V), axis=1)
        bits = value.to(gl.int32, bitcast=True)
        ordered = gl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        index = tile * TILE_V + col
        key = (ordered.to(gl.int64) << 32) + (2147483647 - index).to(gl.int64)
        return gl.maximum(best, key)

    @gluon.jit
    def gluon_stream_argmax(
        base_desc,
        w2_desc,
        noise_ptr,
        noise_stride_b,
        temperature_ptr,
        prev_ptr,
        prev_stride,
        w1_ptr,
        w1_stride_v,
        keys_ptr,
        keys_stride,
        batch,
        vocab,
        reverse_tiles,
        num_tiles,
        tiles_per_program,
        num_row_blocks,
        TILE_V: gl.constexpr,
        BLOCK_B: gl.constexpr,
        RANK: gl.constexpr,
        STAGES: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        USE_NOISE: gl.constexpr,
        PREV_FROM_KEYS: gl.constexpr,
        USE_PDL: gl.constexpr,
    ):
        """The stream kernel with its schedule written out.

        A ring of STAGES bulk-copied (W2 slice, base logits) tiles; the product of
        tile i is issued asynchronously and runs on the tensor cores while the warps
        fold tile i-1 into the running keys and refill its stage. Plain Triton waits
        for each product before its epilogue and refills after it, and a CTA-wide
        barrier around each copy then serialises loads, products and epilogues.
        """
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, TILE_V, 16]
        )
        gather_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0])
        emb_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [BLOCK_B, RANK], w2_desc.dtype
        )
        emb_smem = gl.allocate_shared_memory(w2_desc.dtype, [BLOCK_B, RANK], emb_layout)
        w2_smem = gl.allocate_shared_memory(w2_desc.dtype, [STAGES, TILE_V, RANK], w2_desc.layout)
        base_smem = gl.allocate_shared_memory(
            base_desc.dtype, [STAGES, BLOCK_B, TILE_V], base_desc.layout
        )
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for ring_stage in gl.static_range(STAGES):
            mbarrier.init(ready.index(ring_stage), count=1)
        gl.thread_barrier()

        pid = gl.program_id(0)
        row_block = pid % num_row_blocks
        first = (pid // num_row_blocks) * tiles_per_program
        count = gl.minimum(tiles_per_program, num_tiles - first)
        row0 = row_block * BLOCK_B
        # The tiles do not depend on the previous slot: fetch them before waiting for it.
        for prologue_step in gl.static_range(STAGES):
            issue_tile(
                prologue_step,
                first,
                count,
                reverse_tiles,
                row0,
                w2_desc,
                base_desc,
                w2_smem,
                base_smem,
                ready,
                TILE_V,
                STAGES,
            )
        if USE_PDL:
            gl.inline_asm_elementwise(
                "griddepcontrol.launch_dependents; // $0", "=r", [], gl.int32, False, 1
            )
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], gl.int32, False, 1)

        # Embeddings of the previous tokens, gathered once into shared memory.
        g_rows = row0 + gl.arange(0, BLOCK_B, layout=gl.SliceLayout(1, gather_layout))
        g_row_ok = g_rows < batch
        prev = gl.load(prev_ptr + g_rows.to(gl.int64) * prev_stride, mask=g_row_ok, other=0)
        if PREV_FROM_KEYS:  # the token is the packed key's low half, inverted
            prev = 2147483647 - (prev - ((prev >> 32) << 32))
        # Rows past the batch gather row 0 of markov_w1; their keys are not stored.
        prev = gl.where(g_row_ok, prev, 0).to(gl.int64)
        ranks = gl.arange(0, RANK, layout=gl.SliceLayout(0, gather_layout))
        emb = gl.load(w1_ptr + prev[:, None] * w1_stride_v + ranks[None, :])
        emb_smem.store(emb)
        fence_async_shared()
        gl.thread_barrier()

        rows = row0 + gl.arange(0, BLOCK_B, layout=gl.SliceLayout(1, acc_layout))
        row_ok = rows < batch
        col_offsets = gl.arange(0, TILE_V, layout=gl.SliceLayout(0, acc_layout))
        best = gl.full([BLOCK_B], -9223372036854775807 - 1, gl.int64, gl.SliceLayout(1, acc_layout))

        # Tile 0 alone; then each step issues tile `step` and folds tile step - 1.
        mbarrier.wait(ready.index(0), 0)
        base = base_smem.index(0).load(acc_layout).to(gl.float32)
        acc = warpgroup_mma(emb_smem, w2_smem.index(0).permute((1, 0)), base, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        tile_prev = first + reverse_tiles * (count - 1)
        for step in range(1, count):
            stage = step % STAGES
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            base = base_smem.index(stage).load(acc_layout).to(gl.float32)
            # The base logits seed the fp32 accumulator.
            acc_next = warpgroup_mma(
                emb_smem, w2_smem.index(stage).permute((1, 0)), base, is_async=True
            )
            best = fold_tile(
                acc,
                tile_prev,
                best,
                rows,
                row_ok,
                col_offsets,
                vocab,
                noise_ptr,
                noise_stride_b,
                temperature_ptr,
                TILE_V,
                USE_NOISE,
            )
            # Every warpgroup has retired the product of step - 1: its stage is free.
            gl.thread_barrier()
            issue_tile(
                step - 1 + STAGES,
                first,
                count,
                reverse_tiles,
                row0,
                w2_desc,
                base_desc,
                w2_smem,
                base_smem,
                ready,
                TILE_V,
                STAGES,
            )
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc_next])
            tile_prev = first + step + reverse_tiles * (count - 1 - 2 * step)
        best = fold_tile(
            acc,
            tile_prev,
            best,
            rows,
            row_ok,
            col_offsets,
            vocab,
            noise_ptr,
            noise_stride_b,
            temperature_ptr,
            TILE_V,
            USE_NOISE,
        )
        gl.atomic_max(keys_ptr + rows.to(gl.int64) * keys_stride, best, mask=row_ok, sem="relaxed")

    return gluon_stream_argmax


@dataclass(frozen=True)
class _Kernels:
    tile_argmax: Any
    stream_argmax: Any
    finish_slot: Any
    finish_block: Any


@functools.cache
def _build_kernels() -> _Kernels:
    """Defines the jitted kernels once per process (each compiles on first launch)."""
    import triton
    import triton.language as tl
    from triton.language.extra import cuda as tl_cuda

    @triton.jit
    def chain_launch(USE_PDL):
        """Programmatic dependent launch: let the next kernel launch now (its programs
        take the multiprocessors as ours leave), then wait until the previous kernel
        has finished and its writes are visible."""
        if USE_PDL:
            tl_cuda.gdc_launch_dependents()
            tl_cuda.gdc_wait()

    @triton.jit
    def load_prev(prev_ptr, prev_stride, rows64, row_ok, PREV_FROM_KEYS: tl.constexpr):
        """Previous tokens of these rows: the anchor/token ids, or decoded packed keys."""
        if PREV_FROM_KEYS:
            key = tl.load(prev_ptr + rows64 * prev_stride, mask=row_ok, other=0)
            prev = decode_key(key)
        else:
            prev = tl.load(prev_ptr + rows64 * prev_stride, mask=row_ok, other=0)
        # Rows past the batch gather row 0 of markov_w1; their results are dropped.
        return tl.where(row_ok, prev, 0).to(tl.int64)

    @triton.jit
    def decode_key(key):
        low = key - ((key >> 32) << 32)
        return 2147483647 - low

    @triton.jit
    def tile_key(logits, tile, TILE_V: tl.constexpr):
        """Per-row packed key of the tile's best column: its order is (value, -index)."""
        # Lowest column among equal maxima, as torch.argmax does.
        best, best_col = tl.max(logits, axis=1, return_indices=True)
        return pack_key(best, tile * TILE_V + best_col)

    @triton.jit
    def pack_key(value, index):
        """Sign-magnitude float bits made monotone in the high half, 2^31-1-index in
        the low half: key order is (value, -index) order."""
        bits = value.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return (ordered.to(tl.int64) << 32) + (2147483647 - index).to(tl.int64)

    @triton.jit
    def store_tile_best(
        logits,
        rows64,
        row_ok,
        tile,
        out_a_ptr,
        out_b_ptr,
        out_stride,
        TILE_V: tl.constexpr,
        ATOMIC: tl.constexpr,
    ):
        """Publish this tile's per-row best: as partials, or merged into a packed key."""
        if ATOMIC:
            key = tile_key(logits, tile, TILE_V)
            tl.atomic_max(out_a_ptr + rows64 * out_stride, key, mask=row_ok, sem="relaxed")
        else:
            # Lowest column among equal maxima, as torch.argmax does.
            best, best_col = tl.max(logits, axis=1, return_indices=True)
            index = tile * TILE_V + best_col
            tl.store(out_a_ptr + rows64 * out_stride + tile, best, mask=row_ok)
            tl.store(out_b_ptr + rows64 * out_stride + tile, index, mask=row_ok)

    @triton.jit
    def tile_logits(
        logits,
        rows64,
        row_ok,
        cols,
        col_ok,
        noise_ptr,
        noise_stride_b,
        noise_stride_v,
        temperature_ptr,
        USE_NOISE: tl.constexpr,
        STREAM_EVICTION: tl.constexpr,
    ):
        if USE_NOISE:
            temperature = tl.load(temperature_ptr + rows64, mask=row_ok, other=0.0)
            noise = tl.load(
                noise_ptr + rows64[:, None] * noise_stride_b + cols[None, :] * noise_stride_v,
                mask=row_ok[:, None] & col_ok[None, :],
                other=0.0,
                eviction_policy=STREAM_EVICTION,
            )
            logits = logits + noise.to(tl.float32) * temperature[:, None]
        return tl.where(col_ok[None, :], logits, float("-inf"))

    @triton.jit
    def tile_argmax(
        logits_ptr,
        logits_stride_b,
        logits_stride_v,
        noise_ptr,
        noise_stride_b,
        noise_stride_v,
        temperature_ptr,
        prev_ptr,
        prev_stride,
        w1_ptr,
        w1_stride_v,
        w2_ptr,
        w2_stride_v,
        out_a_ptr,
        out_b_ptr,
        out_stride,
        batch,
        vocab,
        rank,
        reverse_tiles,
        num_tiles,
        num_row_blocks,
        TILE_V: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_K: tl.constexpr,
        USE_NOISE: tl.constexpr,
        PREV_FROM_KEYS: tl.constexpr,
        ATOMIC: tl.constexpr,
        PREFETCH_BASE: tl.constexpr,
        W2_EVICTION: tl.constexpr,
        STREAM_EVICTION: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """K-looped GEMM + tile argmax over (V-tile, row block) items, row block fastest.

        Row blocks vary fastest so the programs sharing a V-tile run together and
        fetch that slice of markov_w2 from HBM once, the others hitting L2.
        """
        pid = tl.program_id(0)
        tile = pid // num_row_blocks
        row_block = pid % num_row_blocks
        if reverse_tiles:
            tile = num_tiles - 1 - tile
        rows64 = (row_block * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
        cols = tile * TILE_V + tl.arange(0, TILE_V)
        row_ok = rows64 < batch
        col_ok = cols < vocab
        logits_ptrs = (
            logits_ptr + rows64[:, None] * logits_stride_b + cols[None, :] * logits_stride_v
        )
        out_ok = row_ok[:, None] & col_ok[None, :]
        if PREFETCH_BASE:
            base = tl.load(logits_ptrs, mask=out_ok, other=0.0, eviction_policy=STREAM_EVICTION)

        prev = load_prev(prev_ptr, prev_stride, rows64, row_ok, PREV_FROM_KEYS)
        k_offsets = tl.arange(0, BLOCK_K)
        emb_ptrs = w1_ptr + prev[:, None] * w1_stride_v + k_offsets[None, :]
        w2_ptrs = w2_ptr + cols.to(tl.int64)[None, :] * w2_stride_v + k_offsets[:, None]
        bias = tl.zeros((BLOCK_B, TILE_V), dtype=tl.float32)
        for k_start in range(0, rank, BLOCK_K):
            k_ok = (k_start + k_offsets) < rank
            emb = tl.load(emb_ptrs + k_start, mask=k_ok[None, :], other=0.0)
            w2_slice = tl.load(
                w2_ptrs + k_start,
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
                eviction_policy=W2_EVICTION,
            )
            bias = tl.dot(emb, w2_slice, bias, input_precision=DOT_PRECISION)

        if not PREFETCH_BASE:
            base = tl.load(logits_ptrs, mask=out_ok, other=0.0, eviction_policy=STREAM_EVICTION)
        logits = tile_logits(
            base.to(tl.float32) + bias,
            rows64,
            row_ok,
            cols,
            col_ok,
            noise_ptr,
            noise_stride_b,
            noise_stride_v,
            temperature_ptr,
            USE_NOISE,
            STREAM_EVICTION,
        )
        store_tile_best(
            logits, rows64, row_ok, tile, out_a_ptr, out_b_ptr, out_stride, TILE_V, ATOMIC
        )

    @triton.jit
    def stream_argmax(
        logits_desc,
        noise_ptr,
        noise_stride_b,
        noise_stride_v,
        temperature_ptr,
        prev_ptr,
        prev_stride,
        w1_ptr,
        w1_stride_v,
        w2_desc,
        keys_ptr,
        keys_stride,
        batch,
        vocab,
        rank,
        reverse_tiles,
        num_tiles,
        tiles_per_program,
        num_row_blocks,
        TILE_V: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_R: tl.constexpr,
        USE_NOISE: tl.constexpr,
        PREV_FROM_KEYS: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        USE_PDL: tl.constexpr,
        STREAM_EVICTION: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Persistent: one row block's embeddings stay on chip while the program walks
        a contiguous run of V-tiles, one whole-rank product per tile fed by bulk
        copies, keeping a running best key per row and publishing it with one atomic.
        """
        chain_launch(USE_PDL)
        pid = tl.program_id(0)
        row_block = pid % num_row_blocks
        first = (pid // num_row_blocks) * tiles_per_program
        count = tl.minimum(tiles_per_program, num_tiles - first)
        rows64 = (row_block * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
        row_ok = rows64 < batch
        prev = load_prev(prev_ptr, prev_stride, rows64, row_ok, PREV_FROM_KEYS)
        ranks = tl.arange(0, BLOCK_R)
        emb = tl.load(
            w1_ptr + prev[:, None] * w1_stride_v + ranks[None, :],
            mask=(ranks < rank)[None, :],
            other=0.0,
        )
        best = tl.full([BLOCK_B], -9223372036854775807 - 1, tl.int64)
        for step in tl.range(0, count, num_stages=NUM_STAGES):
            tile = first + step + reverse_tiles * (count - 1 - 2 * step)
            cols = tile * TILE_V + tl.arange(0, TILE_V)
            w2_slice = w2_desc.load([tile * TILE_V, 0]).T
            base = logits_desc.load([row_block * BLOCK_B, tile * TILE_V])
            # The base logits seed the fp32 accumulator.
            logits = tl.dot(emb, w2_slice, base.to(tl.float32), input_precision=DOT_PRECISION)
            logits = tile_logits(
                logits,
                rows64,
                row_ok,
                cols,
                cols < vocab,
                noise_ptr,
                noise_stride_b,
                noise_stride_v,
                temperature_ptr,
                USE_NOISE,
                STREAM_EVICTION,
            )
            best = tl.maximum(best, tile_key(logits, tile, TILE_V))
        tl.atomic_max(keys_ptr + rows64 * keys_stride, best, mask=row_ok, sem="relaxed")

    @triton.jit
    def confidence_score(
        row,
        prev,
        w1_ptr,
        w1_stride_v,
        hidden_row_ptr,
        confidence_w_ptr,
        hidden_size,
        rank,
        BLOCK_RANK: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """sigmoid(w . [hidden_k ; markov_w1[prev_k]]) in fp32, as DSV4 evaluates it."""
        ranks = tl.arange(0, BLOCK_RANK)
        rank_ok = ranks < rank
        emb = tl.load(w1_ptr + prev * w1_stride_v + ranks, mask=rank_ok, other=0.0)
        emb_w = tl.load(confidence_w_ptr + hidden_size + ranks, mask=rank_ok, other=0.0)
        score = tl.sum(emb.to(tl.float32) * emb_w.to(tl.float32), axis=0)
        for h_start in range(0, hidden_size, BLOCK_H):
            h = h_start + tl.arange(0, BLOCK_H)
            h_ok = h < hidden_size
            features = tl.load(hidden_row_ptr + h, mask=h_ok, other=0.0)
            weights = tl.load(confidence_w_ptr + h, mask=h_ok, other=0.0)
            score += tl.sum(features.to(tl.float32) * weights.to(tl.float32), axis=0)
        return tl.sigmoid(score)

    @triton.jit
    def finish_slot(
        partial_max_ptr,
        partial_index_ptr,
        partial_stride_b,
        num_tiles,
        prev_ptr,
        prev_stride,
        w1_ptr,
        w1_stride_v,
        hidden_ptr,
        hidden_stride_b,
        confidence_w_ptr,
        tokens_ptr,
        tokens_stride_b,
        confidence_ptr,
        confidence_stride_b,
        hidden_size,
        rank,
        BLOCK_TILES: tl.constexpr,
        BLOCK_RANK: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """One row of one slot: reduce the tile partials to the token, then the confidence."""
        row = tl.program_id(0).to(tl.int64)
        tiles = tl.arange(0, BLOCK_TILES)
        tile_ok = tiles < num_tiles
        maxima = tl.load(
            partial_max_ptr + row * partial_stride_b + tiles, mask=tile_ok, other=float("-inf")
        )
        indices = tl.load(
            partial_index_ptr + row * partial_stride_b + tiles, mask=tile_ok, other=2**31 - 1
        )
        # Each tile already holds its lowest maximal column; the lowest across tiles
        # that reach the global maximum is then the global lowest, matching torch.
        best = tl.max(maxima, axis=0)
        token = tl.min(tl.where(maxima == best, indices, 2**31 - 1), axis=0)
        tl.store(tokens_ptr + row * tokens_stride_b, token.to(tl.int64))
        prev = tl.load(prev_ptr + row * prev_stride)
        score = confidence_score(
            row,
            prev,
            w1_ptr,
            w1_stride_v,
            hidden_ptr + row * hidden_stride_b,
            confidence_w_ptr,
            hidden_size,
            rank,
            BLOCK_RANK,
            BLOCK_H,
        )
        tl.store(confidence_ptr + row * confidence_stride_b, score)

    @triton.jit
    def finish_block(
        keys_ptr,
        keys_stride_slot,
        keys_stride_b,
        anchor_ptr,
        anchor_stride,
        w1_ptr,
        w1_stride_v,
        hidden_ptr,
        hidden_stride_b,
        hidden_stride_slot,
        confidence_w_ptr,
        tokens_ptr,
        tokens_stride_b,
        confidence_ptr,
        confidence_stride_b,
        num_slots,
        hidden_size,
        rank,
        BLOCK_RANK: tl.constexpr,
        BLOCK_H: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """One row, all slots: decode the packed keys into tokens, then the confidences."""
        chain_launch(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        prev = tl.load(anchor_ptr + row * anchor_stride).to(tl.int64)
        for slot in range(num_slots):
            token = decode_key(tl.load(keys_ptr + slot * keys_stride_slot + row * keys_stride_b))
            tl.store(tokens_ptr + row * tokens_stride_b + slot, token)
            score = confidence_score(
                row,
                prev,
                w1_ptr,
                w1_stride_v,
                hidden_ptr + row * hidden_stride_b + slot * hidden_stride_slot,
                confidence_w_ptr,
                hidden_size,
                rank,
                BLOCK_RANK,
                BLOCK_H,
            )
            tl.store(confidence_ptr + row * confidence_stride_b + slot, score)
            prev = token

    return _Kernels(
        tile_argmax=tile_argmax,
        stream_argmax=stream_argmax,
        finish_slot=finish_slot,
        finish_block=finish_block,
    )
