"""Stage one stock vLLM release for the lent H200: wheels, trimmed, in carryable chunks.

    python tools/gpu/stage.py 0.26.0            # -> .cache/gpu-stage/0.26.0/chunk-*
    python tools/gpu/stage.py 0.26.0 --v4       # plus what DeepSeek-V4's NVIDIA path imports
    python tools/gpu/stage.py 0.20.2 --moe-library  # and its MoE kernels alone, one call's carry

The GPU machine reaches no package index and takes at most 64 MiB per call, so the
release travels as wheels split into chunks, one chunk per call (``tools/gpu/run.sh``
joins and installs them there). Steps, all through pip by package name:

1. resolve the release's dependency closure for CPython 3.12 on manylinux x86-64,
   with metadata-only stand-ins for torch/torchaudio/torchvision (the image ships the
   real 2.11 ones, so none of torch's CUDA wheels are fetched);
2. drop what the image already has (``image_packages.txt``) and what an offline engine
   on Hopper never imports;
3. download the rest, and the vLLM wheel with its Ampere FA2 build, Rust router,
   Blackwell kernels and other-Python builds removed;
4. tar the wheels and split the tar into chunks, with a manifest.

Everything is cached per version (and per ``--v4``): a second run returns at once.
The closure of step 2 is kept in ``tools/gpu/pins/VERSION[-v4].txt`` (tracked): the
index moves on, and an unpinned dependency resolved on another day can break an
engine that passed. A fresh machine stages the pinned closure; ``--resolve``
resolves it again and rewrites the pins.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STAGE_ROOT = REPO / ".cache" / "gpu-stage"
PINS = HERE / "pins"
# the routing probe's carry (tools/gpu/hash_routing_probe.py --library): the release's
# MoE kernel library alone, 37-44 MiB, so one call on a fresh machine runs it
PROBE_ROOT = REPO / ".cache" / "gpu-probe"
MOE_LIBRARY = re.compile(r"^vllm/_moe_C(_stable_libtorch)?\.abi3\.so$")
# the GPU image's torch family; a local "+stand.in" version satisfies an exact pin
TORCH_STAND_INS = {"torch": "2.11.0", "torchaudio": "2.11.0", "torchvision": "0.26.0"}
PLATFORM_TAGS = [
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
    "manylinux1_x86_64",
    "any",
]
# closure members an offline engine of a dense model on Hopper never imports
# (video decoders, Blackwell/ROCm kernels, the CUDA compiler wheels: the image has nvcc).
# humming-kernels (160 kB) stays: 0.22's quantization registry imports it for every
# model config, so an engine without it does not start.
NOT_NEEDED = {
    "vllm",
    "pynvvideocodec",
    "torchcodec",
    "fastsafetensors",
    "sentry-sdk",
    "fastapi-cloud-cli",
    "supervisor",
    "tokenspeed-mla",
    "tokenspeed-triton",
    "nvidia-cuda-cccl",
    "nvidia-cuda-crt",
    "nvidia-cuda-nvcc",
    "nvidia-nvvm",
    "nvidia-cutlass-dsl-libs-cu12",
    "flashinfer-cubin",
    "nvidia-cuda-tileiras",
}
# DeepSeek-V4's NVIDIA modules import these (mHC kernels, CUTLASS DSL); kept with --v4
V4_ONLY = {
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base",
    "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu13",
    "quack-kernels",
    "tilelang",
    "z3-solver",
}
# the CUTLASS DSL loads its compiler from one CUDA flavour's libs wheel. A closure that
# asks for plain ``nvidia-cutlass-dsl`` (0.20.x, through its kernel libraries) gets the
# CUDA 12 flavour by default from 4.8, which NOT_NEEDED drops: without the CUDA 13 one
# an engine stops on "No CTK flavor installed"
CUTLASS_DSL = "nvidia-cutlass-dsl"
CUTLASS_CUDA13 = "nvidia-cutlass-dsl-libs-cu13"
# files of the vLLM wheel that a Hopper engine under CPython 3.12 never loads
WHEEL_TRIM = (
    re.compile(r"^vllm/vllm_flash_attn/_vllm_fa2_C\."),  # Ampere FA2; Hopper runs FA3
    re.compile(r"^vllm/vllm-rs/"),
    re.compile(r"^vllm/third_party/fmha_sm100/"),
    re.compile(r"^vllm/third_party/deep_gemm/_C\.cpython-31[3-9]"),
    re.compile(r"^vllm/entrypoints/.*/static/"),
)
# the call also carries the working tree (about 16 MiB with the kept GPU runs, and
# growing); 64 MiB in all
CHUNK_BYTES = 40 * 2**20


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = (HERE / "image_packages.txt").read_text().splitlines()
    return {normalise(line) for line in lines if line.strip() and not line.startswith("#")}


def pip(*args: str) -> None:
    tags = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
    for tag in PLATFORM_TAGS:
        tags += ["--platform", tag]
    subprocess.run([sys.executable, "-m", "pip", *args, *tags], check=True)


def write_stand_in_wheel(folder: Path, name: str, version: str) -> None:
    """A wheel with metadata only, so the resolver treats ``name`` as present."""
    full = f"{version}+stand.in"
    info = f"{name}-{full}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{full}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{name}/__init__.py", "")
        wheel.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {full}\n"
        )
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: stage\nRoot-Is-Purelib: true\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


def resolve(version: str, extras: list[str], scratch: Path) -> list[str]:
    """``name==version`` of every closure member the GPU image lacks."""
    stand_ins = scratch / "stand-ins"
    stand_ins.mkdir()
    for name, torch_version in TORCH_STAND_INS.items():
        write_stand_in_wheel(stand_ins, name, torch_version)
    report = scratch / "report.json"
    pip(
        "install",
        "-q",
        "--dry-run",
        "--ignore-installed",
        "--report",
        str(report),
        "--find-links",
        str(stand_ins),
        "--target",
        str(scratch / "unused"),
        f"vllm=={version}",
        *extras,
    )
    present = image_packages()
    wanted = []
    for item in json.loads(report.read_text())["install"]:
        name, pinned = item["metadata"]["name"], item["metadata"]["version"]
        if normalise(name) in present or "stand.in" in pinned:
            continue
        wanted.append(f"{name}=={pinned}")
    return wanted


def with_cuda13_flavour(wanted: list[str]) -> list[str]:
    """``wanted`` plus the CUTLASS DSL's CUDA 13 libs at the DSL's own version, where
    the closure has the DSL without them (the GPU image is CUDA 13)."""
    pairs = (item.split("==", 1) for item in wanted)
    names = {normalise(name): version for name, version in pairs}
    if CUTLASS_DSL not in names or CUTLASS_CUDA13 in names:
        return wanted
    return [*wanted, f"{CUTLASS_CUDA13}=={names[CUTLASS_DSL]}"]


def trim_vllm_wheel(original: Path, dest_dir: Path) -> Path:
    """Re-zip the vLLM wheel without WHEEL_TRIM's files, RECORD rewritten to match."""
    dest = dest_dir / original.name
    with (
        zipfile.ZipFile(original) as source,
        zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out,
    ):
        kept = [i for i in source.infolist() if not any(p.match(i.filename) for p in WHEEL_TRIM)]
        names = {i.filename for i in kept}
        for info in kept:
            data = source.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = data.decode().splitlines(keepends=True)
                data = "".join(r for r in rows if r.split(",")[0] in names).encode()
            out.writestr(info, data)
    return dest


def staged_name(version: str, with_v4: bool) -> str:
    """The name of a staged release's folder and of its pins."""
    return version + ("-v4" if with_v4 else "")


def pins_file(version: str, with_v4: bool) -> Path:
    return PINS / f"{staged_name(version, with_v4)}.txt"


def read_pins(pins: Path) -> list[str]:
    return [line for line in pins.read_text().splitlines() if line and not line.startswith("#")]


def write_pins(pins: Path, wanted: list[str]) -> None:
    PINS.mkdir(exist_ok=True)
    header = f"# {pins.stem}: the closure tools/gpu/stage.py stages; --resolve rewrites it\n"
    pins.write_text(header + "".join(f"{w}\n" for w in sorted(wanted, key=str.lower)))


def closure(
    version: str, with_v4: bool, extras: list[str], scratch: Path, again: bool
) -> list[str]:
    """The wheels to stage as ``name==version``: the kept pins, or (``again``, no pins
    yet, or extras asked for) a fresh resolution, kept as the pins unless extras
    shaped it."""
    pins = pins_file(version, with_v4)
    if pins.exists() and not again and not extras:
        return read_pins(pins)
    skip = NOT_NEEDED | (set() if with_v4 else V4_ONLY)
    resolved = resolve(version, extras, scratch)
    wanted = [w for w in resolved if normalise(w.split("==")[0]) not in skip]
    if with_v4:
        wanted = with_cuda13_flavour(wanted)
    if not extras:
        write_pins(pins, wanted)
    return wanted


def stage(version: str, with_v4: bool, extras: list[str], again: bool = False) -> Path:
    out = STAGE_ROOT / staged_name(version, with_v4)
    if (out / "manifest.json").exists() and not again:
        return rechunk(out)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        wanted = closure(version, with_v4, extras, scratch, again)
        wheels = scratch / "wheels"
        pip("download", "-q", "--no-deps", "-d", str(wheels), *wanted)
        original = scratch / "vllm-original"
        pip("download", "-q", "--no-deps", "-d", str(original), f"vllm=={version}")
        trim_vllm_wheel(next(original.glob("vllm-*.whl")), wheels)
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        tarball = scratch / "wheels.tar"
        subprocess.run(["tar", "cf", str(tarball), "-C", str(scratch), "wheels"], check=True)
        digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
        chunks = split(tarball, partial)
        manifest = {
            "vllm": version,
            "with_v4": with_v4,
            "wheels": sorted(p.name for p in wheels.iterdir()),
            "tar_bytes": tarball.stat().st_size,
            "tar_sha256": digest,
            "chunks": chunks,
        }
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
    return out


def joined_tar(staged: Path) -> bytes:
    """A staged release's chunks joined into its tar, checked against the manifest."""
    manifest = json.loads((staged / "manifest.json").read_text())
    joined = b"".join((staged / c).read_bytes() for c in manifest["chunks"])
    if hashlib.sha256(joined).hexdigest() != manifest["tar_sha256"]:
        raise SystemExit(f"{staged}: the chunks do not match the manifest's sha256; stage again")
    return joined


def rechunk(out: Path) -> Path:
    """A staged release whose chunks are larger than CHUNK_BYTES, split again (the
    joined tar and its sha256 are unchanged; only the manifest's chunk list is)."""
    manifest = json.loads((out / "manifest.json").read_text())
    if all((out / c).stat().st_size <= CHUNK_BYTES for c in manifest["chunks"]):
        return out
    joined = joined_tar(out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        tarball = Path(tmp) / "wheels.tar"
        tarball.write_bytes(joined)
        manifest["chunks"] = split(tarball, partial)
    (partial / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(out)
    partial.rename(out)
    return out


def extract_moe_library(staged: Path, dest_root: Path = PROBE_ROOT) -> Path:
    """The staged release's MoE kernel library, from the vLLM wheel in its chunks, as
    ``dest_root/VERSION/NAME`` (the routing probe loads it into the machine's torch)."""
    import io
    import tarfile

    version = json.loads((staged / "manifest.json").read_text())["vllm"]
    with tarfile.open(fileobj=io.BytesIO(joined_tar(staged))) as tar:
        wheel = next(m for m in tar.getmembers() if Path(m.name).name.startswith("vllm-"))
        with zipfile.ZipFile(io.BytesIO(tar.extractfile(wheel).read())) as archive:
            member = next((n for n in archive.namelist() if MOE_LIBRARY.match(n)), None)
            if member is None:
                raise SystemExit(f"{wheel.name}: no vllm/_moe_C library in the wheel")
            dest = dest_root / version / Path(member).name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(archive.read(member))
    return dest


def split(tarball: Path, dest: Path) -> list[str]:
    names = []
    with tarball.open("rb") as source:
        while block := source.read(CHUNK_BYTES):
            name = f"chunk-{len(names):02d}"
            (dest / name).write_bytes(block)
            names.append(name)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="a vLLM release pinning torch 2.11 (0.20.x-0.26.0)")
    parser.add_argument("--v4", action="store_true", help="keep DeepSeek-V4's NVIDIA deps")
    parser.add_argument(
        "--moe-library",
        action="store_true",
        help="also copy the release's MoE kernel library to .cache/gpu-probe/VERSION",
    )
    parser.add_argument(
        "--resolve",
        action="store_true",
        help="resolve the closure again (not the pins in tools/gpu/pins) and stage it",
    )
    parser.add_argument("extras", nargs="*", help="more requirements to stage")
    args = parser.parse_args()
    out = stage(args.version, args.v4, args.extras, args.resolve)
    if args.moe_library:
        library = extract_moe_library(out)
        print(f"{library.relative_to(REPO)}: {library.stat().st_size / 2**20:.1f} MiB")
    manifest = json.loads((out / "manifest.json").read_text())
    size = manifest["tar_bytes"] / 2**20
    print(
        f"{out.relative_to(REPO)}: {len(manifest['wheels'])} wheels, {size:.0f} MiB, "
        f"{len(manifest['chunks'])} chunks"
    )


if __name__ == "__main__":
    main()
