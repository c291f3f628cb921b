"""The import path ``tools/gpu/run.sh`` gives a release installed with ``pip --target``
(a folder that reads no ``.pth`` file): the folder, and every folder its ``.pth``
files add, in both forms the CUTLASS DSL's wheels use (a folder named on a line in
4.4 and 4.5, an ``import`` line that inserts it in 4.6). The DSL is a stand-in
package written to a temporary folder: the real wheels are hundreds of MiB and need
CUDA to import."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "tools" / "gpu" / "run.sh"
# the 4.6 wheel's .pth line, with the stand-in's package name
IMPORT_LINE = (
    "import sys, os, dsl_stand_in; "
    "sys.path.insert(0, os.path.join(dsl_stand_in.__path__[0], 'dsl_packages'))\n"
)


def site_path(root: Path, version: str) -> list[str]:
    env = {**os.environ, "GPU_SITE_ROOT": str(root)}
    done = subprocess.run(
        ["bash", str(RUN), "site-path", version],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip().split(os.pathsep)


def test_a_folder_named_on_a_line_and_one_an_import_line_adds_are_both_on_the_path(
    tmp_path: Path,
) -> None:
    site = tmp_path / "0.26.0-v4"
    (site / "dsl_stand_in" / "dsl_packages" / "cutlass").mkdir(parents=True)
    (site / "dsl_stand_in" / "__init__.py").write_text("")
    (site / "older_dsl" / "python_packages").mkdir(parents=True)
    (site / "dsl_import.pth").write_text(IMPORT_LINE)
    (site / "dsl_lined.pth").write_text("# a comment\nolder_dsl/python_packages\nmissing\n")
    path = site_path(tmp_path, "0.26.0-v4")
    assert path[0] == str(site)
    assert set(path[1:]) == {
        str(site / "dsl_stand_in" / "dsl_packages"),
        str(site / "older_dsl" / "python_packages"),
    }


def test_a_release_without_pth_files_is_its_folder_alone(tmp_path: Path) -> None:
    (tmp_path / "0.22.1").mkdir()
    assert site_path(tmp_path, "0.22.1") == [str(tmp_path / "0.22.1")]
