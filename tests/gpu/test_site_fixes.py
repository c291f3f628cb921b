"""The GPU harness's fix of its staged environment (``tools/gpu/site_fixes``): where
FlashInfer opens the CUDA runtime at import, ``flashinfer.comm`` is imported before
TileLang, and nowhere else. FlashInfer and TileLang here are stand-in packages written
to a temporary folder (the real ones need CUDA); their ``cuda_ipc.py`` lines are the
two forms of the staged wheels (0.6.12 opens at import, 0.6.14 lazily)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tools" / "gpu" / "site_fixes" / "sitecustomize.py"
EAGER = "class CudaRTLibrary:\n    pass\n\n\ncudart = CudaRTLibrary()\n"
LAZY = "class _LazyCudaRTLibrary:\n    pass\n\n\ncudart = _LazyCudaRTLibrary()\n"


def stand_ins(root: Path, cuda_ipc: str) -> None:
    comm = root / "flashinfer" / "comm"
    comm.mkdir(parents=True)
    (root / "flashinfer" / "__init__.py").write_text("")
    (comm / "cuda_ipc.py").write_text(cuda_ipc)
    (comm / "__init__.py").write_text("import builtins\nbuiltins.IMPORT_ORDER.append('comm')\n")
    (root / "tilelang").mkdir()
    (root / "tilelang" / "__init__.py").write_text(
        "import builtins\nbuiltins.IMPORT_ORDER.append('tilelang')\n"
    )


def load_fix(monkeypatch: pytest.MonkeyPatch) -> object:
    spec = importlib.util.spec_from_file_location("harness_site_fixes", FIX)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import builtins

    seen: list[str] = []
    monkeypatch.setattr(builtins, "IMPORT_ORDER", seen, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in ("flashinfer", "flashinfer.comm", "tilelang"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return seen


def test_eager_flashinfer_is_imported_before_tilelang(tmp_path, monkeypatch, order):
    stand_ins(tmp_path, EAGER)
    fix = load_fix(monkeypatch)
    assert fix.opens_runtime_at_import()
    import tilelang  # noqa: F401

    assert order == ["comm", "tilelang"]
    assert not any(isinstance(f, fix.FlashInferCommFirst) for f in sys.meta_path)


def test_lazy_flashinfer_is_left_alone(tmp_path, monkeypatch, order):
    stand_ins(tmp_path, LAZY)
    fix = load_fix(monkeypatch)
    assert not fix.opens_runtime_at_import()
    import tilelang  # noqa: F401

    assert order == ["tilelang"]
