"""CUDA graphs of DSpark's greedy draft stage, one per padded batch size.

The greedy stage (draft logits, the fused Markov kernel's launches, the Markov
embeddings and the confidence head) is a few microseconds of device work behind
about a millisecond of host time per draft step at batch 1: Python, and Triton's
launch path for every kernel. A captured graph replays it for one launch plus two
input copies. vLLM captures its drafters' forward passes the same way, but not this
stage, which runs after the forward pass in the drafter's sampling hook.

Graphs are captured on the first greedy draft step that reaches the stage (the
engine core's warm-up requests where ``VLLM_V4_DSPARK_WARMUP`` is on), all sizes at
once, the largest first so that the smaller ones reuse its memory pool. A batch is
padded to the next captured size; padded rows draft from stale inputs and are cut
off. Batches above the largest size, or a capture that fails, run the stage eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_v4_patches.dspark.draft_math import DraftBlock

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("vllm_v4_patches")

# Above this many requests a step's host time is spread over enough tokens that a
# graph gains little, while each size's pool holds [size, N, vocab] draft logits.
MAX_GRAPH_BATCH = 128

Stage = Callable[["torch.Tensor", "torch.Tensor"], "DraftBlock | None"]


def graph_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Powers of two up to the engine's batch limit (capped at MAX_GRAPH_BATCH); the
    fused kernel's configurations change at powers of two too."""
    limit = min(max_batch, MAX_GRAPH_BATCH)
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        size *= 2
    sizes.append(size)
    return tuple(sizes)


def padded_batch(batch: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size holding ``batch`` requests, None above them all."""
    return next((size for size in sizes if size >= batch), None)


def engine_captures_graphs(vllm_config: Any) -> bool:
    """Whether this engine runs CUDA graphs at all (not enforce_eager, a cudagraph
    mode other than NONE): where it does not, neither does the draft stage."""
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "enforce_eager", False):
        return False
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return mode is not None and getattr(mode, "name", str(mode)) != "NONE"


@dataclass
class CapturedStage:
    graph: Any  # torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [size, N] int64, the graph's output buffer
    confidence: torch.Tensor | None  # [size, N] float32


class GreedyStageGraphs:
    """The greedy stage ``stage(hidden_states, anchors)`` replayed from CUDA graphs.

    ``stage`` takes ``[B * N, H]`` hidden states and ``[B]`` anchors and returns a
    DraftBlock, or None where the fused kernel does not apply (then nothing is
    captured and every step stays eager).
    """

    def __init__(self, stage: Stage, num_slots: int, sizes: tuple[int, ...]) -> None:
        self.stage = stage
        self.num_slots = num_slots
        self.sizes = sizes
        self.captured: dict[int, CapturedStage] = {}
        self.usable = bool(sizes)
        self.hidden: torch.Tensor | None = None  # [max size * N, H], the graphs' input
        self.anchors: torch.Tensor | None = None  # [max size]

    def draft(self, hidden_states: torch.Tensor, anchors: torch.Tensor) -> DraftBlock | None:
        """The block from a graph replay, or None: run the stage eagerly instead."""
        batch = anchors.shape[0]
        size = padded_batch(batch, self.sizes)
        if not self.usable or size is None or not hidden_states.is_cuda:
            return None
        if hidden_states.shape[0] != batch * self.num_slots:
            return None
        if not self.captured and not self._capture(hidden_states, anchors):
            return None
        entry = self.captured[size]
        self.hidden[: hidden_states.shape[0]].copy_(hidden_states)
        self.anchors[:batch].copy_(anchors)
        entry.graph.replay()
        # copies: the next replay overwrites the graph's buffers while vLLM may still
        # hold this step's drafts (async scheduling) and the confidences lag a step
        confidence = None if entry.confidence is None else entry.confidence[:batch].clone()
        return DraftBlock(
            tokens=entry.tokens[:batch].clone(), probs=None, confidence=confidence, fused=True
        )

    def _capture(self, hidden_states: torch.Tensor, anchors: torch.Tensor) -> bool:
        import torch

        largest = self.sizes[-1]
        self.hidden = hidden_states.new_zeros(largest * self.num_slots, hidden_states.shape[-1])
        self.anchors = anchors.new_zeros(largest)
        pool = None
        try:
            for size in reversed(self.sizes):
                inputs = (self.hidden[: size * self.num_slots], self.anchors[:size])
                # an eager run first: Triton compiles and loads this size's kernels
                # outside the capture, and a stage that does not apply is found here
                if self.stage(*inputs) is None:
                    # gated or rnn heads, tensor parallel: the loop drafts, by design
                    self._give_up("the fused Markov kernel does not apply to this draft", False)
                    return False
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    block = self.stage(*inputs)
                if block is None:
                    self._give_up("the fused Markov kernel failed during capture")
                    return False
                pool = graph.pool()
                self.captured[size] = CapturedStage(graph, block.tokens, block.confidence)
        except Exception as exc:  # a stage that cannot be captured must not stop serving
            self._give_up(repr(exc))
            return False
        logger.info(
            "vllm_v4_patches: dspark: greedy draft stage captured in CUDA graphs for "
            "batches of %s requests",
            ", ".join(map(str, self.sizes)),
        )
        return True

    def _give_up(self, reason: str, failed: bool = True) -> None:
        self.captured.clear()
        self.usable = False
        self.hidden = self.anchors = None
        logger.log(
            logging.WARNING if failed else logging.INFO,
            "vllm_v4_patches: dspark: greedy draft stage not captured in CUDA graphs (%s); "
            "it runs eagerly",
            reason,
        )
