"""GPU harness only: a fix of the staged environment, not of vLLM or the overlay.

FlashInfer 0.6.12 (staged with vLLM 0.24.0) opens the CUDA runtime when
``flashinfer.comm`` is imported, taking the first loaded library whose name holds
``libcudart``. TileLang 0.1.9 (vLLM's pin) loads its own ``libcudart_stub.so``,
which lacks ``cudaDeviceReset``; where that stub maps first, the import fails and
every DeepSeek-V4 engine of 0.24.0 stops in its kernel warm-up (H200, 2026-12-04;
flashinfer-ai/flashinfer#3676, tile-ai/tilelang#2314). Importing ``flashinfer.comm``
before TileLang lets it find torch's runtime. Where FlashInfer opens the runtime
lazily (0.6.14 on), nothing is done. The suite puts this folder on the path of its
DeepSeek-V4 jobs, after the overlay's (whose ``sitecustomize`` runs this one).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import re
import sys

EAGER_RUNTIME = re.compile(r"^cudart = CudaRTLibrary\(\)", re.MULTILINE)


def opens_runtime_at_import() -> bool:
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return False
    path = os.path.join(list(spec.submodule_search_locations)[0], "comm", "cuda_ipc.py")
    try:
        with open(path, encoding="utf-8") as handle:
            return bool(EAGER_RUNTIME.search(handle.read()))
    except OSError:
        return False


class FlashInferCommFirst(importlib.abc.MetaPathFinder):
    """Imports ``flashinfer.comm`` once, just before the first ``tilelang`` import."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201, ARG002
        if name != "tilelang":
            return None
        sys.meta_path.remove(self)
        try:
            import flashinfer.comm  # noqa: F401

            print("gpu harness: flashinfer.comm imported before tilelang", file=sys.stderr)
        except Exception as error:  # noqa: BLE001 - the engine's own import reports it
            print(f"gpu harness: flashinfer.comm before tilelang failed: {error}", file=sys.stderr)
        return None


if opens_runtime_at_import():
    sys.meta_path.insert(0, FlashInferCommFirst())
