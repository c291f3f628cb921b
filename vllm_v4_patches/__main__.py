"""``python -m vllm_v4_patches {path,status,matrix,explain}``."""

from __future__ import annotations

import argparse
import json
import os
import sys

MARKER = "vllm_v4_patches-sitecustomize"


def overlay_dir() -> str:
    """The directory whose ``sitecustomize.py`` activates the overlay.

    A git checkout has it at the repository root (next to the package); a wheel
    ships it inside the package, so nothing lands at the top of site-packages.
    """
    package_dir = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.dirname(package_dir), os.path.join(package_dir, "overlay")):
        if _is_our_sitecustomize(os.path.join(candidate, "sitecustomize.py")):
            return candidate
    raise SystemExit("vllm_v4_patches: no overlay sitecustomize.py found; reinstall the package")


def _is_our_sitecustomize(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as handle:
            return MARKER in handle.read()
    except OSError:
        return False


def _status(as_json: bool) -> int:
    from vllm_v4_patches.runtime import on_engine_start_quietly

    document = on_engine_start_quietly()
    if as_json:
        print(json.dumps(document, indent=1, sort_keys=True))
    else:
        from vllm_v4_patches.status import format_table

        print(format_table(document))
    failed = [p for p, e in document["patches"].items() if e["outcome"] == "failed"]
    return 1 if failed else 0


def _matrix(as_json: bool) -> int:
    from vllm_v4_patches import compat, versions

    matrix = compat.load_matrix()
    installed = compat.matrix_key(versions.detect().raw)
    if as_json:
        gpu = compat.load_gpu_results()["versions"]
        print(json.dumps({"installed": installed, **matrix, "gpu": gpu}, indent=1, sort_keys=True))
        return 0
    print(compat.markdown_table(matrix, mark=installed))
    if installed not in matrix["versions"]:
        print(f"\ninstalled vLLM {installed or 'not found'} is not in the matrix")
    return 0


def _explain(patch_id: str) -> int:
    from vllm_v4_patches.explain import explain

    try:
        print(explain(patch_id.strip()))
    except KeyError as exc:
        print(f"vllm_v4_patches explain: {exc.args[0]}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_v4_patches")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("path", help="print the directory to put on PYTHONPATH")
    status = commands.add_parser(
        "status", help="import the patch targets here and report every patch's outcome"
    )
    status.add_argument("--json", action="store_true", help="the status-file schema")
    matrix = commands.add_parser(
        "matrix", help="the compatibility matrix, with the installed vLLM's row marked"
    )
    matrix.add_argument("--json", action="store_true")
    explain = commands.add_parser(
        "explain", help="a patch's record: why, how, upstream, removal plan, targets, matrix"
    )
    explain.add_argument("patch_id", metavar="ID")
    args = parser.parse_args(argv)
    if args.command == "path":
        print(overlay_dir())
        return 0
    if args.command == "matrix":
        return _matrix(args.json)
    if args.command == "explain":
        return _explain(args.patch_id)
    return _status(args.json)


if __name__ == "__main__":
    sys.exit(main())
