"""Tiny-model engine throughput with the embedding patch applied vs reverted.

    PYTHONPATH=<repo> python benchmarks/throughput.py MODEL_DIR [--pairs N]

One in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, eager) serves every
sample; between samples the overlay's patch is reverted or re-applied, so the
two sides differ by the patch alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _paired import paired  # noqa: E402

PROMPTS = ["def main(", "import os\nimport", "class Parser:", "for item in"] * 2
MAX_TOKENS = 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--pairs", type=int, default=10)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from vllm import LLM, SamplingParams

    from vllm_v4_patches import runtime

    llm = LLM(model=args.model, dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
    overlay = runtime.current()
    if overlay is None or overlay.document()["patches"]["embedding"]["outcome"] != "applied":
        raise SystemExit("run with the overlay on PYTHONPATH: the embedding patch is not applied")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = len(PROMPTS) * MAX_TOKENS

    def tokens_per_s(applied: bool) -> float:
        (overlay.reapply if applied else overlay.revert)("embedding")
        started = time.perf_counter()
        llm.generate(PROMPTS, params, use_tqdm=False)
        return -tokens / (time.perf_counter() - started)  # negated: paired() wants costs

    tokens_per_s(True), tokens_per_s(False)  # warm-up
    result = paired(lambda: tokens_per_s(False), lambda: tokens_per_s(True), args.pairs)
    stock, patched = -result["a"], -result["b"]
    print("| batch | tokens | stock tok/s (median) | patched tok/s (median) | ratio | pairs |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {len(PROMPTS)} | {MAX_TOKENS}/request | {stock:.0f} | {patched:.0f} | "
        f"{patched / stock:.3f} | {result['pairs']} |"
    )


if __name__ == "__main__":
    main()
