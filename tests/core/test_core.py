"""The core against synthetic targets: outcomes, idempotency, revert, strict mode.

The targets are small modules written to a temporary directory: the core is
generic, and these tests exercise it without vLLM (its real targets are covered
in test_embedding.py and the end-to-end tests).
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import logging
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_v4_patches.errors import ProbeError, StrictModeError
from vllm_v4_patches.patcher import KnownCopy, Patcher, RevertError, is_patched_by
from vllm_v4_patches.registry import Patch, PatchRecord, ProbeResult, Target
from vllm_v4_patches.runtime import Runtime, build_runtime, install_hooks

_names = itertools.count()
_matrix_note = Runtime._matrix_note


@pytest.fixture(autouse=True)
def no_matrix_notes(monkeypatch):
    """Synthetic patches have no matrix cells; the two matrix tests restore the check."""
    monkeypatch.setattr(Runtime, "_matrix_note", lambda self, patch_id, verdict: "")


@pytest.fixture
def target_module(tmp_path, monkeypatch):
    """Write a fresh uniquely named target module; return its name (not imported)."""
    name = f"synthetic_target_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
            def greet():
                return "stock"

            class Greeter:
                def hello(self, who):
                    return "hello " + who
            """))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield name
    sys.modules.pop(name, None)


def make_patch(module: str, *, verdict="needed", apply=None, probe=None, versions=">=0"):
    def default_apply(patcher: Patcher, found: ProbeResult) -> str:
        target = importlib.import_module(module)
        patcher.wrap(target.Greeter, "hello", lambda w, i, a, k: w(*a, **k).upper())
        return "wrapped Greeter.hello"

    record = PatchRecord(
        id="synthetic",
        toggle="VLLM_V4_PATCH_SYNTHETIC",
        summary="test patch",
        why="-",
        how="-",
        upstream=(),
        removal_plan="-",
        targets=(Target(module, "Greeter.hello"),),
        vllm_versions=versions,
    )
    return Patch(
        record=record,
        probe=probe or (lambda source: ProbeResult(verdict, f"probe says {verdict}")),
        apply=apply or default_apply,
    )


def activate(patch: Patch):
    runtime = build_runtime([patch])
    install_hooks(runtime)
    return runtime


def outcome(runtime) -> tuple[str, str]:
    entry = runtime.document()["patches"]["synthetic"]
    return entry["outcome"], entry["detail"]


def test_patch_applies_when_the_target_is_imported(target_module):
    runtime = activate(make_patch(target_module))
    assert runtime.states["synthetic"].status is None  # lazy: nothing imported yet
    module = importlib.import_module(target_module)
    assert module.Greeter().hello("you") == "HELLO YOU"
    assert outcome(runtime) == ("applied", "wrapped Greeter.hello")


def test_patch_applies_at_once_when_the_target_is_already_imported(target_module):
    module = importlib.import_module(target_module)
    runtime = activate(make_patch(target_module))
    assert outcome(runtime)[0] == "applied"
    assert module.Greeter().hello("x") == "HELLO X"


def test_apply_twice_is_a_no_op_and_revert_restores_the_original_object(target_module):
    module = importlib.import_module(target_module)
    original = module.Greeter.__dict__["hello"]
    runtime = activate(make_patch(target_module))
    wrapped = module.Greeter.__dict__["hello"]
    assert wrapped is not original and is_patched_by(wrapped, "synthetic")

    runtime.reapply("synthetic")
    assert module.Greeter.__dict__["hello"] is wrapped
    assert wrapped.__wrapped__ is original  # one layer, not two

    runtime.revert("synthetic")
    assert module.Greeter.__dict__["hello"] is original
    assert module.Greeter().hello("x") == "hello x"
    assert outcome(runtime) == ("disabled", "reverted in this process")

    runtime.reapply("synthetic")
    assert module.Greeter().hello("x") == "HELLO X"


def test_patcher_wrap_twice_does_not_double_wrap(target_module):
    module = importlib.import_module(target_module)
    patcher = Patcher("synthetic")
    first = patcher.wrap(module.Greeter, "hello", lambda w, i, a, k: w(*a, **k) + "!")
    second = patcher.wrap(module.Greeter, "hello", lambda w, i, a, k: w(*a, **k) + "!")
    assert first is second and module.Greeter().hello("x") == "hello x!"


def test_revert_refuses_to_clobber_a_newer_wrapper(target_module):
    module = importlib.import_module(target_module)
    patcher = Patcher("synthetic")
    ours = patcher.wrap(module.Greeter, "hello", lambda w, i, a, k: w(*a, **k))

    def someone_elses(self, who):
        return ours(self, who)

    module.Greeter.hello = someone_elses
    with pytest.raises(RevertError, match="replaced after"):
        patcher.revert()
    assert module.Greeter.__dict__["hello"] is someone_elses


def test_a_raising_apply_leaves_the_target_importable_and_records_failed(target_module):
    def broken_apply(patcher: Patcher, found: ProbeResult) -> str:
        target = importlib.import_module(target_module)
        patcher.wrap(target.Greeter, "hello", lambda w, i, a, k: "half-applied")
        raise KeyError("no such attribute in this vLLM")

    runtime = activate(make_patch(target_module, apply=broken_apply))
    module = importlib.import_module(target_module)
    assert module.Greeter().hello("x") == "hello x"  # the half-applied swap was undone
    result, detail = outcome(runtime)
    assert result == "failed" and "KeyError" in detail and "no such attribute" in detail


def test_strict_mode_turns_a_failed_patch_into_an_import_error(target_module, monkeypatch):
    monkeypatch.setenv("VLLM_V4_PATCHES_STRICT", "1")

    def broken_apply(patcher, found):
        raise RuntimeError("boom")

    activate(make_patch(target_module, apply=broken_apply))
    with pytest.raises(StrictModeError, match="synthetic failed: apply: RuntimeError: boom"):
        importlib.import_module(target_module)


def test_a_probe_error_is_failed_and_the_target_untouched(target_module):
    def confused(source):
        raise ProbeError("unrecognised shape")

    runtime = activate(make_patch(target_module, probe=confused))
    module = importlib.import_module(target_module)
    assert outcome(runtime) == ("failed", "probe: unrecognised shape")
    assert module.Greeter().hello("x") == "hello x"


@pytest.mark.parametrize("verdict", ["not-needed", "absent"])
def test_probe_verdicts_other_than_needed_leave_the_target_alone(target_module, verdict):
    runtime = activate(make_patch(target_module, verdict=verdict))
    module = importlib.import_module(target_module)
    assert outcome(runtime) == (verdict, f"probe says {verdict}")
    assert module.Greeter().hello("x") == "hello x"


def test_out_of_range_version_skips_without_probing(target_module, monkeypatch):
    monkeypatch.setenv("VLLM_V4_PATCHES_VLLM_VERSION", "0.9.2")

    def must_not_run(source):
        raise AssertionError("probe ran")

    runtime = activate(make_patch(target_module, versions=">=0.10", probe=must_not_run))
    importlib.import_module(target_module)
    assert outcome(runtime) == ("out-of-range", "vLLM 0.9.2 is outside >=0.10")


def test_unknown_version_lets_the_probe_decide_and_says_so(target_module, monkeypatch):
    import vllm_v4_patches.versions as versions

    monkeypatch.setattr(versions, "detect", lambda: versions.DetectedVersion("dev", "test"))
    runtime = activate(make_patch(target_module, versions=">=0.10"))
    importlib.import_module(target_module)
    result, detail = outcome(runtime)
    assert result == "applied" and "version unknown" in detail and "probe decided" in detail


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"VLLM_V4_PATCHES": "0"}, "disabled"),
        ({"VLLM_V4_PATCHES": "off", "VLLM_V4_PATCH_SYNTHETIC": "1"}, "disabled"),
        ({"VLLM_V4_PATCH_SYNTHETIC": "false"}, "disabled"),
        ({"VLLM_V4_PATCHES": "1", "VLLM_V4_PATCH_SYNTHETIC": "on"}, "applied"),
        ({"VLLM_V4_PATCH_SYNTHETIC": "maybe"}, "applied"),  # malformed: default on
    ],
)
def test_toggles_decide_before_anything_is_probed(target_module, monkeypatch, settings, expected):
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    runtime = activate(make_patch(target_module))
    module = importlib.import_module(target_module)
    assert outcome(runtime)[0] == expected
    assert (module.Greeter().hello("x") == "HELLO X") == (expected == "applied")


def test_known_copies_are_rebound_now_and_on_later_import(tmp_path, monkeypatch):
    suffix = next(_names)
    source, early, late = (f"copies_{role}_{suffix}" for role in ("source", "early", "late"))
    (tmp_path / f"{source}.py").write_text("def compute():\n    return 1\n")
    for name in (early, late):
        (tmp_path / f"{name}.py").write_text(f"from {source} import compute\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    source_mod, early_mod = importlib.import_module(source), importlib.import_module(early)
    original = source_mod.compute

    patcher = Patcher("synthetic")
    wrapper = patcher.wrap(source_mod, "compute", lambda w, i, a, k: w(*a, **k) + 1)
    copies = (KnownCopy(early, "compute"), KnownCopy(late, "compute"))
    patcher.rebind_copies(original, wrapper, copies)
    assert early_mod.compute is wrapper
    assert patcher.copies_audit() == (1, 1, [])
    late_mod = importlib.import_module(late)
    assert late_mod.compute is wrapper and late_mod.compute() == 2
    assert patcher.copies_audit() == (2, 2, [])

    late_mod.compute = original  # something rebinds a stale copy behind our back
    assert patcher.copies_audit() == (1, 2, [f"{late}.compute"])
    late_mod.compute = wrapper
    patcher.revert()
    assert source_mod.compute is original and early_mod.compute is original
    assert late_mod.compute is original


def test_status_file_has_the_documented_schema(target_module, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_V4_PATCHES_STATUS_DIR", str(tmp_path / "status"))
    runtime = activate(make_patch(target_module))
    importlib.import_module(target_module)
    runtime.report_once()
    files = list((tmp_path / "status").glob("*.json"))
    assert [f.name for f in files] == [f"{runtime.document()['pid']}.json"]
    document = json.loads(files[0].read_text())
    assert set(document) == {"pid", "role", "vllm_version", "overlay", "patches"}
    assert document["role"] == "front-end"
    package = Path(__file__).resolve().parents[2] / "vllm_v4_patches"
    assert document["overlay"] == {"package": str(package), "skipped_copies": []}
    assert document["patches"] == {
        "synthetic": {"outcome": "applied", "detail": "wrapped Greeter.hello"}
    }
    runtime.revert("synthetic")  # later changes rewrite the same file
    document = json.loads(files[0].read_text())
    assert document["patches"]["synthetic"]["outcome"] == "disabled"


def test_a_matrix_disagreement_is_warned_and_the_live_probe_decides(
    target_module, monkeypatch, caplog
):
    from vllm_v4_patches import compat

    monkeypatch.setattr(Runtime, "_matrix_note", _matrix_note)
    row = {"patches": {"synthetic": {"outcome": "not-needed"}}}
    monkeypatch.setattr(compat, "load_matrix", lambda: {"versions": {"0.32.0": row}})
    monkeypatch.setenv("VLLM_V4_PATCHES_VLLM_VERSION", "0.32.0+cpu")
    with caplog.at_level("WARNING", logger="vllm_v4_patches"):
        runtime = activate(make_patch(target_module))
        importlib.import_module(target_module)
    result, detail = outcome(runtime)
    assert result == "applied"
    assert "the matrix says not-needed" in detail and "the source decided" in detail
    assert "compatibility matrix says not-needed" in caplog.text


def test_a_version_outside_the_matrix_is_said_in_the_detail(target_module, monkeypatch):
    monkeypatch.setattr(Runtime, "_matrix_note", _matrix_note)
    monkeypatch.setenv("VLLM_V4_PATCHES_VLLM_VERSION", "0.99.0")
    runtime = activate(make_patch(target_module))
    importlib.import_module(target_module)
    result, detail = outcome(runtime)
    assert result == "applied"
    assert "vLLM 0.99.0 is not in the compatibility matrix; the probe decided" in detail


def test_a_target_finished_inside_an_import_cycle_waits_for_the_other_target(tmp_path, monkeypatch):
    """``outer`` imports ``inner`` before defining its class: ``inner``'s import
    completes while ``outer`` is half built. Applying then would meet a module
    without ``Greeter``; the patch must apply once ``outer`` completes."""
    suffix = next(_names)
    outer, inner = f"cycle_outer_{suffix}", f"cycle_inner_{suffix}"
    (tmp_path / f"{inner}.py").write_text("VALUE = 1\n")
    (tmp_path / f"{outer}.py").write_text(textwrap.dedent(f"""
            import {inner}

            class Greeter:
                def hello(self, who):
                    return "hello " + who
            """))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()

    def apply(patcher: Patcher, found: ProbeResult) -> str:
        return patcher.wrap_when_imported(
            outer, "Greeter", "hello", lambda w, i, a, k: w(*a, **k).upper()
        )

    patch = make_patch(outer, apply=apply)
    targets = (Target(inner, "VALUE"), Target(outer, "Greeter.hello"))
    patch = Patch(
        record=dataclasses.replace(patch.record, targets=targets),
        probe=patch.probe,
        apply=patch.apply,
    )
    runtime = activate(patch)
    try:
        module = importlib.import_module(outer)
        assert outcome(runtime) == ("applied", "wrapped")
        assert module.Greeter().hello("you") == "HELLO YOU"
    finally:
        sys.modules.pop(outer, None)
        sys.modules.pop(inner, None)


def test_a_registration_made_on_import_is_undone_on_revert(target_module):
    registry: dict[str, str] = {}

    def register(module) -> object:
        registry["arch"] = module.__name__
        return lambda: registry.pop("arch")

    patcher = Patcher("synthetic")
    assert patcher.register_when_imported(target_module, "registry[arch]", register) == "armed"
    assert registry == {} and patcher.active
    importlib.import_module(target_module)
    assert registry == {"arch": target_module}
    patcher.revert()
    assert registry == {} and not patcher.active


def test_installed_source_reads_a_submodule_without_importing_its_package(tmp_path, monkeypatch):
    """Probes run while vLLM is still importing; locating ``pkg.sub`` through the
    import system would execute ``pkg/__init__.py`` (here: raise)."""
    from vllm_v4_patches.sources import InstalledSource

    package = f"half_built_{next(_names)}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("raise ImportError('mid-import')\n")
    (tmp_path / package / "sub.py").write_text("MARK = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    source = InstalledSource()
    assert source.read(f"{package}.sub") == "MARK = 1\n"
    assert source.read(f"{package}.missing") is None
    assert package not in sys.modules


def test_a_patch_restates_its_outcome_once_it_learns_more(
    target_module, tmp_path, monkeypatch, caplog
):
    """A wrapper that finds, at call time, that this process does not need it says so:
    the status (and the status file) changes, one line is logged per change, and
    the wrapper stays installed; after revert, restating changes nothing."""
    monkeypatch.setenv("VLLM_V4_PATCHES_STATUS_DIR", str(tmp_path / "status"))
    overlay_logger = logging.getLogger("vllm_v4_patches")
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")  # records reach caplog, once
    monkeypatch.setattr(overlay_logger, "propagate", True)
    monkeypatch.setattr(overlay_logger, "handlers", [])

    def apply(patcher: Patcher, found: ProbeResult) -> str:
        def hello(wrapped, instance, args, kwargs):
            if args == ("other runner",):
                patcher.restate("not-needed", "the other runner is active here")
            return wrapped(*args, **kwargs).upper()

        target = importlib.import_module(target_module)
        patcher.wrap(target.Greeter, "hello", hello)
        return "wrapped Greeter.hello"

    runtime = activate(make_patch(target_module, apply=apply))
    module = importlib.import_module(target_module)
    runtime.report_once()
    fingerprint = runtime.compile_fingerprint()
    with caplog.at_level("INFO", logger="vllm_v4_patches"):
        assert module.Greeter().hello("other runner") == "HELLO OTHER RUNNER"
        module.Greeter().hello("other runner")
    assert outcome(runtime) == ("not-needed", "the other runner is active here")
    [status_file] = (tmp_path / "status").glob("*.json")
    assert json.loads(status_file.read_text())["patches"]["synthetic"]["outcome"] == "not-needed"
    restated = [r.getMessage() for r in caplog.records if "applied -> not-needed" in r.getMessage()]
    assert restated == [
        f"vllm_v4_patches [front-end pid {runtime.document()['pid']}]: synthetic: "
        "applied -> not-needed (the other runner is active here)"
    ]
    assert runtime.compile_fingerprint() == fingerprint  # still installed, same key
    with pytest.raises(ValueError, match="outcome 'fine' is not one of applied, disabled"):
        runtime.restate("synthetic", "fine", "-")
    patcher = runtime.states["synthetic"].patcher
    runtime.revert("synthetic")
    patcher.restate("not-needed", "too late")
    assert outcome(runtime) == ("disabled", "reverted in this process")


def run_engine_core() -> None:
    """Named as vLLM's engine-core entry point; runs in a forked child."""
    from vllm_v4_patches import runtime as runtime_module

    runtime_module.on_engine_start()  # what vLLM's plugin loading triggers there


def test_a_forked_vllm_process_reports_under_its_own_role(target_module, tmp_path, monkeypatch):
    """vLLM forks its EngineCore where CUDA is not initialised yet (the GPU default),
    after the front end has reported. The child must log and write its own status,
    as engine-core, whatever name its process was given."""
    import multiprocessing
    import os

    from vllm_v4_patches import runtime as runtime_module

    monkeypatch.setenv("VLLM_V4_PATCHES_STATUS_DIR", str(tmp_path))
    runtime = activate(make_patch(target_module))
    importlib.import_module(target_module)
    monkeypatch.setattr(runtime_module, "_runtime", runtime)
    os.register_at_fork(after_in_child=runtime_module._after_fork)
    runtime.report_once()
    child = multiprocessing.get_context("fork").Process(target=run_engine_core, name="Process-9")
    child.start()
    child.join(60)
    assert child.exitcode == 0
    roles = {doc["pid"]: doc["role"] for doc in map(json.loads, _status_texts(tmp_path))}
    assert roles == {os.getpid(): "front-end", child.pid: "engine-core"}


def _status_texts(directory) -> list[str]:
    return [path.read_text() for path in sorted(directory.glob("*.json"))]


def test_a_status_file_is_never_written_through_a_planted_link(tmp_path):
    """Links planted in a shared status folder, at the file's name and at the old
    fixed temporary name, redirect nothing: the victims keep their contents and the
    status file is a regular file holding the document."""
    from vllm_v4_patches import status as status_mod

    victim, other = tmp_path / "victim", tmp_path / "other"
    victim.write_text("keep")
    other.write_text("keep too")
    folder = tmp_path / "status"
    folder.mkdir()
    document = {"pid": 4242, "role": "front-end", "patches": {}}
    (folder / "4242.json").symlink_to(victim)
    (folder / "4242.json.tmp").symlink_to(other)
    status_mod.write_status_file(str(folder), document)
    written = folder / "4242.json"
    assert not written.is_symlink() and json.loads(written.read_text()) == document
    assert victim.read_text() == "keep" and other.read_text() == "keep too"
    assert sorted(p.name for p in folder.iterdir()) == ["4242.json", "4242.json.tmp"]


def test_an_unwritable_status_folder_warns_once_and_raises_nothing(tmp_path, caplog):
    from vllm_v4_patches import status as status_mod

    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a file where the folder should be: makedirs fails
    folder = str(blocked / "status")
    with caplog.at_level("WARNING", logger="vllm_v4_patches"):
        for pid in (1, 2):
            status_mod.write_status_file(folder, {"pid": pid, "patches": {}})
    warnings = [r for r in caplog.records if "VLLM_V4_PATCHES_STATUS_DIR" in r.getMessage()]
    assert len(warnings) == 1 and folder in warnings[0].getMessage()
