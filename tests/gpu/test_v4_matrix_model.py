"""Which shrunken V4 the GPU suite's lossless matrix (and its compiled part) serves on
each release.

vLLM 0.20's hash-routing kernel (``csrc/moe/topk_softplus_sqrt_kernels.cu`` in its
source distribution) renormalises a token's routed weights with a sum over the
whole warp, so where one warp routes several tokens their weights mix. The kernel
reads float32 router logits (V4's gate) 16 bytes a load, ``max(1, E / 128)`` loads
a lane, so a token takes ``E / VPT`` lanes of a warp's 32. ``rows_per_warp`` below
is that arithmetic; the tests check that the model the suite builds for 0.20.x
routes one token a warp (its expert count read from the real builder's inventory,
``--dry-run``), that the 8-expert model does not (the control), and that releases
from 0.21, whose kernel reduces over a token's own lanes, keep the 8-expert model.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import suite  # noqa: E402

WARP = 32
FLOATS_PER_LOAD = 16 // 4


def rows_per_warp(experts: int) -> int:
    values_per_lane = max(1, experts // (FLOATS_PER_LOAD * WARP)) * FLOATS_PER_LOAD
    return WARP // (experts // values_per_lane)


def built_experts(model: Path) -> int:
    """Routed experts of target layer 0 in the checkpoint the suite would build."""
    listing = subprocess.run(
        [*suite.v4_build(model), "--dry-run"], capture_output=True, text=True, check=True
    ).stdout
    names = {line.split("\t")[0] for line in listing.splitlines()}
    return sum(f"layers.0.ffn.experts.{e}.w1.weight" in names for e in range(1024))


def matrix_models(version: str) -> set[str]:
    jobs = [job for job in suite.jobs_for(version) if job.part == "v4-matrix"]
    names = {"v4-matrix-reference", "v4-matrix-n5", "v4-hash-routing"}
    assert {job.name for job in jobs} == names
    return {arg for job in jobs for arg in job.args if "tiny-v4" in arg}


def test_the_kernel_arithmetic_matches_the_known_cases():
    """The figures the source gives: 8 experts, 16 tokens a warp; 256, one."""
    assert rows_per_warp(8) == 16
    assert rows_per_warp(256) == 1


def test_releases_with_the_warp_wide_sum_serve_one_token_a_warp():
    assert matrix_models("0.20.2") == {str(suite.TINY_V4_WIDE)}
    assert rows_per_warp(built_experts(suite.TINY_V4_WIDE)) == 1


def test_the_eight_expert_model_mixes_tokens_and_stays_where_the_kernel_is_per_row():
    assert rows_per_warp(built_experts(suite.TINY_V4)) > 1
    for version in ("0.21.0", "0.24.0", "0.26.0"):
        assert matrix_models(version) == {str(suite.TINY_V4)}


def compiled_models(version: str) -> set[str]:
    jobs = [job for job in suite.jobs_for(version) if job.part == "v4-compiled"]
    names = {"v4-nospec", "v4-dspark-overlay-v1-compiled"}
    names |= {"v4-matrix-compiled-reference", "v4-matrix-compiled-n5"}
    if Version(version) >= Version(suite.V4_BREAKABLE_FROM):
        # breakable graphs kept, for the drafter too or the target alone, and stock in
        # the mode that keeps them
        names |= {"v4-matrix-compiled-n5-piecewise", "v4-matrix-compiled-n5-piecewise-target"}
        names.add("v4-matrix-compiled-reference-piecewise")
    assert {job.name for job in jobs} == names
    return {arg for job in jobs for arg in job.args if "tiny-v4" in arg}


def test_the_compiled_part_serves_the_matrix_model_of_its_release():
    """The compiled overlay is judged against compiled stock on one model, and below
    0.21 that is the model whose tokens the hash routing keeps apart."""
    assert compiled_models("0.20.2") == {str(suite.TINY_V4_WIDE)}
    for version in ("0.21.0", "0.24.0", "0.26.0"):
        assert compiled_models(version) == {str(suite.TINY_V4)}


def graph_mode_of(version: str, name: str) -> str | None:
    (job,) = [job for job in suite.jobs_for(version) if job.name == name]
    flag = "--cudagraph-mode"
    return job.args[job.args.index(flag) + 1] if flag in job.args else None


def test_the_compiled_reference_runs_the_mode_the_route_serves():
    """Where vLLM captures V4 breakably the route serves decode-only full graphs
    (dspark.v4_cudagraphs), so the reference it is judged against does too, and stock's
    default mode judges the engines that keep the piecewise half; where the model is
    compiled, both run vLLM's default."""
    for version in ("0.20.2", "0.22.1"):
        assert graph_mode_of(version, "v4-matrix-compiled-reference") is None
    for version in ("0.23.0", "0.24.0", "0.26.0"):
        assert graph_mode_of(version, "v4-matrix-compiled-reference") == "FULL_DECODE_ONLY"
        assert graph_mode_of(version, "v4-matrix-compiled-reference-piecewise") is None
        assert graph_mode_of(version, "v4-matrix-compiled-n5") is None
