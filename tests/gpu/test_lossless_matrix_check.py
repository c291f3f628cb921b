"""The GPU suite's lossless-matrix check (``lossless_in_every_phase``) on records
written here: what ``generate.py --phases`` records (no GPU needed; the records'
shape is the one the CPU engine wrote, see docs/testing.md)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import suite  # noqa: E402

WIDE = [[1.0, 1.0, 1.0]]


def record(tokens: list[int], preemptions: int = 2, hits: float = 64.0) -> dict:
    phase = {"token_ids": [tokens], "margins": copy.deepcopy(WIDE)}
    shared = {**phase, "prefix_tokens": 100, "prefix_queries": 128.0, "prefix_hits": hits}
    return {
        **phase,
        "preemptions": preemptions,
        "phases": {"alone": dict(phase), "shared_prefix": shared},
    }


def verdict(reference: dict, job: dict) -> tuple[bool, str]:
    outcomes = {
        name: suite.Outcome(result, [], "", 1.0, 0)
        for name, result in (("ref", reference), ("job", job))
    }
    return suite.lossless_in_every_phase("ref", "job")(outcomes)


def test_equal_phases_with_preemption_and_prefix_hits_pass():
    passed, text = verdict(record([5, 6, 7]), record([5, 6, 7]))
    assert passed, text
    assert "2 preemptions; prefix cache 64 of 128 tokens hit" in text


def test_a_phase_parting_at_a_wide_margin_fails_and_names_the_phase():
    job = record([5, 6, 7])
    job["phases"]["alone"]["token_ids"] = [[5, 9, 7]]
    passed, text = verdict(record([5, 6, 7]), job)
    assert not passed and "alone: 0/1 sequences equal" in text


def test_no_preemption_or_no_prefix_hit_fails_although_the_tokens_are_equal():
    assert not verdict(record([5, 6, 7]), record([5, 6, 7], preemptions=0))[0]
    assert not verdict(record([5, 6, 7]), record([5, 6, 7], hits=0.0))[0]
