"""A ``-1`` placeholder reaching vLLM's tp_size-1 ``VocabParallelEmbedding`` on the GPU.

Builds the real layer on CUDA at tensor-parallel size 1 and looks up ids holding a
``-1`` (what async scheduling with speculative decoding leaves in a drafter's input
ids), then synchronises. Prints ``RESULT {json}``: whether the lookup completed,
whether the rows of valid ids equal a plain gather, and whether the invalid row is
zero. Stock vLLM is expected to fault here, so run it in its own process.
``--compiled`` looks the ids up through a model holding the layer, compiled by
``torch.compile`` (Inductor, ``fullgraph=True``) as vLLM compiles its models.

    python tools/gpu/embedding_fault.py [--compiled]
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serve_check import free_port  # noqa: E402

VOCAB, HIDDEN = 128, 64


@contextlib.contextmanager
def tp1_embedding(vocab: int, hidden: int, port: int) -> Iterator[Any]:
    """vLLM's real ``VocabParallelEmbedding`` at tensor-parallel size 1 (weights drawn
    from a normal distribution, seed 0), inside the one-rank set-up it needs."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        torch.manual_seed(0)
        layer = VocabParallelEmbedding(vocab, hidden)
        layer.weight.data.normal_()
        yield layer
    cleanup_dist_env_and_memory()


def compiled_lookup(layer: Any, backend: str = "inductor") -> Any:
    """The layer inside a model, the model's forward compiled: vLLM compiles models,
    not layers, and a wrapper Dynamo skipped there would leave stock's lookup."""
    import torch

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = layer

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.embed_tokens(ids) * 1.0

    return torch.compile(Model().forward, fullgraph=True, dynamic=False, backend=backend)


def main() -> None:
    import torch

    compiled = "--compiled" in sys.argv[1:]
    # a port the kernel hands out: the stock and patched jobs run at the same time
    with tp1_embedding(VOCAB, HIDDEN, free_port()) as layer:
        layer = layer.cuda()
        lookup = compiled_lookup(layer) if compiled else layer
        ids = torch.tensor([5, -1, 7, 3], device="cuda")
        result = {"completed": False, "compiled": compiled}
        try:
            rows = lookup(ids)
            torch.cuda.synchronize()
        except Exception as exc:  # the stock fault: a device-side assert or illegal access
            result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        else:
            valid = ids >= 0
            expected = layer.weight.data[ids[valid]]
            result.update(
                completed=True,
                valid_rows_equal=bool(torch.equal(rows[valid], expected)),
                invalid_row_zero=bool((rows[~valid] == 0).all()),
            )
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
