"""``python -m vllm_v4_patches explain``: each patch's record as the code holds it."""

from __future__ import annotations

import pytest

from conftest import REPO, run_python
from vllm_v4_patches import compat
from vllm_v4_patches.explain import explain, patch_ids
from vllm_v4_patches.registry import load_patches


@pytest.mark.parametrize("patch", load_patches(), ids=lambda p: p.id)
def test_explain_prints_the_record_and_the_matrix_column(patch):
    text = explain(patch.id)
    record = patch.record
    assert text.startswith(f"{record.id}: {record.summary}")
    assert record.toggle in text and record.vllm_versions in text
    flat = " ".join(text.split())
    for prose in (record.why, record.how, record.removal_plan, *record.upstream):
        assert " ".join(prose.split()) in flat
    for target in record.targets:
        assert str(target) in text
    # every matrix release appears as the first or last of a run
    matrix = compat.load_matrix()["versions"]
    first_release = min(matrix, key=compat._vkey)
    last_release = max(matrix, key=compat._vkey)
    assert f"  {first_release}" in text and last_release in text


def test_an_unknown_id_gets_one_line_naming_the_patches():
    args = ["-m", "vllm_v4_patches", "explain", "nope"]
    result = run_python(args, pythonpath=[str(REPO)], check=False, timeout=60)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "'nope'" in line and all(patch_id in line for patch_id in patch_ids())


def test_readme_shows_the_generated_patch_table():
    from vllm_v4_patches import explain as explain_module

    readme = explain_module.README.read_text()
    begin = readme.index(explain_module.TABLE_BEGIN) + len(explain_module.TABLE_BEGIN)
    shown = readme[begin : readme.index(explain_module.TABLE_END)].strip()
    assert shown == explain_module.patch_table()
    assert len(shown.splitlines()) == 2 + len(load_patches())


def test_each_patch_page_is_generated_from_its_record():
    """``docs/patches/<id>.md`` is what ``--write-docs`` writes today, one per patch."""
    from vllm_v4_patches import explain as explain_module

    pages = explain_module.PATCH_PAGES
    assert sorted(page.stem for page in pages.glob("*.md")) == sorted(patch_ids())
    for patch in load_patches():
        page = (pages / f"{patch.id}.md").read_text()
        assert page == explain_module.patch_page(patch.id), patch.id
        flat = " ".join(page.split())
        for prose in (patch.record.why, patch.record.how, patch.record.removal_plan):
            assert " ".join(prose.split()) in flat
