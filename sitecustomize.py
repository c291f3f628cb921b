"""vllm_v4_patches overlay entry: runs in every Python process that has this
directory on PYTHONPATH.

Kept deliberately tiny and import-light: it runs the ``sitecustomize`` it
shadows (the next one on ``sys.path``), then arms the overlay, which does no real
work until the process imports ``vllm``. Nothing here may raise.
"""

# vllm_v4_patches-sitecustomize (marker read by ``python -m vllm_v4_patches path``)


def _run_shadowed_sitecustomize() -> None:
    import os
    import sys

    # The PathFinder already on sys.meta_path: importing importlib.machinery for
    # it would cost ~0.6 ms in every process.
    path_finder = next(f for f in sys.meta_path if getattr(f, "__name__", "") == "PathFinder")

    # Plain string comparison: realpath on every entry costs ~1 ms per process.
    here = os.path.dirname(os.path.abspath(__file__))
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    skipped = globals().setdefault("skipped_overlays", [])
    spec = _next_sitecustomize(path_finder, others, skipped)
    if skipped:
        _warn_text(
            f"another copy of the overlay is on the path at {', '.join(skipped)}; the one "
            f"at {here} runs and the other is skipped (keep one on PYTHONPATH)"
        )
    if spec is None:
        return
    # importlib.util.module_from_spec would cost ~5 ms of imports in every process
    shadowed = type(sys)(spec.name)
    shadowed.__spec__, shadowed.__loader__, shadowed.__file__ = spec, spec.loader, spec.origin
    spec.loader.exec_module(shadowed)
    globals()["shadowed_sitecustomize"] = shadowed


def _next_sitecustomize(path_finder, others: list, skipped: list):  # noqa: ANN001, ANN202
    """The spec of the next ``sitecustomize`` on ``others`` that is not this overlay's
    (None if there is none), adding the folders of other copies to ``skipped``."""
    import os

    while True:
        spec = path_finder.find_spec("sitecustomize", others)
        if spec is None or spec.loader is None or not spec.origin:
            return None
        if os.path.realpath(spec.origin) == os.path.realpath(__file__):
            return None
        if not _is_overlay_entry(spec.origin):
            return spec
        # another copy of this overlay: it would run the next sitecustomize on the
        # path, which is this one, and so on; look past it instead
        folder = os.path.dirname(os.path.abspath(spec.origin))
        skipped.append(folder)
        rest = [p for p in others if os.path.abspath(p or os.curdir) != folder]
        if len(rest) == len(others):
            return None
        others = rest


def _is_overlay_entry(origin: str) -> bool:
    """Whether a ``sitecustomize`` file is this overlay's (by its marker line)."""
    try:
        with open(origin, encoding="utf-8", errors="replace") as handle:
            return "# vllm_v4_patches-sitecustomize" in handle.read(2048)
    except OSError:
        return False


def _warn_text(message: str) -> None:
    import logging

    logging.getLogger("vllm_v4_patches").warning("vllm_v4_patches: %s", message)


def _warn(what: str, exc: BaseException) -> None:
    _warn_text(f"{what} failed: {type(exc).__name__}: {exc}")


try:
    _run_shadowed_sitecustomize()
except Exception as exc:  # never break interpreter start-up
    _warn("running the shadowed sitecustomize", exc)

try:
    from vllm_v4_patches import bootstrap as _bootstrap

    _bootstrap()
except Exception as exc:  # never break interpreter start-up
    _warn("bootstrap", exc)
