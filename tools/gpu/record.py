"""Record GPU suite runs: keep the raw run, and merge its verdicts into the results file.

    python tools/gpu/record.py RUN_DIR [RUN_DIR ...]    # oldest first
    python tools/gpu/record.py --again                  # after the checks changed

A run directory is what ``tools/gpu/suite.py`` wrote under ``$OUT``
(``gpu-results-<version>.json`` and ``logs-<version>.tar.gz``). Each run is copied
to ``docs/gpu-runs/<date>/`` (gzipped: the kept runs travel with every device
call) and its checks are evaluated again with the suite's
current checks from what the run saved (outputs, logs, status files), so a check
that was corrected later reads the same evidence anew; a check the run cannot
answer again keeps its recorded verdict. A later run's verdict on a check replaces
an earlier one; a check a later run did not run keeps the earlier verdict, and one
a later run shows the release cannot answer (no JIT monitor) loses it.
``vllm_v4_patches/gpu_results.json`` holds the merge: per release, torch and CUDA,
each check with pass/fail, its figure, its date and the GPU it ran on, and the
throughput figures.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RESULTS = REPO / "vllm_v4_patches" / "gpu_results.json"
RUNS = REPO / "docs" / "gpu-runs"
KEPT_SUFFIX = ".json.gz"
sys.path.insert(0, str(HERE))

from suite import CHECKS, OMITTED, UPSTREAM_FAULTS, Outcome, evaluate  # noqa: E402


def outcomes_of(run: dict, logs: Path) -> dict[str, Outcome]:
    texts = {}
    with tarfile.open(logs) as archive:
        for member in archive.getmembers():
            texts[member.name.removesuffix(".log")] = archive.extractfile(member).read().decode()
    saved = run.get("statuses")
    return {
        name: Outcome(
            result_from_log(run["results"].get(name), texts.get(name, "")),
            saved.get(name) if saved is not None else None,
            texts.get(name, ""),
            job["seconds"],
            job["returncode"],
        )
        for name, job in run["jobs"].items()
    }


def result_from_log(result: dict | None, log: str) -> dict | None:
    """A result left out of the results file (over its size limit) is read back from
    the job's kept log, where the job printed it (``RESULT {json}``)."""
    if result is None or OMITTED not in result:
        return result
    printed = [line for line in log.splitlines() if line.startswith("RESULT ")]
    return json.loads(printed[-1].removeprefix("RESULT ")) if printed else result


def throughput(run: dict) -> dict:
    """tok/s with and without DSpark per batch, and their ratio, where both ran."""
    plain = (run["results"].get("bench-nospec") or {}).get("tokens_per_s") or {}
    dspark = (run["results"].get("bench-dspark") or {}).get("tokens_per_s") or {}
    return {
        batch: {
            "no_speculation_tok_s": round(plain[batch]["tok_s"]),
            "dspark_tok_s": round(dspark[batch]["tok_s"]),
            "ratio": round(dspark[batch]["tok_s"] / plain[batch]["tok_s"], 2),
            "dspark_first_round_s": round(dspark[batch]["first_s"], 2),
        }
        for batch in plain
        if batch in dspark
    }


def record(run_dir: Path, results: dict) -> None:
    """Keep the run under docs/gpu-runs and merge it into ``results``."""
    [run_file] = run_dir.glob("gpu-results-*.json")
    run = json.loads(run_file.read_text())
    version = run["vllm"]
    kept = RUNS / run["date"]
    kept.mkdir(parents=True, exist_ok=True)
    serial = len(list(kept.glob(f"{version}-*{KEPT_SUFFIX}"))) + 1
    kept_as = kept / f"{version}-{serial}{KEPT_SUFFIX}"
    kept_as.write_bytes(gzip.compress(scrub(run_file.read_text()).encode(), mtime=0))
    copy_scrubbed(run_file.with_name(f"logs-{version}.tar.gz"), logs_of(kept_as))
    merge(results, kept_as)


def copy_scrubbed(logs: Path, kept: Path) -> None:
    """Copy a run's logs with the machine's paths (the checkout, the staged site
    packages) written as REPO and SITE: kept logs name no machine's directories."""
    with tarfile.open(logs) as source, tarfile.open(kept, "w:gz") as target:
        for member in source.getmembers():
            text = scrub(source.extractfile(member).read().decode(errors="replace"))
            data = text.encode()
            member.size = len(data)
            target.addfile(member, io.BytesIO(data))


def scrub(text: str) -> str:
    text = re.sub(r"/tmp/gpu-site/[\w.]+", "SITE", text)
    return text.replace(str(REPO), "REPO")


def read_run(kept_run: Path) -> dict:
    """A kept run (gzipped JSON), or a run as the suite wrote it (plain JSON)."""
    data = kept_run.read_bytes()
    return json.loads(gzip.decompress(data) if kept_run.name.endswith(".gz") else data)


def run_name(kept_run: Path) -> str:
    return kept_run.name.removesuffix(KEPT_SUFFIX)


def logs_of(kept_run: Path) -> Path:
    return kept_run.with_name(run_name(kept_run) + ".logs.tar.gz")


def recorded_runs() -> list[Path]:
    """The kept runs, oldest first (by date, then serial within a release)."""
    return sorted(
        RUNS.glob(f"*/*{KEPT_SUFFIX}"),
        key=lambda p: (p.parent.name, run_name(p).split("-")[0], int(run_name(p).split("-")[-1])),
    )


def merge(results: dict, kept_run: Path) -> None:
    """Merge one kept run's verdicts, evaluated again with the current checks."""
    run = read_run(kept_run)
    version = run["vllm"]
    entry = results["versions"].setdefault(version, {"checks": {}, "throughput": {}})
    entry.update(torch=run["torch"], cuda=run["driver_cuda"])
    # a check the suite no longer has was a mistake of the harness: it is dropped
    recorded = {row["check"]: row for row in run["checks"] if row["check"] in CHECKS}
    recorded.update({row["check"]: row for row in evaluate(outcomes_of(run, logs_of(kept_run)))})
    for name, row in recorded.items():
        if row.get("applies") is False:
            entry["checks"].pop(name, None)
        elif row["passed"] is not None:
            entry["checks"][name] = {
                "passed": row["passed"],
                "figure": row["figure"],
                "date": run["date"],
                # a release's checks may come from different cards' runs
                "gpu": run["gpu"],
                "run": kept_run.relative_to(REPO).as_posix(),
            }
    by_batch = throughput(run)
    if by_batch:
        entry["throughput"] = {"date": run["date"], "gpu": run["gpu"], "by_batch": by_batch}


def attribute_upstream(entry: dict) -> None:
    """Name the stock fault behind each failed check that shows it, where the check
    that reproduces it without the overlay failed the same way on this release."""
    checks = entry["checks"]
    for check in checks.values():
        check.pop("upstream", None)
    for reproducer, (signature, what) in UPSTREAM_FAULTS.items():
        shown = checks.get(reproducer)
        if not shown or shown["passed"] or signature not in shown["figure"]:
            continue
        for check in checks.values():
            if not check["passed"] and signature in check["figure"]:
                check["upstream"] = what


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path)
    parser.add_argument(
        "--again", action="store_true", help="rebuild the file from the kept runs alone"
    )
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"versions": {}}
    if args.again:
        results = {"versions": {}}
        for kept_run in recorded_runs():
            merge(results, kept_run)
    results["generated_by"] = "python tools/gpu/record.py (do not edit by hand)"
    for run_dir in args.runs:
        record(run_dir, results)
    for entry in results["versions"].values():
        attribute_upstream(entry)
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    for version, entry in sorted(results["versions"].items()):
        checks = entry["checks"].values()
        print(f"{version}: {sum(c['passed'] for c in checks)}/{len(checks)} checks pass")
        for name, check in entry["checks"].items():
            if not check["passed"]:
                mark = "UPSTREAM" if check.get("upstream") else "FAIL"
                print(f"  {mark} {name}: {check['figure'][:160]}")


if __name__ == "__main__":
    main()
