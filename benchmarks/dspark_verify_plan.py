"""Host cost of confidence-scheduled verification's per-step plan under async scheduling.

    PYTHONPATH=. python benchmarks/dspark_verify_plan.py [--repeats N]

Per engine step the worker plans each request's verify length from its lagged
confidences (``verify.lagged_verify_lengths``: survival rows and Algorithm 1) and
cuts a copy of vLLM's own ``SchedulerOutput`` (``verify.trim_scheduled_drafts``).
Timed here on the CPU for N = 5 at batch 1 to 256, with random confidences and a
fixed cost model steep enough that some drafts are cut; medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

SLOTS = 5
BATCHES = (1, 8, 64, 256)


def scheduler_output(batch: int):  # noqa: ANN201
    from vllm.v1.core.sched.output import SchedulerOutput

    output = SchedulerOutput.make_empty()
    output.num_scheduled_tokens = {f"req-{i}": SLOTS + 1 for i in range(batch)}
    output.scheduled_spec_decode_tokens = {f"req-{i}": [-1] * SLOTS for i in range(batch)}
    output.total_num_scheduled_tokens = batch * (SLOTS + 1)
    return output


def time_plan(batch: int, repeats: int) -> dict:
    from vllm_v4_patches.dspark import verify

    rng = random.Random(batch)
    cost = verify.StepCostModel((20.0, 0.05))  # ms per step, ms per verified token
    output = scheduler_output(batch)
    scheduled = {req_id: len(d) for req_id, d in output.scheduled_spec_decode_tokens.items()}
    samples, verified = [], 0
    for _ in range(repeats):
        stale = {req_id: [rng.random() for _ in range(SLOTS)] for req_id in scheduled}
        started = time.perf_counter()
        lengths = verify.lagged_verify_lengths(scheduled, stale, cost)
        verify.trim_scheduled_drafts(output, lengths)
        samples.append(time.perf_counter() - started)
        verified += sum(lengths.values())
    return {
        "batch": batch,
        "median_us": round(statistics.median(samples) * 1e6, 1),
        "verified_share": round(verified / (repeats * batch * SLOTS), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=200)
    options = parser.parse_args()
    for batch in BATCHES:
        print(json.dumps(time_plan(batch, options.repeats)), flush=True)


if __name__ == "__main__":
    main()
