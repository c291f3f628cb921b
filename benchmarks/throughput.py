"""Tiny-model engine throughput, overlay on vs off.

    python benchmarks/throughput.py MODEL_DIR [--pairs N] [--engines M]

Two measurements, both paired and alternating:

* ``compiled``: vLLM's default (no enforce_eager: the model forward goes through
  torch.compile). Each sample is a fresh one-process engine, started with or
  without the overlay on PYTHONPATH, sharing one compile cache (the overlay
  keys its entries apart), timed after a warm-up.
* ``eager``: one engine with enforce_eager; between samples the overlay's patch
  is reverted or re-applied, so the two sides differ by the patch alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from _paired import paired  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["def main(", "import os\nimport", "class Parser:", "for item in"] * 2
MAX_TOKENS = 64
TOKENS = len(PROMPTS) * MAX_TOKENS


def build_engine(model: str, eager: bool):
    from generate import tiny_llm
    from vllm import SamplingParams

    llm = tiny_llm(model, eager=eager)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm, params


def seconds_per_batch(llm, params) -> float:  # noqa: ANN001
    started = time.perf_counter()
    llm.generate(PROMPTS, params, use_tqdm=False)
    return time.perf_counter() - started


def one_engine_sample(model: str, repeats: int) -> None:
    """Child process: median seconds of `repeats` batches after one warm-up."""
    import statistics

    llm, params = build_engine(model, eager=False)
    seconds_per_batch(llm, params)
    print(
        "SECONDS "
        + json.dumps(statistics.median(seconds_per_batch(llm, params) for _ in range(repeats)))
    )


def compiled(model: str, pairs: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:

        def sample(overlay: bool) -> float:
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CACHE_ROOT=cache)
            if overlay:
                env["PYTHONPATH"] = str(REPO)
            out = subprocess.run(
                [sys.executable, __file__, model, "--child", str(repeats)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            return json.loads(out.split("SECONDS ")[-1])

        sample(False), sample(True)  # fill the compile cache for both sides
        return paired(lambda: sample(False), lambda: sample(True), pairs)


def eager(model: str, pairs: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(REPO))
    from vllm_v4_patches import runtime

    runtime.activate()
    llm, params = build_engine(model, eager=True)
    overlay = runtime.current()
    if overlay.document()["patches"]["embedding"]["outcome"] != "applied":
        raise SystemExit("the embedding patch is not applied; nothing to compare")

    def sample(applied: bool) -> float:
        (overlay.reapply if applied else overlay.revert)("embedding")
        return seconds_per_batch(llm, params)

    sample(True), sample(False)
    return paired(lambda: sample(False), lambda: sample(True), pairs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--engines", type=int, default=6, help="pairs of compiled engines")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return one_engine_sample(args.model, args.child)
    rows = [
        ("compiled (default), fresh engine per sample", compiled(args.model, args.engines, 5)),
        ("eager, one engine, patch toggled per sample", eager(args.model, args.pairs)),
    ]
    print(f"batch {len(PROMPTS)}, {MAX_TOKENS} tokens per request, float32")
    print("| mode | off tok/s (median) | on tok/s (median) | ratio on/off | pairs |")
    print("|---|---|---|---|---|")
    for label, r in rows:
        off, on = TOKENS / r["a"], TOKENS / r["b"]
        print(f"| {label} | {off:.0f} | {on:.0f} | {on / off:.3f} | {r['pairs']} |")


if __name__ == "__main__":
    main()
