"""End to end: stock ``vllm.LLM`` in multiprocess mode on the tiny model, through the overlay.

Every run is a fresh interpreter, so the overlay is active exactly where its
directory is on PYTHONPATH (or where the package is installed for the plugin path).
"""

from __future__ import annotations

import json

import pytest

from conftest import REPO, hf_greedy, read_status_files, run_python

pytestmark = pytest.mark.e2e

GENERATE = str(REPO / "tools" / "generate.py")
PROMPTS = ["def main(", "import os\nimport", "class Parser:"]
MAX_TOKENS = 16
VLLM_ROLES = {"front-end", "engine-core", "worker"}
PATCHES = ("embedding", "async_sync", "cudagraph", "dp_dummy", "dspark")


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


@pytest.fixture(scope="session")
def stock_tokens(tiny_model) -> list[list[int]]:
    """The same run with no overlay anywhere."""
    return generate(tiny_model)["token_ids"]


def roles_and_outcomes(status_dir) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for document in read_status_files(status_dir):
        for patch_id, entry in document["patches"].items():
            found.setdefault(document["role"], set()).add(f"{patch_id}={entry['outcome']}")
    return found


def test_stock_vllm_matches_hf_transformers(stock_tokens, hf_reference):
    assert stock_tokens == hf_reference


def test_overlay_applies_in_every_vllm_process_and_output_is_unchanged(
    tiny_model, tmp_path, stock_tokens, hf_reference
):
    result = generate(
        tiny_model, pythonpath=[REPO], env={"VLLM_V4_PATCHES_STATUS_DIR": str(tmp_path)}
    )
    found = roles_and_outcomes(tmp_path)
    assert VLLM_ROLES <= set(found), found
    for role in VLLM_ROLES:
        assert found[role] == {f"{p}=applied" for p in PATCHES}, (role, found)
    assert result["token_ids"] == stock_tokens == hf_reference


def test_global_switch_off_reports_disabled_everywhere(tiny_model, tmp_path, stock_tokens):
    result = generate(
        tiny_model,
        pythonpath=[REPO],
        env={"VLLM_V4_PATCHES": "0", "VLLM_V4_PATCHES_STATUS_DIR": str(tmp_path)},
    )
    found = roles_and_outcomes(tmp_path)
    assert VLLM_ROLES <= set(found)
    disabled = {f"{p}=disabled" for p in PATCHES}
    assert all(outcomes == disabled for outcomes in found.values()), found
    assert result["token_ids"] == stock_tokens


def test_compiled_model_runs_the_patched_forward_through_torch_compile(
    tiny_model, tmp_path, hf_reference
):
    """No enforce_eager: vLLM compiles the model forward (fullgraph, inductor) with the
    wrapper inside. A compile cache left by a stock run must not be reused by the
    overlay, or the patch would silently be missing from the compiled graph."""
    cache = {"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    stock = generate(tiny_model, env=cache, eager=False, logs=True)
    assert "saved AOT compiled function" in stock["logs"]
    status = tmp_path / "status"
    result = generate(
        tiny_model,
        pythonpath=[REPO],
        env={**cache, "VLLM_V4_PATCHES_STATUS_DIR": str(status)},
        eager=False,
        logs=True,
    )
    assert "Directly load AOT compilation" not in result["logs"]
    assert "saved AOT compiled function" in result["logs"]
    assert roles_and_outcomes(status)["worker"] == {f"{p}=applied" for p in PATCHES}
    assert result["token_ids"] == stock["token_ids"] == hf_reference


def test_async_scheduling_with_eagle_is_unchanged_by_the_overlay(tiny_model, hf_reference):
    """Async scheduling forced on (the CPU platform turns it off) with EAGLE drafting:
    the async_sync gates sit on the drafter's staging path. CUDA events do not exist
    here, so this shows the patched path changes no result; test_async_sync.py checks
    the gate's ordering."""
    from build_tiny_model import build_eagle_draft

    draft = build_eagle_draft(str(tiny_model), str(tiny_model) + "-eagle")
    args = [GENERATE, str(tiny_model), "--max-tokens", str(MAX_TOKENS), "--prompts", *PROMPTS]
    args += ["--eagle", draft, "--async-scheduling"]
    runs = []
    for path in ([], [REPO]):
        result = run_python(args, pythonpath=path, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        [line] = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
        runs.append(json.loads(line.removeprefix("RESULT ")))
        if path:
            assert "async_sync=applied" in result.stderr
    assert all(run["async_scheduling"] for run in runs)
    assert runs[0]["token_ids"] == runs[1]["token_ids"] == hf_reference
