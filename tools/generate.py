"""Greedy generation with stock ``vllm.LLM``; prints one JSON line of results.

Run as a script (vLLM spawns processes, hence the __main__ guard):

    python tools/generate.py MODEL_DIR [--no-eager] [--max-tokens N] [--prompts ...]
"""

from __future__ import annotations

import argparse
import json
import time

DEFAULT_PROMPTS = ["def main(", "import os\nimport", "class Parser:"]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def generate(
    model: str, prompts: list[str], max_tokens: int, eager: bool, ngram: bool = False
) -> dict:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=256,
        enforce_eager=eager,
        seed=0,
        load_format="auto",
        speculative_config=NGRAM if ngram else None,
    )
    ready = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    done = time.perf_counter()
    return {
        "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
        "texts": [out.outputs[0].text for out in outputs],
        "init_s": ready - started,
        "generate_s": done - ready,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--no-eager", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompts", nargs="*", default=DEFAULT_PROMPTS)
    parser.add_argument("--ngram", action="store_true", help="ngram speculative decoding")
    args = parser.parse_args()
    result = generate(args.model, args.prompts, args.max_tokens, not args.no_eager, args.ngram)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
