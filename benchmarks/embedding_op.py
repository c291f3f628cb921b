"""Cost of the patched tp_size-1 embedding lookup vs stock, on CPU.

    python benchmarks/embedding_op.py [--vocab 129280] [--hidden 4096]

DeepSeek-V4-sized table (bf16); samples alternate stock and patched calls of
the same layer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _paired import paired  # noqa: E402


def build_layer(vocab: int, hidden: int):
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    config = VllmConfig()
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, "tcp://127.0.0.1:29561", 0, "gloo")
        initialize_model_parallel(1, 1)
        layer = VocabParallelEmbedding(vocab, hidden, params_dtype=torch.bfloat16)
    layer.weight.data.normal_()
    return layer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--pairs", type=int, default=15)
    args = parser.parse_args()

    import torch

    from vllm_v4_patches import embedding
    from vllm_v4_patches.patcher import Patcher
    from vllm_v4_patches.sources import InstalledSource

    torch.set_grad_enabled(False)
    layer = build_layer(args.vocab, args.hidden)
    found = embedding.probe(InstalledSource())
    patcher = Patcher("embedding")

    def cost(ids, applied: bool, repeat: int) -> float:
        if applied:
            embedding.apply(patcher, found)
        elif patcher.active:
            patcher.revert()
        started = time.perf_counter()
        for _ in range(repeat):
            layer(ids)
        return (time.perf_counter() - started) / repeat

    print(
        f"vocab {args.vocab}, hidden {args.hidden}, bf16, torch threads {torch.get_num_threads()}"
    )
    print("| tokens | stock (median) | patched (median) | ratio |")
    print("|---|---|---|---|")
    for tokens in (1, 64, 4096):
        ids = torch.randint(0, args.vocab, (tokens,))
        repeat = max(1, 20000 // tokens)
        cost(ids, True, repeat), cost(ids, False, repeat)
        result = paired(
            lambda ids=ids, n=repeat: cost(ids, False, n),
            lambda ids=ids, n=repeat: cost(ids, True, n),
            args.pairs,
        )
        print(
            f"| {tokens} | {result['a'] * 1e6:.1f} µs | {result['b'] * 1e6:.1f} µs | "
            f"{result['ratio']:.2f} |"
        )
    if patcher.active:
        patcher.revert()


if __name__ == "__main__":
    main()
