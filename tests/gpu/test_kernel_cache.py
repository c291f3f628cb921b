"""The GPU suite's kernel cache: where the jobs are told to build into, and the
archive it hands back (no GPU needed: a folder of files stands for the kernels)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import suite  # noqa: E402


def test_every_jit_cache_points_into_the_carried_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "KERNEL_CACHE", tmp_path / "kernels")
    env = suite.kernel_cache_env()
    named = {"TILELANG_CACHE_DIR", "DG_JIT_CACHE_DIR", "TRITON_CACHE_DIR"}
    assert set(env) == named | {"FLASHINFER_WORKSPACE_BASE"}
    assert all(Path(value).parent == tmp_path / "kernels" for value in env.values())


def test_the_cache_comes_back_packed_in_parts_unless_too_large(tmp_path, monkeypatch):
    kernels = tmp_path / "kernels"
    (kernels / "tilelang").mkdir(parents=True)
    # random bytes: gzip cannot shrink them under the part size below
    (kernels / "tilelang" / "kernel.so").write_bytes(os.urandom(4096))
    monkeypatch.setattr(suite, "KERNEL_CACHE", kernels)
    out = tmp_path / "out"
    out.mkdir()
    assert "handed back" in suite.hand_back_kernel_cache(out)
    with tarfile.open(out / "kernel-cache.tar.gz") as packed:
        assert "gpu-kernels/tilelang/kernel.so" in packed.getnames()
    (out / "kernel-cache.tar.gz").unlink()
    monkeypatch.setattr(suite, "KERNEL_CACHE_LIMIT", 2048)
    assert "in 3 parts" in suite.hand_back_kernel_cache(out)
    parts = sorted(out.glob("kernel-cache.tar.gz*"))
    assert [p.name for p in parts] == [f"kernel-cache.tar.gz.part{i}" for i in range(3)]
    assert all(p.stat().st_size <= 2048 for p in parts)
    joined = b"".join(p.read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(joined)) as packed:
        member = packed.extractfile("gpu-kernels/tilelang/kernel.so")
        assert member.read() == (kernels / "tilelang" / "kernel.so").read_bytes()
    for part in parts:
        part.unlink()
    monkeypatch.setattr(suite, "KERNEL_CACHE_LIMIT", 1024)
    assert "too large" in suite.hand_back_kernel_cache(out)
    assert not list(out.iterdir())
    monkeypatch.setattr(suite, "KERNEL_CACHE", tmp_path / "none")
    assert suite.hand_back_kernel_cache(out) == "no kernel cache"


def test_run_sh_unpacks_the_carried_parts_once(tmp_path):
    """run.sh's unpack step on a copy of the checkout's layout (bash and tar, no GPU)."""
    kernels = tmp_path / "made" / "gpu-kernels"
    (kernels / "triton").mkdir(parents=True)
    (kernels / "triton" / "k.json").write_text("{}")
    packed = tmp_path / "repo" / ".cache" / "gpu-kernels-packed"
    packed.mkdir(parents=True)
    with tarfile.open(packed / "kernel-cache.tar.gz", "w:gz") as archive:
        archive.add(kernels, arcname="gpu-kernels")
    whole = (packed / "kernel-cache.tar.gz").read_bytes()
    (packed / "kernel-cache.tar.gz").unlink()
    half = len(whole) // 2
    (packed / "kernel-cache.tar.gz.part0").write_bytes(whole[:half])
    (packed / "kernel-cache.tar.gz.part1").write_bytes(whole[half:])
    script = (REPO / "tools" / "gpu" / "run.sh").read_text()
    start = script.index("unpack_kernels() {")
    function = script[start : script.index("}\n", start) + 2]
    repo = tmp_path / "repo"
    run = ["bash", "-c", f"set -euo pipefail\n{function}\nunpack_kernels"]
    first = subprocess.run(run, cwd=repo, capture_output=True, text=True, check=True)
    assert "kernel cache unpacked" in first.stdout
    assert (repo / ".cache" / "gpu-kernels" / "triton" / "k.json").read_text() == "{}"
    # a later call of the hold keeps the folder it has grown
    (repo / ".cache" / "gpu-kernels" / "triton" / "grown.json").write_text("[]")
    again = subprocess.run(run, cwd=repo, capture_output=True, text=True, check=True)
    assert again.stdout == ""
    assert (repo / ".cache" / "gpu-kernels" / "triton" / "grown.json").exists()


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


def test_a_file_gone_while_packing_costs_the_hand_back_not_the_suite(tmp_path, monkeypatch):
    """Another release's suite in the same hold removes a temporary file between the
    listing and the reading of the folder. The moment is forced: a wrapper around
    tarfile's own ``gettarinfo`` removes the file just before tarfile reads it."""
    kernels = tmp_path / "kernels"
    (kernels / "triton").mkdir(parents=True)
    (kernels / "triton" / "kept.json").write_text("{}")
    (kernels / "triton" / "tmp.partial").write_text("being written")
    monkeypatch.setattr(suite, "KERNEL_CACHE", kernels)
    original = tarfile.TarFile.gettarinfo

    def gone_first(self, name=None, *args, **kwargs):
        if name is not None and str(name).endswith("tmp.partial"):
            os.unlink(name)
        return original(self, name, *args, **kwargs)

    monkeypatch.setattr(tarfile.TarFile, "gettarinfo", gone_first)
    out = tmp_path / "out"
    out.mkdir()
    line = suite.hand_back_kernel_cache(out)
    assert line.startswith("kernel cache not handed back: ") and "tmp.partial" in line
    assert not list(out.iterdir())  # no half archive left to be carried
    # with the folder still, it is handed back whole
    assert "handed back:" in suite.hand_back_kernel_cache(out)
