"""What the overlay did in this process: outcomes, the summary line, status files.

Outcomes (exactly this vocabulary):

* ``applied``: the fix is installed in this process;
* ``disabled``: switched off by ``VLLM_V4_PATCHES`` or ``VLLM_V4_PATCH_<ID>``;
* ``not-needed``: the probe found the target already fixed upstream, or the patch
  restated itself so once it saw that this process runs code it does not touch;
* ``absent``: the target does not exist in this vLLM;
* ``out-of-range``: the vLLM version is outside the patch's declared range;
* ``failed``: probing or applying raised (the reason is in ``detail``).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
from dataclasses import dataclass
from typing import Literal, get_args

Outcome = Literal["applied", "disabled", "not-needed", "absent", "out-of-range", "failed"]
OUTCOMES: tuple[str, ...] = get_args(Outcome)

logger = logging.getLogger("vllm_v4_patches")


@dataclass
class PatchStatus:
    outcome: Outcome
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"outcome": self.outcome, "detail": self.detail}


# vLLM's process entry points: a process started through multiprocessing keeps its
# target, whatever name the start method or platform left it with
ROLE_BY_ENTRY_POINT = {"run_engine_core": "engine-core", "worker_main": "worker"}


def process_role() -> str:
    """front-end, engine-core or worker: from the vLLM function this process was
    started to run, else from the names vLLM gives its processes."""
    process = multiprocessing.current_process()
    entry = getattr(getattr(process, "_target", None), "__name__", None)
    if entry in ROLE_BY_ENTRY_POINT:
        return ROLE_BY_ENTRY_POINT[entry]
    name = process.name
    if name == "MainProcess":
        main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if main_spec is not None and main_spec.name == "vllm.model_executor.models.registry":
            return "model-inspection"  # vLLM's short-lived model-inspection subprocess
        return "front-end"
    if name.startswith("EngineCore"):
        return "engine-core"
    if "Worker" in name:
        return "worker"
    return name


def report(vllm_version: str | None, patches: dict[str, PatchStatus]) -> dict:
    """The status document (same schema for status files and ``status --json``)."""
    return {
        "pid": os.getpid(),
        "role": process_role(),
        "vllm_version": vllm_version,
        "overlay": overlay_location(),
        "patches": {pid: status.as_dict() for pid, status in patches.items()},
    }


def overlay_location() -> dict:
    """The overlay package this process runs, and the other copies of the overlay's
    ``sitecustomize`` its own skipped on the path (see ``sitecustomize.py``)."""
    entry = sys.modules.get("sitecustomize")
    return {
        "package": os.path.dirname(os.path.abspath(__file__)),
        "skipped_copies": list(getattr(entry, "skipped_overlays", None) or []),
    }


_unwritable: set[str] = set()  # status directories already warned about


def write_status_file(directory: str, document: dict) -> None:
    """Write ``<pid>.json`` in ``directory`` atomically: the document goes to a
    temporary file created exclusively there (never through a link someone planted,
    and readers never see half of it), which is then renamed over the target (a
    link at the target is replaced, not followed). An unwritable directory gets
    one warning per process; serving goes on."""
    import contextlib
    import tempfile

    temporary = None
    try:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{document['pid']}.json")
        handle, temporary = tempfile.mkstemp(prefix=f".{document['pid']}.", dir=directory)
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            json.dump(document, stream, indent=1, sort_keys=True)
        os.chmod(temporary, 0o644)  # mkstemp creates 0600; readers are other users
        os.replace(temporary, path)
        temporary = None
    except OSError as exc:
        if directory not in _unwritable:
            _unwritable.add(directory)
            logger.warning(
                "vllm_v4_patches: cannot write the status file in "
                "VLLM_V4_PATCHES_STATUS_DIR=%r: %s",
                directory,
                exc,
            )
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def summary_line(document: dict) -> str:
    parts = []
    for patch_id, entry in document["patches"].items():
        part = f"{patch_id}={entry['outcome']}"
        if entry["outcome"] in ("failed", "out-of-range"):
            part += f" ({entry['detail']})"
        parts.append(part)
    return (
        f"vllm_v4_patches [{document['role']} pid {document['pid']}, "
        f"vLLM {document['vllm_version'] or 'unknown'}]: " + ", ".join(parts)
    )


def log_summary(document: dict) -> None:
    _join_vllm_logging()
    troubled = any(e["outcome"] == "failed" for e in document["patches"].values())
    logger.log(logging.WARNING if troubled else logging.INFO, summary_line(document))


def log_line(level: int, message: str) -> None:
    """One line after the summary (a restated outcome), prefixed like it."""
    _join_vllm_logging()
    logger.log(level, f"vllm_v4_patches [{process_role()} pid {os.getpid()}]: {message}")


class _ThroughVllmHandlers(logging.Handler):
    """Emit through the handlers vLLM configured, whenever it configures them.

    vLLM sets its handler up lazily (0.32 does it when an engine is built, not
    at import), so the handlers are looked up per record; before they exist,
    records go to stderr in vLLM's layout.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fallback = logging.StreamHandler()
        self.fallback.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")
        )

    def emit(self, record: logging.LogRecord) -> None:
        handlers = logging.getLogger("vllm").handlers or [self.fallback]
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def _join_vllm_logging() -> None:
    """Follow vLLM's logging settings unless the user manages logging itself."""
    if logger.handlers or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    logger.setLevel(level if level in logging.getLevelNamesMapping() else "INFO")
    logger.addHandler(_ThroughVllmHandlers())
    logger.propagate = False


def format_table(document: dict) -> str:
    rows = [("patch", "outcome", "detail")]
    rows += [(pid, e["outcome"], e["detail"]) for pid, e in document["patches"].items()]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [
        f"vllm_v4_patches status: pid {document['pid']}, role {document['role']}, "
        f"vLLM {document['vllm_version'] or 'unknown'}"
    ]
    for patch_id, outcome, detail in rows:
        lines.append(f"  {patch_id:<{widths[0]}}  {outcome:<{widths[1]}}  {detail}")
    return "\n".join(lines)
