"""Interpreter start-up: the only code that runs in every Python process.

It must cost next to nothing, so it imports no third-party module (wrapt alone
takes tens of milliseconds to import). It plants a tiny import finder that
notices the first ``import vllm`` and only then activates the overlay, before any
vLLM code runs, so every post-import hook is in place ahead of vLLM's own
``from x import y`` bindings.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

_ARMED = False


class _FirstVllmImport(MetaPathFinder):
    """Activates the overlay when ``vllm`` is first looked up, then steps aside."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001
        if fullname == "vllm":
            _activate_safely()
        return None


def disarm() -> None:
    """Remove the start-up finder (activation looks ``vllm`` up itself)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _FirstVllmImport)]


def _activate_safely() -> None:
    from vllm_v4_patches.errors import StrictModeError

    disarm()
    try:
        from vllm_v4_patches.runtime import activate

        activate()
    except StrictModeError:
        raise
    except Exception as exc:  # a broken overlay must never break `import vllm`
        import logging

        logging.getLogger("vllm_v4_patches").warning(
            "vllm_v4_patches: activation failed: %s: %s", type(exc).__name__, exc
        )


def arm() -> None:
    """Activate now if vLLM is already imported, otherwise on its first import."""
    global _ARMED
    if _ARMED:
        return
    _ARMED = True
    if "vllm" in sys.modules:
        _activate_safely()
    else:
        sys.meta_path.insert(0, _FirstVllmImport())
