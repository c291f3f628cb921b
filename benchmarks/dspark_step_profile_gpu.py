"""Where a decode step's time goes on the GPU, with and without DSpark.

    python benchmarks/dspark_step_profile_gpu.py TARGET [--dspark DRAFT] [--batches 1 16 64]

One engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, V1 runner), built
as ``tools/generate.py`` builds it (default compile and CUDA graphs, float32, a fixed
2 GiB KV cache). Run it through the overlay (``PYTHONPATH`` holding the repository)
for DSpark. Per batch size, after one untimed round:

* the median of three timed rounds (greedy, ``--max-tokens`` tokens per request);
* one round under ``cProfile``: the Python functions with the most own time and the
  most cumulative time (host work, and host time spent waiting on the device);
* one round under ``torch.profiler``: the operators and kernels with the most device
  time, and the device's busy time against the round's wall time.

With ``--profile-first`` the engine's first round (the first batch size's) runs under
``cProfile`` instead of untimed, to show what a first request pays that later ones
do not.

Writes a text report to ``$OUT/profile-<mode>.txt`` (or the working directory) and
prints its summary. The report is a diagnosis aid, not a benchmark figure.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))


def build_engine(target: str, draft: str | None, spec_tokens: int) -> object:
    from generate import dspark_speculation, tiny_llm

    speculative = dspark_speculation(draft, spec_tokens) if draft else None
    return tiny_llm(
        target,
        eager=False,
        kv_cache_gib=2,
        speculative_config=speculative,
        disable_log_stats=False,
    )


def one_round(llm: object, batch: int, max_tokens: int) -> float:
    from vllm import SamplingParams

    prompts = [f"def f{i}(" for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started


def python_profile(llm: object, batch: int, max_tokens: int, top: int) -> str:
    return profiled_round(llm, batch, max_tokens, top)[1]


def profiled_round(llm: object, batch: int, max_tokens: int, top: int) -> tuple[float, str]:
    """One round under cProfile: its wall time and the report."""
    profiler = cProfile.Profile()
    profiler.enable()
    wall = one_round(llm, batch, max_tokens)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return wall, text.getvalue()


def device_profile(llm: object, batch: int, max_tokens: int, top: int) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = one_round(llm, batch, max_tokens)
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    lines = [
        f"round wall {wall * 1e3:.1f} ms; device busy (sum of self device time) "
        f"{device_us / 1e3:.1f} ms",
        events.table(sort_by="self_device_time_total", row_limit=top),
        events.table(sort_by="self_cpu_time_total", row_limit=top),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("--dspark", help="the DSpark draft (else no speculation)")
    parser.add_argument("--spec-tokens", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--profile-first", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    mode = "dspark" if args.dspark else "nospec"
    started = time.perf_counter()
    llm = build_engine(args.target, args.dspark, args.spec_tokens)
    report = [f"{mode}: engine ready in {time.perf_counter() - started:.1f} s"]
    for index, batch in enumerate(args.batches):
        if args.profile_first and index == 0:
            first, first_report = profiled_round(llm, batch, args.max_tokens, args.top + 20)
            report += [f"\n===== first round, batch {batch}, under cProfile", first_report]
        else:
            first = one_round(llm, batch, args.max_tokens)
        steady = statistics.median(one_round(llm, batch, args.max_tokens) for _ in range(3))
        tok_s = batch * args.max_tokens / steady
        summary = f"batch {batch}: first {first:.3f} s, steady {steady:.3f} s, {tok_s:.0f} tok/s"
        print(summary, flush=True)
        report += [
            f"\n===== {summary}",
            python_profile(llm, batch, args.max_tokens, args.top),
            device_profile(llm, batch, args.max_tokens, args.top),
        ]
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile-{mode}.txt").write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
