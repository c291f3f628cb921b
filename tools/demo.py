"""``make demo``: stock vLLM on the tiny model through the overlay, with every
process's patch status, then DSpark speculative decoding on the tiny Qwen3 pair.

    python tools/demo.py MODEL_DIR [DSPARK_TARGET DSPARK_DRAFT]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def generate(model: str, *extra: str, env: dict[str, str]) -> dict:
    """tools/generate.py's result, with the processes' log lines under "logs"."""
    command = [sys.executable, str(REPO / "tools" / "generate.py"), model, *extra]
    print("$ PYTHONPATH=" + str(REPO) + " " + " ".join(command[1:]), flush=True)
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-6000:])
        raise SystemExit(run.returncode)
    [line] = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    return {**json.loads(line.removeprefix("RESULT ")), "logs": run.stdout + run.stderr}


def dspark_demo(target: str, draft: str) -> None:
    """The same target with and without the DSpark draft: identical greedy output."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    plain = generate(target, "--max-tokens", "64", env=env)
    spec = generate(target, "--max-tokens", "64", "--dspark", draft, env=env)
    counters = spec["spec_decode"]
    tokens = sum(len(ids) for ids in spec["token_ids"])
    print("\nDSpark (N = 4, greedy) on the V1 runner:")
    print(f"  output identical to no speculation: {spec['token_ids'] == plain['token_ids']}")
    print(f"  drafts {counters['num_drafts']}, draft tokens {counters['num_draft_tokens']},")
    print(f"  accepted {counters['num_accepted_tokens']}, mean acceptance length ", end="")
    print(f"{1 + counters['num_accepted_tokens'] / counters['num_drafts']:.2f}")
    print(f"  tokens/s without {tokens / plain['generate_s']:.0f}, ", end="")
    print(f"with {tokens / spec['generate_s']:.0f} (one run each; see benchmarks/dspark_cpu.py)")


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(REPO / ".cache/models/tiny-llama")
    with tempfile.TemporaryDirectory() as status_dir:
        env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_V4_PATCHES_STATUS_DIR=status_dir)
        result = generate(model, env=env)
        print("\nGenerated (greedy, 16 tokens each):")
        for text in result["texts"]:
            print("  " + repr(text))
        print(f"\nengine start {result['init_s']:.1f} s, generate {result['generate_s']:.2f} s")
        print("\nPatch status, one row per vLLM process:")
        print(f"  {'pid':>7}  {'role':<12}  {'vLLM':<8}  patches")
        for path in sorted(Path(status_dir).glob("*.json")):
            doc = json.loads(path.read_text())
            patches = ", ".join(f"{k}={v['outcome']}" for k, v in doc["patches"].items())
            print(f"  {doc['pid']:>7}  {doc['role']:<12}  {doc['vllm_version']:<8}  {patches}")
        print("\nSummary lines from the processes' logs:")
        for log_line in result["logs"].splitlines():
            if "vllm_v4_patches [" in log_line:
                print("  " + log_line.strip())
    if len(sys.argv) > 3:
        dspark_demo(sys.argv[2], sys.argv[3])


if __name__ == "__main__":
    main()
