"""The greedy draft stage's CUDA graphs: the sizes captured, where they apply.

Capture and replay need a CUDA device; the GPU suite (``tools/gpu/suite.py``, the
``dspark-v1`` job against ``dspark-v1-eager-kernel`` and no speculation) and
``benchmarks/dspark_drafter_stage_gpu.py`` check the replayed tokens there. Here:
the padding arithmetic, the engine settings that turn graphs off, and that a CPU
stage is never handed to a capture.
"""

from __future__ import annotations

import types

import pytest
import torch

from vllm_v4_patches.dspark import graphs


@pytest.mark.parametrize("limit", [1, 3, 16, 100, 128, 512])
def test_every_batch_up_to_the_limit_pads_to_at_most_twice_its_size(limit: int):
    sizes = graphs.graph_batch_sizes(limit)
    assert all(size & (size - 1) == 0 for size in sizes)
    assert sizes[-1] <= graphs.MAX_GRAPH_BATCH and list(sizes) == sorted(set(sizes))
    for batch in range(1, min(limit, graphs.MAX_GRAPH_BATCH) + 1):
        padded = graphs.padded_batch(batch, sizes)
        assert padded is not None and batch <= padded < 2 * batch
    # above the largest size the stage runs eagerly
    assert graphs.padded_batch(sizes[-1] + 1, sizes) is None


def test_engines_without_cuda_graphs_get_none_for_the_stage():
    """vLLM's own compilation config and graph modes; the two outer namespaces stand
    in for a VllmConfig, which cannot be built without a model here."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    def config(enforce_eager: bool, mode: CUDAGraphMode) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            model_config=types.SimpleNamespace(enforce_eager=enforce_eager),
            compilation_config=CompilationConfig(cudagraph_mode=mode),
        )

    assert graphs.engine_captures_graphs(config(False, CUDAGraphMode.FULL_AND_PIECEWISE))
    assert graphs.engine_captures_graphs(config(False, CUDAGraphMode.PIECEWISE))
    assert not graphs.engine_captures_graphs(config(False, CUDAGraphMode.NONE))
    assert not graphs.engine_captures_graphs(config(True, CUDAGraphMode.FULL_AND_PIECEWISE))


def test_a_cpu_stage_is_run_eagerly_and_never_captured():
    calls: list[int] = []

    def stage(hidden: torch.Tensor, anchors: torch.Tensor) -> None:
        calls.append(anchors.shape[0])

    stage_graphs = graphs.GreedyStageGraphs(stage, 4, graphs.graph_batch_sizes(8))
    assert stage_graphs.draft(torch.zeros(2 * 4, 16), torch.zeros(2, dtype=torch.long)) is None
    assert calls == [] and stage_graphs.captured == {} and stage_graphs.usable
