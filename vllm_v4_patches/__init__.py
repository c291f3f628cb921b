"""vllm_v4_patches: guarded patches that fix and extend stock vLLM for DeepSeek-V4.

This module is imported at every interpreter start (through ``sitecustomize``),
so it holds the start-up code itself and imports nothing beyond ``sys``: every
extra module read here is paid by every Python process on the machine. It plants
a tiny import finder that notices the first ``import vllm`` and only then
activates the overlay (``runtime.activate``), before any vLLM code runs, so every
post-import hook is in place ahead of vLLM's own ``from x import y`` bindings.
"""

import sys

__version__ = "0.1.0"

# The patch modules, in the order they are reported. Each one carries its own
# record, probe and apply function; the core only ever sees this list.
PATCH_MODULES: tuple = (
    "vllm_v4_patches.embedding",
    "vllm_v4_patches.async_sync",
    "vllm_v4_patches.cudagraph",
    "vllm_v4_patches.flex_graphs",
    "vllm_v4_patches.swa_prefix",
    "vllm_v4_patches.dp_dummy",
    "vllm_v4_patches.dspark",
    "vllm_v4_patches.cpu_expand",
    "vllm_v4_patches.cpu_seed",
)

_armed = False


class _FirstVllmImport:
    """Activates the overlay when ``vllm`` is first looked up, then steps aside.

    A duck-typed meta path finder: subclassing ``importlib.abc.MetaPathFinder``
    would import ``importlib.resources`` and friends, about 20 ms per process.
    """

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201
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


def bootstrap() -> None:
    """Arm the overlay in this process: activate now if vLLM is already imported,
    otherwise on its first import. Idempotent; never imports vLLM."""
    global _armed
    if _armed:
        return
    _armed = True
    if "vllm" in sys.modules:
        _activate_safely()
    else:
        sys.meta_path.insert(0, _FirstVllmImport())
