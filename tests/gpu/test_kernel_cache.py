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
