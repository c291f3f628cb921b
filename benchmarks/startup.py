"""Start-up cost of the overlay: ``python -c pass`` and ``import vllm``, on vs off.

    python benchmarks/startup.py [--pairs N] [--vllm-pairs M]

Each sample is a fresh interpreter; samples alternate between "off" (no overlay
on PYTHONPATH) and "on" (the repository on PYTHONPATH). A third row puts an
empty ``sitecustomize.py`` on PYTHONPATH instead: the floor any sitecustomize-based
overlay pays before running a single line.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _paired import paired  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def timed(code: str, overlay: bool, path: str = str(REPO)) -> float:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if overlay:
        env["PYTHONPATH"] = path
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd="/")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--vllm-pairs", type=int, default=8)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as empty:
        Path(empty, "sitecustomize.py").write_text("")
        timed("pass", True, empty)
        floor = paired(lambda: timed("pass", False), lambda: timed("pass", True, empty), args.pairs)
    rows.append(("python -c pass` with an empty `sitecustomize.py", floor))
    for label, code, pairs in (
        ("python -c pass", "pass", args.pairs),
        ("python -c 'import vllm'", "import vllm", args.vllm_pairs),
    ):
        timed(code, False), timed(code, True)  # warm the page cache
        result = paired(lambda c=code: timed(c, False), lambda c=code: timed(c, True), pairs)
        rows.append((label, result))
    print("| what | off (median) | on (median) | added | ratio on/off | pairs |")
    print("|---|---|---|---|---|---|")
    for label, r in rows:
        print(
            f"| `{label}` | {r['a'] * 1e3:.1f} ms | {r['b'] * 1e3:.1f} ms | "
            f"{(r['b'] - r['a']) * 1e3:+.1f} ms | {r['ratio']:.3f} | {r['pairs']} |"
        )


if __name__ == "__main__":
    main()
