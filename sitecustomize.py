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
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    here = os.path.dirname(os.path.realpath(__file__))
    others = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    if spec.origin and os.path.realpath(spec.origin) == os.path.realpath(__file__):
        return
    shadowed = module_from_spec(spec)
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
