"""Greedy generation with stock ``vllm.LLM``; prints one JSON line of results.

Run as a script (vLLM spawns processes, hence the __main__ guard):

    python tools/generate.py MODEL_DIR [--no-eager] [--max-tokens N] [--prompts ...]
"""

from __future__ import annotations

import argparse
import json
import os
import time

DEFAULT_PROMPTS = ["def main(", "import os\nimport", "class Parser:"]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def force_async_scheduling() -> None:
    """Keep async scheduling on: vLLM's CPU platform turns it off unconditionally."""
    import wrapt

    def keep_requested(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        vllm_config = args[0] if args else kwargs["vllm_config"]
        requested = vllm_config.scheduler_config.async_scheduling
        result = wrapped(*args, **kwargs)
        if requested:
            vllm_config.scheduler_config.async_scheduling = True
        return result

    wrapt.wrap_function_wrapper(
        "vllm.platforms.cpu", "CpuPlatform.check_and_update_config", keep_requested
    )


def generate(
    model: str,
    prompts: list[str],
    max_tokens: int,
    eager: bool,
    ngram: bool = False,
    eagle: str | None = None,
    async_scheduling: bool = False,
    dspark: str | None = None,
    spec_tokens: int = 4,
    temperature: float = 0.0,
    seed: int = 0,
    draft_sample_method: str | None = None,
) -> dict:
    from vllm import LLM, SamplingParams

    if async_scheduling:
        force_async_scheduling()
    speculative = NGRAM if ngram else None
    if eagle:
        speculative = {"method": "eagle", "model": eagle, "num_speculative_tokens": 3}
    if dspark:
        speculative = {"method": "dspark", "model": dspark, "num_speculative_tokens": spec_tokens}
        # collective_rpc ships dspark_verify_counts to the worker by value
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if draft_sample_method:
            speculative["draft_sample_method"] = draft_sample_method
    started = time.perf_counter()
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=256,
        enforce_eager=eager,
        seed=0,
        load_format="auto",
        speculative_config=speculative,
        async_scheduling=async_scheduling or None,
        disable_log_stats=False,
    )
    ready = time.perf_counter()
    # one seed per request, so a repeated prompt gives independent samples that
    # are the same draws in every run
    params = [
        SamplingParams(
            temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed + i
        )
        for i in range(len(prompts))
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    done = time.perf_counter()
    engine_config = getattr(llm.llm_engine, "vllm_config", None)
    verify_counts = llm.collective_rpc(dspark_verify_counts)[0] if dspark else None
    return {
        "async_scheduling": bool(engine_config and engine_config.scheduler_config.async_scheduling),
        "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
        "texts": [out.outputs[0].text for out in outputs],
        "init_s": ready - started,
        "generate_s": done - ready,
        "spec_decode": spec_decode_counters(llm),
        "dspark_verify": verify_counts,
    }


def dspark_verify_counts(worker) -> dict | None:  # noqa: ANN001
    """Runs in the worker: the overlay drafter's scheduled and verified draft counts
    (where confidence-scheduled verification cut drafts), or None."""
    return getattr(worker.model_runner.drafter, "verify_counts", None)


def spec_decode_counters(llm) -> dict:  # noqa: ANN001
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens)."""
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counters[metric.name.removeprefix("vllm:spec_decode_")] = metric.value
    return counters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--no-eager", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompts", nargs="*", default=DEFAULT_PROMPTS)
    parser.add_argument("--ngram", action="store_true", help="ngram speculative decoding")
    parser.add_argument("--eagle", help="EAGLE speculative decoding with this draft")
    parser.add_argument("--async-scheduling", action="store_true", help="forced on, even on CPU")
    parser.add_argument("--dspark", help="DSpark speculative decoding with this draft")
    parser.add_argument("--spec-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-sample-method", choices=["greedy", "probabilistic"])
    parser.add_argument("--repeat", type=int, default=1, help="each prompt this many times")
    args = parser.parse_args()
    result = generate(
        args.model,
        args.prompts * args.repeat,
        args.max_tokens,
        not args.no_eager,
        args.ngram,
        args.eagle,
        args.async_scheduling,
        args.dspark,
        args.spec_tokens,
        args.temperature,
        args.seed,
        args.draft_sample_method,
    )
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
