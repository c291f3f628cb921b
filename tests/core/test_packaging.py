"""The pip-installed way in: the wheel's layout, ``path`` from it, and the plugin entry point."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, read_status_files, run_python


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
        cwd=out,
    )
    [built] = out.glob("vllm_v4_patches-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
        + [str(wheel)],
        check=True,
        capture_output=True,
    )
    return target


def test_wheel_ships_the_overlay_inside_the_package_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "sitecustomize.py" not in names
    assert "vllm_v4_patches/overlay/sitecustomize.py" in names
    overlay = zipfile.ZipFile(wheel).read("vllm_v4_patches/overlay/sitecustomize.py").decode()
    assert overlay == (REPO / "sitecustomize.py").read_text()
    [entry_points] = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[vllm.general_plugins]" in text
    assert "vllm_v4_patches = vllm_v4_patches.runtime:vllm_plugin" in text


def test_path_from_an_installed_wheel_points_inside_the_package(installed):
    result = run_python(["-m", "vllm_v4_patches", "path"], pythonpath=[installed])
    overlay = Path(result.stdout.strip())
    assert overlay == installed / "vllm_v4_patches" / "overlay"
    assert (overlay / "sitecustomize.py").is_file()
    assert not (installed / "sitecustomize.py").exists()


CHECK_ONCE = """
import json
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
forward = VocabParallelEmbedding.__dict__["forward"]
inner = getattr(forward, "__wrapped__", forward)
print(json.dumps({
    "wrapped_once": inner is not forward and not hasattr(inner, "__wrapped__"),
    "patched": hasattr(forward, "_self_vllm_v4_patch_id"),
}))
"""


@pytest.mark.parametrize("ways", ["plugin only", "plugin and sitecustomize"])
def test_plugin_entry_point_applies_each_patch_exactly_once(installed, tmp_path, ways):
    path = [installed]
    if ways == "plugin and sitecustomize":
        path.append(
            run_python(["-m", "vllm_v4_patches", "path"], pythonpath=[installed]).stdout.strip()
        )
    result = run_python(
        ["-c", CHECK_ONCE],
        pythonpath=path,
        env={"VLLM_V4_PATCHES_STATUS_DIR": str(tmp_path)},
    )
    assert result.stdout.strip().splitlines()[-1] == '{"wrapped_once": true, "patched": true}'
    [document] = read_status_files(tmp_path)
    assert document["patches"]["embedding"]["outcome"] == "applied"
    assert result.stderr.count("vllm_v4_patches [front-end") == 1  # one summary line


def test_vllm_plugins_allowlist_without_us_leaves_the_plugin_path_off(installed, tmp_path):
    result = run_python(
        ["-c", CHECK_ONCE],
        pythonpath=[installed],
        env={
            "VLLM_PLUGINS": "lora_filesystem_resolver",
            "VLLM_V4_PATCHES_STATUS_DIR": str(tmp_path),
        },
    )
    assert '{"wrapped_once": false, "patched": false}' in result.stdout
    assert read_status_files(tmp_path) == []
