"""The GPU suite's kernel cache: where the jobs are told to build into, and the
archive it hands back (no GPU needed: a folder of files stands for the kernels)."""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import suite  # noqa: E402


def test_every_jit_cache_points_into_the_carried_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "KERNEL_CACHE", tmp_path / "kernels")
    env = suite.kernel_cache_env()
    assert set(env) == {"TILELANG_CACHE_DIR", "DG_JIT_CACHE_DIR", "TRITON_CACHE_DIR"}
    assert all(Path(value).parent == tmp_path / "kernels" for value in env.values())


def test_the_cache_comes_back_packed_unless_it_is_too_large(tmp_path, monkeypatch):
    kernels = tmp_path / "kernels"
    (kernels / "tilelang").mkdir(parents=True)
    (kernels / "tilelang" / "kernel.so").write_bytes(b"\0" * 4096)
    monkeypatch.setattr(suite, "KERNEL_CACHE", kernels)
    out = tmp_path / "out"
    out.mkdir()
    assert "handed back" in suite.hand_back_kernel_cache(out)
    with tarfile.open(out / "kernel-cache.tar.gz") as packed:
        assert "gpu-kernels/tilelang/kernel.so" in packed.getnames()
    monkeypatch.setattr(suite, "KERNEL_CACHE_LIMIT", 10)
    assert "too large" in suite.hand_back_kernel_cache(out)
    assert not (out / "kernel-cache.tar.gz").exists()
    monkeypatch.setattr(suite, "KERNEL_CACHE", tmp_path / "none")
    assert suite.hand_back_kernel_cache(out) == "no kernel cache"


def test_eager_v4_jobs_keep_vllm_caches_per_side_and_the_rest_per_call(tmp_path, monkeypatch):
    kernels = tmp_path / "kernels"
    monkeypatch.setattr(suite, "KERNEL_CACHE", kernels)
    by_name = {job.name: job for job in suite.jobs()}
    scratch = tmp_path / "scratch"
    roots = {name: suite.vllm_cache_root(job, scratch) for name, job in by_name.items()}
    assert roots["v4-nospec-eager"] == roots["v4-matrix-reference"] == kernels / "vllm-stock"
    assert roots["v4-dspark-overlay-v1"] == roots["v4-matrix-n5"] == kernels / "vllm-overlay"
    # compiled graphs stay with the call: stock's and the overlay's must not meet
    assert roots["v4-nospec"] == roots["v4-dspark-overlay-v1-compiled"] == scratch / "vllm-cache"
    assert roots["v4-dspark-stock"] == kernels / "vllm-stock"
    assert roots["bench-dspark"] == scratch / "vllm-cache"
