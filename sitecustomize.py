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
    spec = path_finder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    if spec.origin and os.path.realpath(spec.origin) == os.path.realpath(__file__):
        return
    # importlib.util.module_from_spec would cost ~5 ms of imports in every process
    shadowed = type(sys)(spec.name)
    shadowed.__spec__, shadowed.__loader__, shadowed.__file__ = spec, spec.loader, spec.origin
    spec.loader.exec_module(shadowed)
    globals()["shadowed_sitecustomize"] = shadowed


def _warn(what: str, exc: BaseException) -> None:
    import logging

    logging.getLogger("vllm_v4_patches").warning(
        "vllm_v4_patches: %s failed: %s: %s", what, type(exc).__name__, exc
    )


try:
    _run_shadowed_sitecustomize()
except Exception as exc:  # never break interpreter start-up
    _warn("running the shadowed sitecustomize", exc)

try:
    from vllm_v4_patches import bootstrap as _bootstrap

    _bootstrap()
except Exception as exc:  # never break interpreter start-up
    _warn("bootstrap", exc)
