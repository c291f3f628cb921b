"""The V1 drafter's sequential stage on the GPU: the fused kernel vs its PyTorch loop.

    python benchmarks/dspark_drafter_stage_gpu.py [--batches 1,8,64,256] [--repeats 50]

``sampling.draft_with_markov_head`` is what the overlay's V1 drafter calls after the
block forward. Here it runs on a stand-in draft model (:class:`StandInDraft`: vLLM's
draft classes cannot be built where vLLM is not installed) that exposes what the
drafter reads from vLLM's DSpark classes: base logits, ``markov_embed``,
``markov_bias``, the confidence head and ``model.markov_head.markov_w1/markov_w2``.
For the equality check its bias is computed in fp32, as the kernel does, so both
paths are held to the same tokens; for timing it is a bf16 product, as vLLM's
``markov_bias`` (a logits processor over the bias head) computes it.
DeepSeek-V4-Flash sizes (V = 129280, R = 256, H = 4096, N = 5, bf16).

For each batch: greedy tokens of the three paths (``VLLM_V4_DSPARK_MARKOV_KERNEL``
auto, the fused path replayed from the drafter's CUDA graph; eager, the fused kernel
launched per call; torch, the loop) must be equal and the confidences agree within
1e-5; then the three are timed, in rotating order, medians:
  * host time: from the call to its return, before synchronising (what the drafter's
    step spends on the host; Triton's Python launcher costs tens of microseconds a
    launch, and the eager fused path makes N + 1);
  * wall time: the same call until the device finished it;
  * device time of the eager and loop paths: captured in a CUDA graph and replayed,
    timed by events.
JSON goes to $OUT when it is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VOCAB, RANK, HIDDEN, SLOTS = 129280, 256, 4096, 5


def stand_in_draft(
    vocab: int, rank: int, hidden: int, dtype, device, seed: int = 0
):  # noqa: ANN001, ANN201
    """A draft model with vLLM's DSpark draft interface and random weights."""
    import torch
    from torch import nn

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.markov_head = nn.Module()
            self.markov_head.markov_w1 = nn.Embedding(vocab, rank)
            self.markov_head.markov_w2 = nn.Linear(rank, vocab, bias=False)
            self.confidence_head = nn.Linear(hidden + rank, 1, bias=True)

    class StandInDraft(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Heads()
            self.base_logits: torch.Tensor | None = None  # set per call: [B * N, V]
            self.exact_bias = True

        def compute_draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return self.base_logits

        def markov_embed(self, token_ids: torch.Tensor) -> torch.Tensor:
            return self.model.markov_head.markov_w1(token_ids)

        def markov_bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
            weight = self.model.markov_head.markov_w2.weight
            if self.exact_bias:
                return markov_embed.float() @ weight.float().t()
            return markov_embed @ weight.t()

        def compute_confidence(self, hidden: torch.Tensor, markov: torch.Tensor) -> torch.Tensor:
            head = self.model.confidence_head
            features = torch.cat([hidden, markov], dim=-1).float()
            return torch.sigmoid(features @ head.weight.float().t() + head.bias.float())[:, 0]

    torch.manual_seed(seed)
    model = StandInDraft()
    with torch.no_grad():
        model.model.markov_head.markov_w2.weight.mul_(4.0)  # a bias that changes drafts
    return model.to(device=device, dtype=dtype)


def inputs(model, batch: int, dtype, device, seed: int):  # noqa: ANN001, ANN201
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    vocab = model.model.markov_head.markov_w2.weight.shape[0]
    hidden_size = (
        model.model.confidence_head.weight.shape[1]
        - model.model.markov_head.markov_w1.weight.shape[1]
    )
    shape = (batch * SLOTS, vocab)
    model.base_logits = torch.randn(shape, generator=generator, device=device).to(dtype)
    hidden = torch.randn(batch * SLOTS, hidden_size, generator=generator, device=device)
    anchors = torch.randint(0, vocab, (batch,), generator=generator, device=device)
    return hidden.to(dtype), anchors


_stage_graphs: dict[int, object] = {}  # batch -> GreedyStageGraphs


def run_stage(model, hidden, anchors, choice: str):  # noqa: ANN001, ANN201
    """``choice``: "graphs" (the drafter's default: the fused path replayed from a
    CUDA graph), "eager" (the fused kernel launched per call) or "torch" (the loop)."""
    from vllm_v4_patches.dspark import graphs, sampling

    if choice == "graphs":
        batch = anchors.shape[0]
        if batch not in _stage_graphs:
            stage = sampling.greedy_stage(model, SLOTS)
            _stage_graphs[batch] = graphs.GreedyStageGraphs(stage, SLOTS, (batch,))
        block = _stage_graphs[batch].draft(hidden, anchors)
        assert block is not None, "the greedy stage was not captured"
        return block
    fused = choice == "eager"
    return sampling.draft_with_markov_head(model, hidden, anchors, SLOTS, None, fused=fused)


def timed(model, hidden, anchors, choice: str) -> tuple[float, float]:  # noqa: ANN001
    """(host seconds to enqueue the stage, seconds until the device finished it)."""
    import torch

    torch.cuda.synchronize()
    started = time.perf_counter()
    run_stage(model, hidden, anchors, choice)
    enqueued = time.perf_counter()
    torch.cuda.synchronize()
    return enqueued - started, time.perf_counter() - started


def graph_replay_us(
    model, hidden, anchors, choice: str, replays: int = 50
) -> float:  # noqa: ANN001
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_stage(model, hidden, anchors, choice)  # warm-up off the default stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_stage(model, hidden, anchors, choice)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


CHOICES = ("graphs", "eager", "torch")


def measure(batch: int, repeats: int, model) -> dict:  # noqa: ANN001
    import torch

    hidden, anchors = inputs(model, batch, torch.bfloat16, "cuda", seed=batch)
    with torch.no_grad():
        model.exact_bias = True
        blocks = {choice: run_stage(model, hidden, anchors, choice) for choice in CHOICES}
        loop = blocks["torch"]
        tokens_equal = all(torch.equal(b.tokens, loop.tokens) for b in blocks.values())
        confidence_error = max(
            float((b.confidence - loop.confidence).abs().max()) for b in blocks.values()
        )
        model.exact_bias = False
        for _ in range(3):
            for choice in CHOICES:
                timed(model, hidden, anchors, choice)
        host: dict[str, list[float]] = {choice: [] for choice in CHOICES}
        wall: dict[str, list[float]] = {choice: [] for choice in CHOICES}
        for index in range(repeats):
            order = CHOICES[index % 3 :] + CHOICES[: index % 3]
            for choice in order:
                enqueue_s, wall_s = timed(model, hidden, anchors, choice)
                host[choice].append(enqueue_s)
                wall[choice].append(wall_s)
        fused_graph = graph_replay_us(model, hidden, anchors, "eager")
        loop_graph = graph_replay_us(model, hidden, anchors, "torch")
    row = {"batch": batch, "tokens_equal": tokens_equal, "confidence_max_error": confidence_error}
    for choice in CHOICES:
        row[f"{choice}_host_us"] = round(statistics.median(host[choice]) * 1e6, 1)
        row[f"{choice}_us"] = round(statistics.median(wall[choice]) * 1e6, 1)
    row["eager_over_graphs_host"] = round(row["eager_host_us"] / row["graphs_host_us"], 2)
    row["fused_device_us"] = round(fused_graph, 1)
    row["loop_device_us"] = round(loop_graph, 1)
    return row


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--repeats", type=int, default=50)
    options = parser.parse_args()
    model = stand_in_draft(VOCAB, RANK, HIDDEN, torch.bfloat16, "cuda")
    from vllm_v4_patches.dspark import markov_kernel, sampling

    assert sampling.fusable_markov_weights(model, VOCAB) is not None
    print(
        "kernel:",
        markov_kernel.pick_kernel(
            torch.empty(1, SLOTS, VOCAB, dtype=torch.bfloat16, device="cuda"),
            model.model.markov_head.markov_w2.weight,
        ),
        flush=True,
    )
    rows = []
    for batch in (int(b) for b in options.batches.split(",")):
        row = measure(batch, options.repeats, model)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "dspark_drafter_stage_gpu.json").write_text(json.dumps(rows))
    assert all(row["tokens_equal"] and row["confidence_max_error"] < 1e-5 for row in rows)


if __name__ == "__main__":
    main()
