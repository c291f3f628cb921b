"""The overlay in a process that imports vLLM: hooks, guards, outcomes, reports.

Lifecycle:

1. ``activate()`` (on the first ``import vllm``, or from the vLLM plugin entry
   point) detects the vLLM version, loads the patch records, reads the toggles and
   registers a wrapt post-import hook for every target module of every enabled
   patch.
2. When a target module is imported, its patches are *resolved*: version range,
   then the source probe, then apply. Every exception becomes outcome
   ``failed`` (or propagates as ``StrictModeError`` in strict mode).
3. When vLLM loads its general plugins (once per vLLM process: front end,
   engine core, each worker), the overlay resolves the patches whose targets
   were not imported yet, logs the one-line summary and writes the status file.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_v4_patches import status as status_mod
from vllm_v4_patches import toggles, versions
from vllm_v4_patches.errors import ProbeError, StrictModeError
from vllm_v4_patches.patcher import Patcher
from vllm_v4_patches.registry import Patch, load_patches
from vllm_v4_patches.sources import InstalledSource
from vllm_v4_patches.status import PatchStatus

logger = logging.getLogger("vllm_v4_patches")


@dataclass
class PatchState:
    patch: Patch
    status: PatchStatus | None = None  # None until resolved in this process
    patcher: Patcher | None = None
    hooked: bool = False


@dataclass
class Runtime:
    version: versions.DetectedVersion
    states: dict[str, PatchState]
    strict: bool
    reported: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock)

    # -- resolution -------------------------------------------------------

    def resolve(self, patch_id: str) -> None:
        with self.lock:
            state = self.states[patch_id]
            if state.status is None:
                state.status = self._decide(state)
                self._changed()
            if state.status.outcome == "failed" and self.strict:
                raise StrictModeError(
                    f"vllm_v4_patches: patch {patch_id} failed: {state.status.detail}"
                )

    def _decide(self, state: PatchState) -> PatchStatus:
        record = state.patch.record
        note = ""
        parsed = versions.parse(self.version.raw)
        if parsed is None:
            note = f" (vLLM version unknown: {self.version.source}; the probe decided)"
        elif not versions.in_range(self.version.raw, record.vllm_versions):
            return PatchStatus(
                "out-of-range",
                f"vLLM {self.version.raw} is outside {record.vllm_versions}",
            )
        try:
            found = state.patch.probe(InstalledSource())
        except ProbeError as exc:
            return PatchStatus("failed", f"probe: {exc}")
        except Exception as exc:
            return PatchStatus("failed", f"probe crashed: {type(exc).__name__}: {exc}")
        note += self._matrix_note(record.id, found.verdict)
        if found.verdict != "needed":
            return PatchStatus(found.verdict, found.detail + note)
        patcher = Patcher(record.id, restate=self._restater(record.id))
        try:
            done = state.patch.apply(patcher, found)
        except Exception as exc:
            _undo_quietly(patcher)
            return PatchStatus("failed", f"apply: {type(exc).__name__}: {exc}")
        state.patcher = patcher
        return PatchStatus("applied", done + note)

    def _restater(self, patch_id: str) -> Callable[[str, str], None]:
        def restate(outcome: str, detail: str) -> None:
            self.restate(patch_id, outcome, detail)

        return restate

    def restate(self, patch_id: str, outcome: str, detail: str) -> None:
        """Record a patch's restated outcome, and say so loudly once per change."""
        if outcome not in status_mod.OUTCOMES:
            raise ValueError(f"outcome {outcome!r} is not one of {', '.join(status_mod.OUTCOMES)}")
        with self.lock:
            state = self.states[patch_id]
            before = state.status
            if before is not None and (before.outcome, before.detail) == (outcome, detail):
                return
            state.status = PatchStatus(outcome, detail)
            self._changed()
        was = before.outcome if before is not None else "pending"
        level = logging.WARNING if outcome == "failed" else logging.INFO
        status_mod.log_line(level, f"{patch_id}: {was} -> {outcome} ({detail})")

    def _matrix_note(self, patch_id: str, verdict: str) -> str:
        """Cross-check the live probe with the committed matrix; the probe decides."""
        from vllm_v4_patches import compat

        key = compat.matrix_key(self.version.raw)
        if key is None:
            return ""  # unknown version: _decide already says the probe decided
        row = compat.load_matrix()["versions"].get(key)
        if row is None:
            return f" (vLLM {key} is not in the compatibility matrix; the probe decided)"
        expected = row["patches"].get(patch_id)
        if expected is None:
            return f" (no matrix cell for vLLM {key}; the probe decided)"
        if expected["outcome"] != verdict:
            logger.warning(
                "vllm_v4_patches: %s: the compatibility matrix says %s for vLLM %s but "
                "this installation's source says %s (a patched or unusual build?); "
                "following the source",
                patch_id,
                expected["outcome"],
                key,
                verdict,
            )
            return f" (the matrix says {expected['outcome']} for {key}; the source decided)"
        return ""

    def resolve_pending(self) -> None:
        """Import the targets not imported yet, so every patch gets an outcome."""
        for patch_id, state in self.states.items():
            if state.status is not None:
                continue
            for module in state.patch.record.modules:
                if state.status is not None:
                    break  # resolved by an earlier module; import no more than needed
                try:
                    importlib.import_module(module)  # fires the hook, which resolves
                except ModuleNotFoundError as exc:
                    if exc.name is None or not module.startswith(exc.name):
                        self._fail(patch_id, f"importing {module}: {exc}")
                except StrictModeError:
                    raise
                except Exception as exc:
                    self._fail(patch_id, f"importing {module}: {type(exc).__name__}: {exc}")
            if state.status is None:
                self.resolve(patch_id)  # no target module exists: the probe says so

    def _fail(self, patch_id: str, detail: str) -> None:
        with self.lock:
            self.states[patch_id].status = PatchStatus("failed", detail)
            self._changed()
        if self.strict:
            raise StrictModeError(f"vllm_v4_patches: patch {patch_id} failed: {detail}")

    # -- explicit apply / revert (tests, tools) ---------------------------

    def revert(self, patch_id: str) -> None:
        with self.lock:
            state = self.states[patch_id]
            if state.patcher is not None:
                state.patcher.revert()
                state.patcher = None
            state.status = PatchStatus("disabled", "reverted in this process")
            self._changed()

    def reapply(self, patch_id: str) -> None:
        with self.lock:
            state = self.states[patch_id]
            if state.patcher is not None and state.patcher.active:
                return  # idempotent
            state.status = None
        self.resolve(patch_id)

    # -- reporting --------------------------------------------------------

    def compile_fingerprint(self) -> str:
        """The switch's raw value and the patches installed in this process.

        Installed, not "outcome applied": a patch restated as not-needed keeps its
        changes, and every process must compute the same key.
        """
        applied = sorted(
            patch_id
            for patch_id, state in self.states.items()
            if state.patcher is not None and state.patcher.active
        )
        raw = os.environ.get(toggles.GLOBAL_SWITCH, "")
        return f"{raw}|applied={','.join(applied)}"

    def document(self) -> dict:
        patches = {}
        for patch_id, state in self.states.items():
            patches[patch_id] = state.status or PatchStatus(
                "absent", "target module not imported in this process"
            )
            if state.patcher is not None and state.patcher.known_copies:
                patched, imported, stale = state.patcher.copies_audit()
                note = f"; known copies patched: {patched}/{imported}"
                if stale:
                    note += " (stale: " + ", ".join(stale) + ")"
                patches[patch_id] = PatchStatus(
                    patches[patch_id].outcome, patches[patch_id].detail + note
                )
        return status_mod.report(self.version.raw, patches)

    def report_once(self) -> None:
        with self.lock:
            if self.reported:
                return
            self.reported = True
            document = self.document()
        status_mod.log_summary(document)
        self._write_status_file(document)

    def _changed(self) -> None:
        if self.reported:
            self._write_status_file(self.document())

    def _write_status_file(self, document: dict) -> None:
        directory = toggles.status_dir()
        if directory:
            status_mod.write_status_file(directory, document)


_runtime: Runtime | None = None
_activation_lock = threading.Lock()


def build_runtime(patches: list[Patch]) -> Runtime:
    """A runtime for these patches, toggles read and disabled patches settled."""
    runtime = Runtime(
        version=versions.detect(),
        states={p.id: PatchState(p) for p in patches},
        strict=toggles.strict_mode(),
    )
    toggles.warn_unknown_patch_switches(runtime.states)
    for patch_id, state in runtime.states.items():
        enabled, why = toggles.patch_enabled(patch_id, state.patch.record.default_enabled)
        if not enabled:
            state.status = PatchStatus("disabled", why)
    return runtime


def install_hooks(runtime: Runtime) -> None:
    """A post-import hook on every target module of every patch still pending."""
    import wrapt

    for patch_id, state in runtime.states.items():
        if state.status is None and not state.hooked:
            state.hooked = True
            for module in state.patch.record.modules:
                wrapt.register_post_import_hook(_hook_for(runtime, patch_id), module)


def activate() -> Runtime:
    """Set the overlay up in this process (idempotent)."""
    global _runtime
    from vllm_v4_patches import disarm

    disarm()  # from here on the overlay's own lookups of `vllm` must not re-enter
    with _activation_lock:
        if _runtime is not None:
            return _runtime
        _runtime = build_runtime(load_patches())
    import wrapt

    install_hooks(_runtime)
    wrapt.register_post_import_hook(_instrument_plugin_loader, "vllm.plugins")
    wrapt.register_post_import_hook(_declare_settings_to_vllm, "vllm.envs")
    os.register_at_fork(after_in_child=_after_fork)
    return _runtime


def _hook_for(runtime: Runtime, patch_id: str):
    def on_target_imported(module: object) -> None:
        others = set(runtime.states[patch_id].patch.record.modules) - {module.__name__}
        if any(_still_initializing(name) for name in others):
            # An import cycle finished this target inside another target's import;
            # applying now would meet a half-built module. That module's own hook
            # resolves the patch when it completes.
            return
        try:
            runtime.resolve(patch_id)
        except StrictModeError:
            raise
        except Exception as exc:  # a hook that raises would break the import
            logger.warning("vllm_v4_patches: resolving %s: %r", patch_id, exc)

    return on_target_imported


def _still_initializing(module_name: str) -> bool:
    spec = getattr(sys.modules.get(module_name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _instrument_plugin_loader(module: object) -> None:
    """Report when vLLM loads its general plugins: once in every vLLM process."""
    import wrapt

    def after_plugins_loaded(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        on_engine_start()
        return result

    try:
        wrapt.wrap_function_wrapper(module, "load_general_plugins", after_plugins_loaded)
    except Exception as exc:
        logger.warning(
            "vllm_v4_patches: cannot hook vllm.plugins.load_general_plugins (%r); "
            "the status summary comes only from the plugin entry point",
            exc,
        )


def _declare_settings_to_vllm(module: object) -> None:
    """Register our VLLM_V4_* variables as known to vLLM.

    vLLM warns about (or, with environment validation on, rejects) any
    ``VLLM_*`` variable it does not know. Known variables also feed vLLM's
    torch.compile cache key, so the global switch's entry reports which
    patches are applied: a graph compiled without a patch is never reused
    where it is applied, and the other way round.
    """
    known = getattr(module, "environment_variables", None)
    runtime = _runtime
    if not isinstance(known, dict) or runtime is None:
        return
    patch_settings = [
        name for state in runtime.states.values() for name in state.patch.record.settings
    ]
    for name in toggles.all_settings(runtime.states, patch_settings):
        known.setdefault(name, lambda name=name: os.environ.get(name))
    known[toggles.GLOBAL_SWITCH] = runtime.compile_fingerprint


def on_engine_start() -> None:
    runtime = activate()
    try:
        runtime.resolve_pending()
        runtime.report_once()
    except StrictModeError:
        raise
    except Exception as exc:
        logger.warning("vllm_v4_patches: reporting failed: %r", exc)


def vllm_plugin() -> None:
    """The ``vllm.general_plugins`` entry point (pip installs, Ray workers)."""
    from vllm_v4_patches import bootstrap

    bootstrap()  # marks start-up as done so a later sitecustomize run is a no-op
    on_engine_start()


def _after_fork() -> None:
    # A forked child (vLLM forks its EngineCore and workers where CUDA is not yet
    # initialised) is a process of its own: it reports when vLLM loads its plugins
    # there, by which time multiprocessing has given it its own identity; right
    # after fork it still carries the parent's.
    if _runtime is not None:
        _runtime.reported = False


def current() -> Runtime | None:
    return _runtime


def _undo_quietly(patcher: Patcher) -> None:
    try:
        patcher.revert()
    except Exception as exc:
        logger.warning("vllm_v4_patches: undoing a failed apply: %r", exc)


def on_engine_start_quietly() -> dict:
    """Resolve every patch here and return the status document (for the CLI).

    The summary line is left to vLLM processes; the CLI prints its own table.
    """
    runtime = activate()
    runtime.resolve_pending()
    return runtime.document()
