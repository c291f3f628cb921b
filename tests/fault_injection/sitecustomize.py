"""Test-only fault injection: makes named patches' ``apply`` raise in every process.

Put this folder on PYTHONPATH after the overlay's: the overlay's ``sitecustomize``
runs the one it shadows (this one) before it arms, so the patch modules are loaded
with the raising ``apply`` in place. ``OVERLAY_TEST_FAIL_APPLY`` names the patch ids
(comma-separated); unset, this does nothing. Used by ``tests/serving/test_serve_faults.py``.
"""

import os


def _inject(patch_ids: list[str]) -> None:
    import importlib

    from vllm_v4_patches import PATCH_MODULES

    def raising_apply(patcher, found):  # noqa: ANN001, ANN202
        raise RuntimeError("apply made to raise by the test's fault injection")

    for name in PATCH_MODULES:
        module = importlib.import_module(name)
        if module.RECORD.id in patch_ids:
            module.apply = raising_apply


_FAIL = [p for p in os.environ.get("OVERLAY_TEST_FAIL_APPLY", "").split(",") if p]
if _FAIL:
    _inject(_FAIL)
