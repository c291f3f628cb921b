"""``python -m vllm_v4_patches explain ID``: one patch's record, as the code holds it.

Everything printed is read from the patch's ``RECORD`` and the generated matrix, so
the explanation cannot drift from what the overlay does.
"""

from __future__ import annotations

import textwrap

from vllm_v4_patches.registry import PatchRecord, Target, load_patches

WIDTH = 88


def patch_ids() -> list[str]:
    return [patch.id for patch in load_patches()]


def explain(patch_id: str) -> str:
    """The record of ``patch_id`` and its matrix row; raises KeyError naming the ids."""
    records = {patch.id: patch.record for patch in load_patches()}
    if patch_id not in records:
        raise KeyError(f"no patch {patch_id!r}; patches: {', '.join(records)}")
    record = records[patch_id]
    parts = [
        f"{record.id}: {record.summary}",
        _field("switch", f"{record.toggle} (default {'on' if record.default_enabled else 'off'})"),
        _field("vLLM versions", record.vllm_versions),
    ]
    if record.settings:
        parts.append(_field("settings", ", ".join(record.settings)))
    parts += [
        _field("why", record.why),
        _field("how", record.how),
        _field("upstream", "; ".join(record.upstream) or "none"),
        _field("removal plan", record.removal_plan),
        "targets:",
        *(f"  {_target_line(target)}" for target in record.targets),
        "matrix (python -m vllm_v4_patches matrix):",
        *(f"  {line}" for line in matrix_runs(record)),
    ]
    return "\n".join(parts)


def _field(name: str, text: str) -> str:
    return textwrap.fill(
        text, WIDTH, initial_indent=f"{name}: ", subsequent_indent="  ", break_on_hyphens=False
    )


def _target_line(target: Target) -> str:
    notes = [
        note
        for note in (
            target.runner and f"{target.runner} runner",
            target.versions and f"vLLM {target.versions}",
            target.during and f"only during {target.during}",
            target.shared_with and f"shared with {', '.join(target.shared_with)}",
        )
        if note
    ]
    return f"{target}" + (f"  [{'; '.join(notes)}]" if notes else "")


def matrix_runs(record: PatchRecord) -> list[str]:
    """The patch's matrix column as runs of consecutive releases with one outcome."""
    from vllm_v4_patches import compat

    matrix = compat.load_matrix()
    runs: list[tuple[str, str, str]] = []  # (first, last, outcome)
    for version in sorted(matrix["versions"], key=compat._vkey):
        cell = matrix["versions"][version]["patches"].get(record.id)
        answer = compat._answer(cell)
        if runs and runs[-1][2] == answer:
            runs[-1] = (runs[-1][0], version, answer)
        else:
            runs.append((version, version, answer))
    return [
        f"{first}{'' if first == last else ' to ' + last}: {answer}" for first, last, answer in runs
    ]
