"""The compatibility matrix: generated from every release's source, checked here."""

from __future__ import annotations

import pytest
import vllm_builds

from conftest import REPO, run_python
from vllm_v4_patches import compat, versions
from vllm_v4_patches.registry import Patch, PatchRecord, ProbeResult, Target, load_patches
from vllm_v4_patches.sources import InstalledSource


def test_matrix_covers_every_release_from_0_20_with_at_least_20_rows():
    rows = compat.load_matrix()["versions"]
    assert len(rows) >= 20
    assert min(rows, key=compat._vkey) == compat.FIRST_RELEASE
    assert [v for v, row in rows.items() if row["e2e_verified"]] == list(compat.E2E_VERIFIED)
    assert compat.load_matrix()["patches"] == [p.id for p in load_patches()]


def test_committed_matrix_matches_the_installed_vllm_source():
    installed = compat.matrix_key(versions.detect().raw)
    row = compat.load_matrix()["versions"][installed]
    for patch in load_patches():
        found = patch.probe(InstalledSource())
        expected = row["patches"][patch.id]
        assert (found.verdict, found.variant) == (expected["outcome"], expected.get("variant")), (
            f"vLLM {installed}, patch {patch.id}: committed matrix says {expected}, "
            f"the installed source says {found.verdict} ({found.variant})"
        )


@pytest.mark.sweep
def test_committed_matrix_matches_a_fresh_sweep_of_every_release():
    """Downloads (or reuses cached) sources of every release; minutes on first run,
    which conftest's background prefetch (vllm_builds.py) spends while the other
    tests run, this one coming last."""
    committed = compat.load_matrix()
    listed = compat.list_releases()
    missing = sorted(set(listed) - set(committed["versions"]), key=compat._vkey)
    assert not missing, (
        f"vLLM releases missing from the matrix: {missing}; "
        "run python -m vllm_v4_patches.compat sweep"
    )
    releases = sorted(committed["versions"], key=compat._vkey)
    fresh = compat.sweep(releases, fetch=vllm_builds.fetch_source)
    problems = compat.differences(committed, fresh)
    assert not problems, "\n".join(problems)


def _fake_patch(patch_id: str, probe) -> Patch:  # noqa: ANN001
    record = PatchRecord(
        id=patch_id,
        toggle=f"VLLM_V4_PATCH_{patch_id.upper()}",
        summary="-",
        why="-",
        how="-",
        upstream=(),
        removal_plan="-",
        targets=(Target("vllm.fake", "thing"),),
        vllm_versions=">=0.20",
    )
    return Patch(record=record, probe=probe, apply=lambda patcher, found: "")


def test_a_probe_that_crashes_on_one_release_is_reported_and_the_sweep_goes_on(tmp_path):
    def fragile(source):
        if source.read("vllm.marker") == "odd":
            raise KeyError("unexpected shape")
        return ProbeResult("needed", "fine", variant="V1")

    trees = {}
    for version, marker in (("0.20.0", "plain"), ("0.21.0", "odd"), ("0.22.0", "plain")):
        (tmp_path / version / "vllm").mkdir(parents=True)
        (tmp_path / version / "vllm" / "marker.py").write_text(marker)
        trees[version] = tmp_path / version
    steady = _fake_patch("steady", lambda source: ProbeResult("not-needed", "fixed"))
    matrix = compat.sweep(trees, [_fake_patch("fragile", fragile), steady], fetch=trees.get)
    rows = matrix["versions"]
    assert rows["0.20.0"]["patches"]["fragile"] == {
        "outcome": "needed",
        "detail": "fine",
        "variant": "V1",
    }
    assert rows["0.21.0"]["patches"]["fragile"] == {
        "outcome": "error",
        "detail": "KeyError: 'unexpected shape'",
    }
    assert rows["0.22.0"]["patches"]["fragile"]["outcome"] == "needed"
    assert all(row["patches"]["steady"]["outcome"] == "not-needed" for row in rows.values())


def test_a_release_whose_source_cannot_be_fetched_is_marked_unavailable():
    def unavailable(version):
        raise compat.FetchError("no such release")

    patch = _fake_patch("p", lambda source: ProbeResult("needed", "-"))
    matrix = compat.sweep(["0.20.0"], [patch], fetch=unavailable)
    assert matrix["versions"]["0.20.0"]["patches"]["p"] == {
        "outcome": "unavailable",
        "detail": "no such release",
    }


def test_differences_name_version_patch_and_both_answers():
    cell = {"outcome": "needed", "detail": "-", "variant": "forward"}
    old = {"versions": {"0.31.0": {"patches": {"embedding": cell}}}}
    new = {"versions": {"0.31.0": {"patches": {"embedding": {"outcome": "absent", "detail": "-"}}}}}
    assert compat.differences(old, new) == [
        "vLLM 0.31.0, patch embedding: committed matrix says needed (forward), "
        "the source says absent"
    ]


def test_readme_shows_the_generated_table():
    readme = (REPO / "README.md").read_text()
    begin = readme.index(compat.TABLE_BEGIN) + len(compat.TABLE_BEGIN)
    shown = readme[begin : readme.index(compat.TABLE_END)].strip()
    assert shown == compat.markdown_table(compat.load_matrix())


def test_matrix_command_marks_the_installed_row():
    result = run_python(["-m", "vllm_v4_patches", "matrix"], pythonpath=[REPO])
    installed = compat.matrix_key(versions.detect().raw)
    marked = [line for line in result.stdout.splitlines() if "(installed)" in line]
    assert marked == [line for line in marked if line.startswith(f"| **{installed}** (installed)")]
    assert len(marked) == 1
    assert "needed (forward)" in marked[0]
