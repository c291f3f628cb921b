"""Shared fixtures: the tiny model, an HF reference, and subprocess runners.

Subprocesses start from a scratch working directory so that the overlay is on
``sys.path`` only where a test puts it there on purpose.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

MODEL_DIR = REPO / ".cache" / "models" / "tiny-llama"
DSPARK_TARGET_DIR = REPO / ".cache" / "models" / "tiny-qwen3"
DSPARK_DRAFT_DIR = REPO / ".cache" / "models" / "tiny-qwen3-dspark"
BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
}


def clean_env(**overrides: str) -> dict[str, str]:
    """The test environment without any overlay or overlay setting."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("VLLM_V4_PATCH") and key != "PYTHONPATH"
    }
    env.update(BASE_ENV)
    env.update(overrides)
    return env


def run_python(
    args: list[str],
    *,
    pythonpath: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 600,
    check: bool = True,
) -> subprocess.CompletedProcess:
    full_env = clean_env(**(env or {}))
    if pythonpath:
        full_env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    result = subprocess.run(
        [sys.executable, *args],
        env=full_env,
        cwd=str(cwd) if cwd else str(REPO / ".cache"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{args} exited {result.returncode}\n--- stdout\n{result.stdout[-4000:]}"
            f"\n--- stderr\n{result.stderr[-8000:]}"
        )
    return result


def hf_greedy(model_dir: Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy tokens from HF transformers on the same weights (independent reference)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=max_tokens)
        reference.append(out[0, ids.shape[1] :].tolist())
    return reference


def read_status_files(directory: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from build_tiny_model import build

    return Path(build(str(MODEL_DIR)))


@pytest.fixture(scope="session")
def dspark_variants(dspark_pair) -> dict[str, Path]:
    """The distilled draft with a gated and with an rnn Markov head added (seconds)."""
    from dspark_model import write_markov_variant

    _, draft = dspark_pair
    return {
        kind: Path(write_markov_variant(draft, f"{draft}-{kind}", kind))
        for kind in ("gated", "rnn")
    }


@pytest.fixture(scope="session")
def dspark_pair() -> tuple[Path, Path]:
    """The tiny trained Qwen3 target and its distilled DSpark draft (built if missing)."""
    if not (DSPARK_DRAFT_DIR / "model.safetensors").exists():
        script = str(REPO / "tools" / "distill_dspark.py")
        run_python([script, str(DSPARK_TARGET_DIR.parent)], cwd=REPO, timeout=1800)
    return DSPARK_TARGET_DIR, DSPARK_DRAFT_DIR
