"""The staging tool's chunks (``tools/gpu/stage.py``): a staged release with chunks
larger than a call can carry beside the tree is split again without changing the
joined tar, a damaged one is refused, and one chunk still fits a call beside the
tracked tree. Real files in a temporary folder; no download."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# what one device call carries (the tree and its carry paths) is 64 MiB, but a call of
# 63.9 MiB by file sizes was refused (2026-12-07): keep 4 MiB of room
CALL_ROOM = 60 * 2**20


@pytest.fixture()
def stage(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_stage", REPO / "tools" / "gpu" / "stage.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_stage", module)
    spec.loader.exec_module(module)
    return module


def staged(stage, root: Path, payload: bytes, chunk_bytes: int) -> Path:
    out = root / "0.0.0-v4"
    out.mkdir()
    tarball = root / "wheels.tar"
    tarball.write_bytes(payload)
    stage.CHUNK_BYTES = chunk_bytes
    chunks = stage.split(tarball, out)
    manifest = {"vllm": "0.0.0", "tar_sha256": hashlib.sha256(payload).hexdigest()}
    (out / "manifest.json").write_text(json.dumps({**manifest, "chunks": chunks}))
    return out


def joined(out: Path) -> bytes:
    manifest = json.loads((out / "manifest.json").read_text())
    return b"".join((out / c).read_bytes() for c in manifest["chunks"])


def test_rechunk_splits_large_chunks_keeping_the_tar(stage, tmp_path):
    payload = bytes(range(256)) * 40
    out = staged(stage, tmp_path, payload, chunk_bytes=4000)
    assert len(json.loads((out / "manifest.json").read_text())["chunks"]) == 3
    stage.CHUNK_BYTES = 1000
    assert stage.rechunk(out) == out
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["chunks"]) == 11
    assert sorted(p.name for p in out.glob("chunk-*")) == manifest["chunks"]
    assert all((out / c).stat().st_size <= 1000 for c in manifest["chunks"])
    assert joined(out) == payload
    assert manifest["tar_sha256"] == hashlib.sha256(payload).hexdigest()


def test_rechunk_leaves_small_chunks_alone(stage, tmp_path):
    out = staged(stage, tmp_path, b"x" * 2500, chunk_bytes=1000)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    stage.rechunk(out)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_rechunk_refuses_chunks_that_do_not_match_the_manifest(stage, tmp_path):
    out = staged(stage, tmp_path, b"y" * 5000, chunk_bytes=4000)
    (out / "chunk-01").write_bytes(b"z" * 1000)
    stage.CHUNK_BYTES = 1000
    with pytest.raises(SystemExit, match="sha256"):
        stage.rechunk(out)
    assert (out / "chunk-00").stat().st_size == 4000  # the staged folder is untouched


def test_a_chunk_fits_a_call_beside_the_tracked_tree(stage):
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    tree = sum((REPO / f.decode()).stat().st_size for f in files if f)
    manifest = 64 * 2**10  # the manifest travels with the first chunk
    assert tree + stage.CHUNK_BYTES + manifest < CALL_ROOM, (
        f"the tracked tree ({tree / 2**20:.1f} MiB) and one {stage.CHUNK_BYTES / 2**20:.0f} "
        "MiB chunk no longer fit one call: lower CHUNK_BYTES or prune docs/gpu-runs"
    )


def staged_wheel(stage, root: Path, members: dict[str, bytes]) -> Path:
    """A staged release whose tar holds one vLLM wheel with these members."""
    import io
    import tarfile
    import zipfile

    wheel = io.BytesIO()
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w") as tar:
        info = tarfile.TarInfo("wheels/vllm-0.0.0-cp38-abi3-manylinux_2_35_x86_64.whl")
        info.size = len(wheel.getvalue())
        tar.addfile(info, io.BytesIO(wheel.getvalue()))
    return staged(stage, root, tar_bytes.getvalue(), chunk_bytes=4096)


@pytest.mark.parametrize("name", ["_moe_C.abi3.so", "_moe_C_stable_libtorch.abi3.so"])
def test_the_moe_library_comes_out_of_the_staged_wheel(stage, tmp_path, name):
    library = bytes(range(256)) * 50  # spans several chunks
    members = {f"vllm/{name}": library, "vllm/_C.abi3.so": b"other", "vllm/__init__.py": b""}
    out = staged_wheel(stage, tmp_path, members)
    dest = stage.extract_moe_library(out, tmp_path / "probe")
    assert dest == tmp_path / "probe" / "0.0.0" / name
    assert dest.read_bytes() == library


def test_a_wheel_without_the_moe_library_is_refused(stage, tmp_path):
    out = staged_wheel(stage, tmp_path, {"vllm/_C.abi3.so": b"other"})
    with pytest.raises(SystemExit, match="no vllm/_moe_C library"):
        stage.extract_moe_library(out, tmp_path / "probe")


def test_a_v4_closure_gets_the_cutlass_dsl_cuda13_flavour_at_the_dsls_version(stage):
    plain = ["nvidia_cutlass_dsl==4.8.1", "nvidia-cutlass-dsl-libs-base==4.8.1", "z3-solver==4.15"]
    assert stage.with_cuda13_flavour(plain) == [*plain, "nvidia-cutlass-dsl-libs-cu13==4.8.1"]
    flavoured = ["nvidia-cutlass-dsl==4.6.0", "nvidia-cutlass-dsl-libs-cu13==4.6.0"]
    assert stage.with_cuda13_flavour(flavoured) == flavoured
    assert stage.with_cuda13_flavour(["quack-kernels==0.6.5"]) == ["quack-kernels==0.6.5"]


def test_a_fresh_machine_stages_the_kept_pins_and_resolve_rewrites_them(stage, tmp_path):
    """The resolver is a stand-in here (the real one asks the package index): the pins
    are what a fresh machine stages, and only ``--resolve`` (or extras) resolves."""
    stage.PINS = tmp_path / "pins"
    resolved = {"now": ["nvidia-cutlass-dsl==4.8.1", "z3-solver==4.15", "cuda-tile==1.0"]}
    stage.resolve = lambda version, extras, scratch: resolved["now"] + extras
    first = stage.closure("0.20.2", True, [], tmp_path, again=False)
    assert "nvidia-cutlass-dsl-libs-cu13==4.8.1" in first
    pins = tmp_path / "pins" / "0.20.2-v4.txt"
    assert pins.read_text().startswith("# 0.20.2-v4:")
    resolved["now"] = ["nvidia-cutlass-dsl==4.9.0", "z3-solver==4.16"]  # the index moved
    assert sorted(stage.closure("0.20.2", True, [], tmp_path, again=False)) == sorted(first)
    with_extra = stage.closure("0.20.2", True, ["quack-kernels==0.6.5"], tmp_path, again=False)
    assert "quack-kernels==0.6.5" in with_extra
    assert sorted(stage.read_pins(pins)) == sorted(first)  # extras leave the pins alone
    again = stage.closure("0.20.2", True, [], tmp_path, again=True)
    assert sorted(stage.read_pins(pins)) == sorted(again)
    assert "nvidia-cutlass-dsl-libs-cu13==4.9.0" in again
    # without --v4 the V4-only wheels are not staged, and the pins are their own file
    assert stage.closure("0.20.2", False, [], tmp_path, again=False) == []


def test_the_kept_pins_are_what_the_stager_would_keep(stage):
    files = sorted((REPO / "tools" / "gpu" / "pins").glob("*.txt"))
    assert files
    for pins in files:
        wanted = stage.read_pins(pins)
        names = [stage.normalise(w.split("==")[0]) for w in wanted]
        assert all(w.count("==") == 1 for w in wanted), pins.name
        assert not set(names) & stage.NOT_NEEDED, pins.name
        assert len(set(names)) == len(names), pins.name
        if pins.stem.endswith("-v4"):
            assert stage.with_cuda13_flavour(wanted) == wanted, pins.name
        else:
            assert not set(names) & stage.V4_ONLY, pins.name
