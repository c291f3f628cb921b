"""The committed GPU results file: the merge of the kept runs, read by the matrix."""

from __future__ import annotations

import json
import sys

from conftest import REPO
from vllm_v4_patches import compat

sys.path.insert(0, str(REPO / "tools" / "gpu"))

import record  # noqa: E402
import suite  # noqa: E402


def test_results_file_is_the_merge_of_the_kept_runs():
    """Nobody edits the verdicts: re-merging docs/gpu-runs with the suite's current
    checks gives the committed file."""
    merged: dict = {"versions": {}}
    for run in record.recorded_runs():
        record.merge(merged, run)
    for entry in merged["versions"].values():
        record.attribute_upstream(entry)
    assert merged["versions"] == compat.load_gpu_results()["versions"]


def test_every_recorded_check_is_one_the_suite_has():
    for version, entry in compat.load_gpu_results()["versions"].items():
        assert set(entry["checks"]) <= set(suite.CHECKS), version


def test_the_matrix_counts_passed_checks_per_release():
    results = {
        "versions": {
            "0.26.0": {
                "checks": {
                    "a": {"passed": True, "date": "2026-12-01", "gpu": "NVIDIA H200"},
                    "b": {"passed": False, "date": "2026-12-02", "gpu": "NVIDIA H200"},
                },
            }
        }
    }
    assert compat.gpu_verdict("0.26.0", results) == "H200: 1/2 (2026-12-02)"
    assert compat.gpu_verdict("0.25.0", results) == "-"
    table = compat.markdown_table(compat.load_matrix(), gpu_results=results)
    [row] = [line for line in table.splitlines() if line.startswith("| 0.26.0 |")]
    assert row.endswith("| H200: 1/2 (2026-12-02) |")
    # a release whose latest verdicts came from two cards counts each card's own
    checks = results["versions"]["0.26.0"]["checks"]
    checks["c"] = {"passed": True, "date": "2026-12-05", "gpu": "NVIDIA H100 80GB HBM3"}
    assert compat.gpu_verdict("0.26.0", results) == ("H100 80GB HBM3: 1/1, H200: 1/2 (2026-12-05)")


def test_each_merged_check_names_the_card_of_its_run():
    for version, entry in compat.load_gpu_results()["versions"].items():
        runs = {check["run"]: check["gpu"] for check in entry["checks"].values()}
        for kept_run, card in runs.items():
            assert record.read_run(REPO / kept_run)["gpu"] == card, version


def test_the_required_releases_were_run_on_a_gpu():
    versions = compat.load_gpu_results()["versions"]
    for version in ("0.20.2", "0.24.0", "0.26.0"):
        assert json.dumps(versions[version]["checks"]), version


def test_a_failure_stock_vllm_shows_too_is_named_upstream():
    """Only where the reproducing check failed with the same error on that release,
    and only checks whose figure shows that error."""
    [(reproducer, (signature, what))] = list(suite.UPSTREAM_FAULTS.items())[:1]
    checks = {
        reproducer: {"passed": False, "figure": f"job exited 1: CUDA error: an {signature}"},
        "same fault": {"passed": False, "figure": f"dspark exited 1: {signature}"},
        "other fault": {"passed": False, "figure": "TIMEOUT after 122s"},
        "passes": {"passed": True, "figure": "3/3 sequences equal"},
    }
    entry = {"checks": json.loads(json.dumps(checks))}
    for check in entry["checks"].values():
        check.update(date="2026-12-02", gpu="NVIDIA H200")
    record.attribute_upstream(entry)
    named = {name for name, check in entry["checks"].items() if check.get("upstream")}
    assert named == {reproducer, "same fault"}
    assert entry["checks"]["same fault"]["upstream"] == what
    assert compat.gpu_verdict("x", {"versions": {"x": entry}}) == (
        "H200: 1/4, 2 failing in stock vLLM too (2026-12-02)"
    )
    # the reproducer passing on a release names nothing there
    entry["checks"][reproducer]["passed"] = True
    record.attribute_upstream(entry)
    assert not any(check.get("upstream") for check in entry["checks"].values())
