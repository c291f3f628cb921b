"""DSpark Markov + confidence heads on the GPU: fused Triton path vs a plain PyTorch loop.

    python benchmarks/dspark_markov_gpu.py [--batches 1,8,32,64,128,256] [--sweep]

DeepSeek-V4-Flash sizes (V = 129280, R = 256, H = 4096, N = 5, bf16). For each batch:
  1. the Triton tokens must equal the fp32 PyTorch reference exactly and the
     confidences agree within 1e-3 (the sampled variant is checked at two batches);
  2. three CUDA graphs are timed by events, median of many replays: the plain
     PyTorch loop (gather, GEMM, fp32 add, argmax per slot), the fused Triton path,
     and a device-to-device copy that moves as many bytes as the bound;
  3. bound = (N*V*R*2 + B*N*V*2 + small) bytes / the copy's bandwidth.
--sweep also times every candidate kernel configuration. Prints a Markdown table;
writes JSON to $OUT/dspark_markov_gpu.json when OUT is set.

Findings on one H200 (copy 4.1 TB/s), fused/bound. The K-loop kernel: 1.29 (B=1),
1.33 (8), 1.41 (32), 1.49 (64), 1.70 (128), 2.14 (256). What paid there: atomic
64-bit argmax keys instead of a reduction launch per slot (3-10 us), walking the
V-tiles backwards on odd slots so a slot starts on the markov_w2 lines the previous
one left in L2 (~10 us), prefetching the base logits. What lost: a weight-stationary
kernel (W2 tile held, rows looped), an embedding-stationary persistent kernel with a
K loop, and a persistent K-loop, all 10-60% slower; L2 eviction hints moved nothing.
At B=256 ncu showed it latency-bound (DRAM 40%, L2 65%, SM 41%); by count each
program also re-read its 128 rows' embeddings from L2, as many bytes as the weight.

The persistent stream kernels (one program per SM and row block, embeddings held in
shared memory, whole rank per 64-column tile, TMA copies; markov_kernel docstring)
took that to 1.16, 1.20, 1.31, 1.31, 1.37, 1.56 in plain Triton (B=256: 347 -> 253
us). ncu at B=256: 47 us a slot, DRAM 60%, tensor pipe 38%, 33% of warp stalls at
CTA barriers: Triton waits for each product before its epilogue and puts barriers
around each copy. Written out in Gluon (product of tile i in flight while tile i-1
is folded and its stage refilled) plus programmatic dependent launch: 1.22 (B=32),
1.22 (64), 1.32 (128), 1.41 (256; 227 us); at B <= 16 plain Triton stays 1-3%
ahead (1.16, 1.20). Dependent launch alone gave the Gluon kernel 2-4% (B=256: 231
-> 227 us, B=64: 127 -> 123). 64-row programs at B=256: 243 us. Lost
or no gain (B=256 unless said): 128-column tiles (2 stages fit: 359 us), 32-column
tiles with 5-6 stages (321-336), 256 rows per program (309-343), 64 rows with two
programs per SM (285-319), a per-(row, column) running best instead of a per-tile
row reduction (+-1%), issuing the next product before the fold in plain Triton
(Triton still waits at once: +3%), pointer loads instead of TMA (+7%), dependent
launch for plain Triton at B <= 16 (+2%). Not run, from the compiled code: emb kept
in registers (Triton reloads it from shared memory every tile) and
tl.range(warp_specialize=True) (no partition on sm_90; a compiler error at 4 warps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vllm_v4_patches.dspark import markov_kernel  # noqa: E402
from vllm_v4_patches.dspark.markov_kernel import MarkovKernelConfig  # noqa: E402

VOCAB, RANK, HIDDEN, SLOTS = 129280, 256, 4096, 5
KERNELS = ("gluon", "stream", "k_loop")


def make_inputs(batch: int, seed: int) -> dict:
    """Random inputs whose Markov bias (std ~1.6) moves the argmax away from the base."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape: int, scale: float) -> torch.Tensor:
        values = torch.randn(*shape, generator=gen, device="cuda") * scale
        return values.to(torch.bfloat16)

    return {
        "base_logits": normal(batch, SLOTS, VOCAB, scale=2.0),
        "anchor": torch.randint(0, VOCAB, (batch,), generator=gen, device="cuda"),
        "markov_w1": normal(VOCAB, RANK, scale=1.0),
        "markov_w2": normal(VOCAB, RANK, scale=0.1),
        "hidden": normal(batch, SLOTS, HIDDEN, scale=1.0),
        "confidence_w": normal(HIDDEN + RANK, scale=0.02),
    }


def bound_bytes(batch: int) -> int:
    """Fewest bytes one draft block must move: W2 once per slot, each input once."""
    weights = SLOTS * VOCAB * RANK * 2
    logits = batch * SLOTS * VOCAB * 2
    small = batch * SLOTS * (HIDDEN * 2 + RANK * 2 + 8 + 4) + (HIDDEN + RANK) * 2
    return weights + logits + small


def naive_loop(inputs: dict, tokens, confidence, confidence_w_f32) -> None:
    """What one writes first: per slot gather, bf16 GEMM, fp32 add, argmax, confidence."""
    import torch

    prev = inputs["anchor"]
    for slot in range(SLOTS):
        embedding = inputs["markov_w1"][prev]
        bias = embedding @ inputs["markov_w2"].t()
        logits = inputs["base_logits"][:, slot].float() + bias.float()
        tokens[:, slot] = logits.argmax(dim=-1)
        features = torch.cat([inputs["hidden"][:, slot].float(), embedding.float()], dim=-1)
        confidence[:, slot] = torch.sigmoid(features @ confidence_w_f32)
        prev = tokens[:, slot]


def time_graph(body: Callable[[], object], replays: int) -> float:
    """Median µs of one replay of a CUDA graph holding body(), timed by events."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compiles and allocates outside the capture
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(3):
        graph.replay()
    event_pairs = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(replays)
    ]
    for start, end in event_pairs:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in event_pairs) * 1e3


def copy_bandwidth(total_bytes: int, replays: int) -> tuple[float, float]:
    """(µs, bytes/s) of a device copy that reads and writes total_bytes together."""
    import torch

    # Whole 4-byte words, a multiple of 1024 of them: an odd byte count would push
    # the copy onto its unvectorised path (seen: 2.7 instead of 4.2 TB/s).
    words = total_bytes // 2 // 4 // 1024 * 1024
    source = torch.randint(0, 2**30, (words,), dtype=torch.int32, device="cuda")
    target = torch.empty_like(source)
    micros = time_graph(lambda: target.copy_(source), replays)
    return micros, 2 * 4 * words / (micros * 1e-6)


def compare(tokens, confidence, ref_tokens, ref_confidence, inputs: dict) -> dict:
    """Exact token match and max confidence error; a mismatch reports its logit gap.

    Only a near-tie (a gap of a few fp32 ulps, the summation order of the product)
    may excuse a mismatch, so the gap of the first differing slot is measured.
    """
    import torch

    mismatched = (tokens != ref_tokens).any(dim=1)
    gaps = []
    for row in mismatched.nonzero().flatten().tolist()[:4]:
        slot = int((tokens[row] != ref_tokens[row]).nonzero()[0])
        prev = inputs["anchor"][row] if slot == 0 else ref_tokens[row, slot - 1]
        embedding = inputs["markov_w1"][prev].float()
        pair = torch.stack([ref_tokens[row, slot], tokens[row, slot]])
        logits = inputs["base_logits"][row, slot, pair].float() + (
            inputs["markov_w2"][pair].float() @ embedding
        )
        gaps.append(float(logits[0] - logits[1]))
    return {
        "tokens_equal": bool(not mismatched.any()),
        "mismatched_rows": int(mismatched.sum()),
        "first_gaps": gaps,
        "confidence_max_err": float((confidence - ref_confidence).abs().max()),
    }


def k_loop(tile_v: int, block_b: int, block_k: int, warps: int, stages: int, **flags):
    """A K-looped kernel configuration, by default with atomic keys and prefetched logits."""
    flags = {"prefetch_base": True, "atomic_argmax": True, **flags}
    return MarkovKernelConfig(tile_v, block_b, block_k, warps, stages, **flags)


def stream(tile_v: int, block_b: int, warps: int, stages: int, **flags):
    """A persistent whole-rank plain-Triton kernel configuration."""
    return MarkovKernelConfig(
        tile_v, block_b, 256, warps, stages, atomic_argmax=True, kernel="stream", **flags
    )


def gluon(tile_v: int, block_b: int, stages: int, **flags):
    """A Gluon stream kernel configuration (block_b / 16 warps)."""
    return MarkovKernelConfig(
        tile_v, block_b, 256, block_b // 16, stages, atomic_argmax=True, kernel="gluon", **flags
    )


def candidate_configs(batch: int) -> list[MarkovKernelConfig]:
    """The default, the other kernels' defaults and a few runners-up (default first)."""
    if batch <= 16:
        others = [gluon(64, 64, 4, pdl=True), stream(64, 16, 4, 3, programs_per_sm=2, pdl=True)]
    elif batch <= 64:
        others = [gluon(64, 64, 3, pdl=True), gluon(64, 64, 4)]
    else:
        others = [gluon(64, 128, 3), gluon(64, 64, 4, pdl=True)]
    defaults = [markov_kernel.default_config(batch, kernel) for kernel in KERNELS]
    return list(dict.fromkeys([*defaults, *others]))


def run_batch(batch: int, replays: int, sweep: bool) -> dict:
    import torch

    inputs = make_inputs(batch, seed=batch)
    ref_tokens, ref_confidence = markov_kernel.greedy_markov_draft_reference(**inputs)
    result: dict = {"batch": batch, "bound_bytes": bound_bytes(batch)}

    tokens = torch.empty(batch, SLOTS, dtype=torch.int64, device="cuda")
    confidence = torch.empty(batch, SLOTS, dtype=torch.float32, device="cuda")
    confidence_w_f32 = inputs["confidence_w"].float()
    naive_loop(inputs, tokens, confidence, confidence_w_f32)
    result["naive_check"] = compare(tokens, confidence, ref_tokens, ref_confidence, inputs)
    result["naive_us"] = time_graph(
        lambda: naive_loop(inputs, tokens, confidence, confidence_w_f32), replays
    )

    def fused(config: MarkovKernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
        return markov_kernel.greedy_markov_draft_triton(**inputs, config=config)

    def measure(config: MarkovKernelConfig) -> dict:
        entry: dict = {"config": asdict(config)}
        try:
            entry["check"] = compare(*fused(config), ref_tokens, ref_confidence, inputs)
            entry["us"] = time_graph(lambda: fused(config), replays)
        except Exception as error:  # a shape that does not fit (shared memory, registers)
            entry["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        return entry

    configs = candidate_configs(batch) if sweep else [markov_kernel.default_config(batch)]
    result["configs"] = [measure(config) for config in configs]
    default = result["configs"][0]
    result["fused_us"] = default.get("us", float("nan"))
    result["fused_check"] = default.get("check")
    timed = [entry for entry in result["configs"] if "us" in entry]
    best = min(timed, key=lambda entry: entry["us"])
    result["best_us"], result["best_config"] = best["us"], best["config"]

    result["copy_us"], result["copy_bandwidth"] = copy_bandwidth(result["bound_bytes"], replays)
    result["bound_us"] = result["bound_bytes"] / result["copy_bandwidth"] * 1e6
    return result


def check_sampled(batch: int) -> dict:
    """Gumbel-max variant: same tokens as the fp32 reference for the same noise."""
    import torch

    inputs = make_inputs(batch, seed=1000 + batch)
    temperature = torch.rand(batch, device="cuda") * 1.5
    temperature[0] = 0.0  # a greedy row inside a sampled batch
    uniform = torch.rand(batch, SLOTS, VOCAB, device="cuda").clamp_(1e-10, 1.0 - 1e-7)
    noise = -torch.log(-torch.log(uniform))
    extra = {"temperature": temperature, "gumbel_noise": noise}
    ref = markov_kernel.sampled_markov_draft_reference(**inputs, **extra)
    checks = {}
    for name, config in (
        ("gluon", gluon(64, 64, 4, pdl=True)),
        ("stream", markov_kernel.default_config(batch, "stream")),
        ("partials", k_loop(128, 16, 64, 4, 3, atomic_argmax=False)),
    ):
        got = markov_kernel.sampled_markov_draft_triton(**inputs, **extra, config=config)
        # compare()'s gaps leave out the noise term; the mismatch count is the check.
        checks[name] = compare(*got, *ref, inputs)
    return {"batch": batch, **checks}


def print_table(results: list[dict]) -> None:
    print(
        "| batch | naive µs | fused µs | bound µs | naive/bound | fused/bound "
        "| best swept µs | copy TB/s | tokens equal | conf err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        check = row["fused_check"] or {}
        print(
            f"| {row['batch']} | {row['naive_us']:.1f} | {row['fused_us']:.1f} "
            f"| {row['bound_us']:.1f} | {row['naive_us'] / row['bound_us']:.2f} "
            f"| {row['fused_us'] / row['bound_us']:.2f} | {row['best_us']:.1f} "
            f"| {row['copy_bandwidth'] / 1e12:.2f} | {check.get('tokens_equal')} "
            f"| {check.get('confidence_max_err', float('nan')):.1e} |"
        )


def print_sweep(results: list[dict]) -> None:
    for row in results:
        print(f"\nbatch {row['batch']} (bound {row['bound_us']:.1f} µs):")
        for entry in sorted(row["configs"], key=lambda e: e.get("us", float("inf"))):
            c = entry["config"]
            shape = (
                f"{c['kernel']} pps{c['programs_per_sm']} pdl{int(c['pdl'])} "
                f"k{c['block_k']} v{c['tile_v']} b{c['block_b']} w{c['num_warps']} "
                f"s{c['num_stages']} atomic{int(c['atomic_argmax'])} "
                f"pf{int(c['prefetch_base'])} alt{int(c['alternate_direction'])} "
                f"l2{int(c['keep_weight_in_l2'])}"
            )
            if "us" in entry:
                ok = entry["check"]["tokens_equal"]
                print(f"  {shape}: {entry['us']:.1f} µs, tokens equal {ok}")
            else:
                print(f"  {shape}: {entry['error']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--sweep", action="store_true", help="time every candidate config")
    args = parser.parse_args()

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # the reference stays true fp32
    batches = [int(value) for value in args.batches.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    results = []
    for batch in batches:
        results.append(run_batch(batch, args.replays, args.sweep))
        row = results[-1]
        print(
            f"batch {batch}: fused {row['fused_us']:.1f} µs, best {row['best_us']:.1f} µs, "
            f"bound {row['bound_us']:.1f} µs"
        )
        sys.stdout.flush()
    sampled = [check_sampled(batch) for batch in (8, 64)]
    if args.sweep:
        print_sweep(results)
    print("\nsampled variant:", json.dumps(sampled))
    print("naive tokens vs reference:", [row["naive_check"] for row in results])
    print()
    print_table(results)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "dspark_markov_gpu.json"
        path.write_text(json.dumps({"results": results, "sampled": sampled}, indent=1))


if __name__ == "__main__":
    main()
