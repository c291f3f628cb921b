"""The GPU suite's checks as tests: stock against patched vLLM on one real GPU.

Each check of ``tools/gpu/suite.py`` is one test, over one set of real engines
started once for the module (several at a time on the one GPU). Skipped where
there is no CUDA device (CI), so this file runs on the GPU machine only:

    tools/gpu/run.sh install 0.26.0
    PYTHONPATH=/tmp/gpu-site/0.26.0 VLLM_GPU_SITE=/tmp/gpu-site/0.26.0 \\
        python3 -m pytest -m gpu tests/gpu

``tools/gpu/run.sh suite`` runs the same checks and records their figures.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu"))

import suite  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("vllm")
    version = suite.environment()["vllm"]
    scratch = tmp_path_factory.mktemp("gpu-suite")
    chosen = suite.jobs_for(version, torch.cuda.device_count())
    return suite.run_jobs(chosen, 8, time.perf_counter() + 900, scratch)


@pytest.mark.parametrize("name", list(suite.CHECKS))
def test_gpu_check(outcomes, name):
    try:
        passed, figure = suite.CHECKS[name](outcomes)
    except suite.NotRun as exc:
        pytest.skip(str(exc))
    except suite.Missing as exc:
        pytest.fail(str(exc))
    assert passed, figure
