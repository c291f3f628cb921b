"""Patch records and the patch-module protocol.

A patch is one module listed in ``vllm_v4_patches.PATCH_MODULES`` that defines:

* ``RECORD``: a :class:`PatchRecord` (what, why, how, where, which versions);
* ``probe(source: SourceReader) -> ProbeResult``: reads the target's source and
  says whether the buggy form is present (raises ``ProbeError`` on a shape it
  does not recognise);
* ``apply(patcher: Patcher, found: ProbeResult) -> str``: installs the fix
  through the patcher (which records every swap so the core can revert it
  exactly) and returns a one-line description of what it did.

The core reads nothing else from a patch and knows no patch by name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from vllm_v4_patches.patcher import Patcher
    from vllm_v4_patches.sources import SourceReader

Verdict = Literal["needed", "not-needed", "absent"]


@dataclass(frozen=True)
class Target:
    """A patched attribute: ``module`` plus a dotted ``qualname`` inside it."""

    module: str
    qualname: str
    runner: str | None = None  # "V1" / "V2" where the two model runners differ
    versions: str = ""  # the releases where this target holds the code, if not all
    # the other patches that wrap this attribute too (their wrappers compose: the
    # later calls the earlier); an attribute no record shares has one owner
    shared_with: tuple[str, ...] = ()
    during: str = ""  # bound only while this call runs (Patcher.swap_during)

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass(frozen=True)
class PatchRecord:
    id: str
    toggle: str
    summary: str
    why: str
    how: str
    upstream: tuple[str, ...]
    removal_plan: str
    targets: tuple[Target, ...]
    vllm_versions: str  # a packaging specifier, e.g. ">=0.10.0"
    default_enabled: bool = True
    settings: tuple[str, ...] = ()  # further environment variables the patch reads

    @property
    def modules(self) -> tuple[str, ...]:
        """The target modules, each once, in declaration order."""
        return tuple(dict.fromkeys(target.module for target in self.targets))


@dataclass(frozen=True)
class ProbeResult:
    verdict: Verdict
    detail: str
    variant: str | None = None  # which target (or runner) the verdict is about
    facts: dict[str, str] = field(default_factory=dict)  # handed to apply()
    # further per-release answers the matrix records and checks beside the verdict
    # (dspark's DeepSeek-V4 route), shown as "name: value"
    aspects: dict[str, str] = field(default_factory=dict)

    @classmethod
    def per_runner(cls, verdicts: dict[str, Verdict]) -> ProbeResult:
        """One result from each runner's verdict: needed where any runner needs it
        (variant "V1+V2" names them), else not-needed where any has the target."""
        needed = [runner for runner, verdict in verdicts.items() if verdict == "needed"]
        detail = "; ".join(f"{runner}: {verdict}" for runner, verdict in verdicts.items())
        if needed:
            return cls("needed", detail, variant="+".join(needed), facts=dict(verdicts))
        if "not-needed" in verdicts.values():
            return cls("not-needed", detail, facts=dict(verdicts))
        return cls("absent", detail, facts=dict(verdicts))


@dataclass(frozen=True)
class Patch:
    record: PatchRecord
    probe: Callable[[SourceReader], ProbeResult]
    apply: Callable[[Patcher, ProbeResult], str]

    @property
    def id(self) -> str:
        return self.record.id


def load_patch(module_name: str) -> Patch:
    module = importlib.import_module(module_name)
    return Patch(record=module.RECORD, probe=module.probe, apply=module.apply)


def load_patches(module_names: tuple[str, ...] | None = None) -> list[Patch]:
    if module_names is None:
        from vllm_v4_patches import PATCH_MODULES

        module_names = PATCH_MODULES
    return [load_patch(name) for name in module_names]
