"""End to end: stock ``vllm.LLM`` in multiprocess mode on the tiny model, through the overlay.

Every overlay run is an interpreter of its own, so the overlay is active exactly
where its directory is on PYTHONPATH; the stock runs share one (``run_plan``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_builds import INSTALLED

from conftest import (
    GENERATE,
    REPO,
    Inputs,
    ModuleRuns,
    engine_run,
    hf_greedy,
    matrix_outcomes,
    read_status_files,
    run_python,
)
from vllm_v4_patches.registry import load_patches

pytestmark = pytest.mark.e2e

PROMPTS = ["def main(", "import os\nimport", "class Parser:"]
MAX_TOKENS = 16
VLLM_ROLES = {"front-end", "engine-core", "worker"}
RUN = {"prompts": PROMPTS, "max_tokens": MAX_TOKENS}
PATCHES = tuple(patch.id for patch in load_patches())
# what each process reports with the overlay on: the matrix's cell for the venv's build
SWITCHED_ON = {f"{p}={outcome}" for p, outcome in matrix_outcomes(INSTALLED).items()}


def generate(model, *, pythonpath=(), env=None, eager=True, logs=False) -> dict:
    args = [GENERATE, str(model), "--max-tokens", str(MAX_TOKENS), "--prompts", *PROMPTS]
    if not eager:
        args.append("--no-eager")
    settings = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})}
    result = run_python(args, pythonpath=pythonpath, env=settings)
    [line] = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    found = json.loads(line.removeprefix("RESULT "))
    if logs:
        found["logs"] = result.stdout + result.stderr
    return found


@pytest.fixture(scope="session")
def hf_reference(tiny_model) -> list[list[int]]:
    """Greedy tokens from HF transformers on the same weights (independent reference)."""
    return hf_greedy(tiny_model, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def stock_tokens(runs: ModuleRuns) -> list[list[int]]:
    """The same run with no overlay anywhere."""
    return runs["stock"]["token_ids"]


def plan_stock(runs: ModuleRuns, inputs: Inputs) -> None:
    """Stock vLLM, multiprocess, in the plan process of stock runs."""
    run = engine_run("stock", inputs.tiny, multiprocess=True, **RUN)
    runs.add("stock", run)


def with_status(model: Path, status: Path, env: dict[str, str]) -> dict:
    """An overlay run and what its processes report, by role."""
    status.mkdir(parents=True, exist_ok=True)
    result = generate(
        model, pythonpath=[REPO], env={**env, "VLLM_V4_PATCHES_STATUS_DIR": str(status)}
    )
    return {**result, "found": roles_and_outcomes(status)}


def roles_and_outcomes(status_dir) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for document in read_status_files(status_dir):
        for patch_id, entry in document["patches"].items():
            found.setdefault(document["role"], set()).add(f"{patch_id}={entry['outcome']}")
    return found


def test_stock_vllm_matches_hf_transformers(runs, stock_tokens, hf_reference):
    assert stock_tokens == hf_reference


def plan_overlay(runs: ModuleRuns, inputs: Inputs) -> None:
    plan_stock(runs, inputs)
    runs.submit("overlay", with_status, inputs.tiny, inputs.scratch / "overlay", {})


def test_overlay_applies_in_every_vllm_process_and_output_is_unchanged(
    runs, stock_tokens, hf_reference
):
    result = runs["overlay"]
    found = result["found"]
    assert VLLM_ROLES <= set(found), found
    for role in VLLM_ROLES:
        assert found[role] == SWITCHED_ON, (role, found)
    assert result["token_ids"] == stock_tokens == hf_reference


def plan_switch_off(runs: ModuleRuns, inputs: Inputs) -> None:
    plan_stock(runs, inputs)
    env = {"VLLM_V4_PATCHES": "0"}
    runs.submit("switched off", with_status, inputs.tiny, inputs.scratch / "off", env)


def test_global_switch_off_reports_disabled_everywhere(runs, stock_tokens):
    result = runs["switched off"]
    found = result["found"]
    assert VLLM_ROLES <= set(found)
    disabled = {f"{p}=disabled" for p in PATCHES}
    assert all(outcomes == disabled for outcomes in found.values()), found
    assert result["token_ids"] == stock_tokens


def compiled_stock_then_overlay(model: Path, scratch: Path) -> tuple[dict, dict, Path]:
    """A compiled stock run, then a compiled overlay run on the cache it left (one
    after the other: the second must find the first's cache)."""
    cache = {"VLLM_CACHE_ROOT": str(scratch / "vllm-cache")}
    stock = generate(model, env=cache, eager=False, logs=True)
    status = scratch / "status"
    result = generate(
        model,
        pythonpath=[REPO],
        env={**cache, "VLLM_V4_PATCHES_STATUS_DIR": str(status)},
        eager=False,
        logs=True,
    )
    return stock, result, status


def plan_compiled(runs: ModuleRuns, inputs: Inputs) -> None:
    runs.submit("compiled", compiled_stock_then_overlay, inputs.tiny, inputs.scratch / "compiled")


def test_compiled_model_runs_the_patched_forward_through_torch_compile(runs, hf_reference):
    """No enforce_eager: vLLM compiles the model forward (fullgraph, inductor) with the
    wrapper inside. A compile cache left by a stock run must not be reused by the
    overlay, or the patch would silently be missing from the compiled graph."""
    stock, result, status = runs["compiled"]
    assert "saved AOT compiled function" in stock["logs"]
    assert "Directly load AOT compilation" not in result["logs"]
    assert "saved AOT compiled function" in result["logs"]
    assert roles_and_outcomes(status)["worker"] == SWITCHED_ON
    assert result["token_ids"] == stock["token_ids"] == hf_reference


def eagle_async(model: Path, draft: str) -> tuple[dict, str]:
    """The overlay's single-process run with an EAGLE draft and async scheduling
    forced on, in a process of its own (its log is this run's alone): its result
    and its log."""
    args = [GENERATE, str(model), "--max-tokens", str(MAX_TOKENS), "--prompts", *PROMPTS]
    args += ["--eagle", draft, "--async-scheduling"]
    settings = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    result = run_python(args, pythonpath=[REPO], env=settings)
    [line] = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT ")), result.stderr


def plan_eagle(runs: ModuleRuns, inputs: Inputs) -> None:
    from build_tiny_model import build_eagle_draft

    draft = build_eagle_draft(str(inputs.tiny), str(inputs.tiny) + "-eagle")
    # last in the stock plan: forcing async scheduling wraps the CPU platform there
    options = {**RUN, "eagle": draft, "async_scheduling": True}
    runs.add("stock", engine_run("eagle stock", inputs.tiny, multiprocess=False, **options))
    runs.submit("eagle overlay", eagle_async, inputs.tiny, draft)


def test_async_scheduling_with_eagle_is_unchanged_by_the_overlay(runs, hf_reference):
    """Async scheduling forced on (the CPU platform turns it off) with EAGLE drafting:
    the async_sync gates sit on the drafter's staging path. CUDA events do not exist
    here, so this shows the patched path changes no result; test_async_sync.py checks
    the gate's ordering."""
    stock, (patched, log) = runs["eagle stock"], runs["eagle overlay"]
    assert "async_sync=applied" in log
    assert stock["async_scheduling"] and patched["async_scheduling"]
    assert stock["token_ids"] == patched["token_ids"] == hf_reference


PLANS = {
    test_stock_vllm_matches_hf_transformers.__name__: plan_stock,
    test_overlay_applies_in_every_vllm_process_and_output_is_unchanged.__name__: plan_overlay,
    test_global_switch_off_reports_disabled_everywhere.__name__: plan_switch_off,
    test_compiled_model_runs_the_patched_forward_through_torch_compile.__name__: plan_compiled,
    test_async_scheduling_with_eagle_is_unchanged_by_the_overlay.__name__: plan_eagle,
}
