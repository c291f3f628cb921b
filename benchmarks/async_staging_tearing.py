"""GPU reproduction of the tearing the ``async_sync`` patch prevents (pure PyTorch).

    python benchmarks/async_staging_tearing.py [--steps N] [--elements E] [--busy-us U]

The staging pattern of an async-scheduled runner: each step the CPU writes the
step's inputs into ONE reused pinned host buffer, enqueues a non-blocking
host-to-device copy on a side stream behind GPU work still in flight (modelled
by ``torch.cuda._sleep``), and moves on to the next step without waiting for
the GPU, as async scheduling does. A check kernel queued after each copy
counts the elements that do not hold that step's value: a non-zero count is a
torn (corrupted) step.

The gate is the depth-1 event the patch installs: record an event right after
the copy is enqueued; synchronize it before the CPU writes the buffer again.
It waits only for the previous use of the same buffer, never for the current
step. Prints a Markdown table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def run(steps: int, elements: int, busy_cycles: int, gated: bool) -> dict:
    stream = torch.cuda.Stream()
    staging = torch.empty(elements, dtype=torch.int32, pin_memory=True)
    device = torch.empty(elements, dtype=torch.int32, device="cuda")
    torn = torch.zeros(steps, dtype=torch.int64, device="cuda")
    event = torch.cuda.Event() if gated else None
    host_wait = []
    torch.cuda.synchronize()
    started = time.perf_counter()
    for step in range(steps):
        if event is not None:
            waited = time.perf_counter()
            event.synchronize()  # previous copy out of `staging` has landed
            host_wait.append(time.perf_counter() - waited)
        staging.fill_(step)  # the CPU writes this step's inputs
        with torch.cuda.stream(stream):
            torch.cuda._sleep(busy_cycles)  # the GPU is still busy with earlier work
            device.copy_(staging, non_blocking=True)
            if event is not None:
                event.record(stream)
            torn[step] = (device != step).sum()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    bad = torn.cpu()
    return {
        "gated": gated,
        "steps": steps,
        "torn_steps": int((bad > 0).sum()),
        "torn_elements": int(bad.sum()),
        "us_per_step": elapsed / steps * 1e6,
        "host_wait_us_median": statistics.median(host_wait) * 1e6 if host_wait else 0.0,
    }


def gate_cost(steps: int, elements: int, pairs: int) -> dict:
    """Per-step cost of the gate when the GPU is idle (nothing to wait for)."""
    ungated, gated = [], []
    for _ in range(pairs):
        ungated.append(run(steps, elements, 0, False)["us_per_step"])
        gated.append(run(steps, elements, 0, True)["us_per_step"])
    return {
        "ungated_us_per_step": statistics.median(ungated),
        "gated_us_per_step": statistics.median(gated),
        "added_us_per_step": statistics.median(g - u for g, u in zip(gated, ungated, strict=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--elements", type=int, default=1 << 16)
    parser.add_argument("--busy-us", type=float, default=50.0)
    parser.add_argument("--pairs", type=int, default=7)
    args = parser.parse_args()
    clock_khz = torch.cuda.get_device_properties(0).clock_rate or 1_980_000
    busy_cycles = int(args.busy_us * clock_khz / 1000)
    run(50, args.elements, busy_cycles, True)  # warm-up
    results = [run(args.steps, args.elements, busy_cycles, gated) for gated in (False, True)]
    cost = gate_cost(args.steps, args.elements, args.pairs)
    print(
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.steps} steps, "
        f"{args.elements} int32 per copy, ~{args.busy_us} us GPU work queued before each copy"
    )
    print("| gate | torn steps | torn elements | us/step | median host wait |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {'depth-1 event' if r['gated'] else 'none'} | {r['torn_steps']} / {r['steps']} | "
            f"{r['torn_elements']} | {r['us_per_step']:.1f} | {r['host_wait_us_median']:.1f} us |"
        )
    print(
        f"gate cost, GPU idle ({args.pairs} pairs, medians): "
        f"{cost['ungated_us_per_step']:.2f} -> {cost['gated_us_per_step']:.2f} us/step "
        f"({cost['added_us_per_step']:+.2f} us)"
    )
    print("JSON " + json.dumps({"runs": results, "gate_cost": cost}))


if __name__ == "__main__":
    main()
