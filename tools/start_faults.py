"""Engine start-up failures that are vLLM's or the machine's, not the overlay's, and
the evidence to keep when one happens.

Two are known on the 2-core CI machine:

* the torch.distributed port race: vLLM finds a free port by binding port 0 and
  closing it, so two engines starting at once can both pick the same one
  (``EADDRINUSE``);
* a worker process that dies with no Python error while vLLM's CPU worker warms the
  compiled model up (``Worker proc ... died unexpectedly``, or the engine core's
  ``RuntimeError('cancelled')`` from the worker's message queue). Its cause has not
  been seen: the evidence below (the process's fatal-signal lines, which
  ``PYTHONFAULTHANDLER=1`` makes every Python process print, and the kernel's
  out-of-memory or segfault lines) is kept so that the next one names it.

Either gets one more try from the callers (tests' ``run_python``, ``soak.py``),
which report it; a second failure is a failure.
"""

from __future__ import annotations

import re
import subprocess

PORT_RACE = "EADDRINUSE"
WORKER_DIED = "died unexpectedly"
# what a process prints as it dies of a signal under PYTHONFAULTHANDLER=1, and what
# the kernel logs for an out-of-memory kill or a fault
FATAL_MARKS = ("Fatal Python error", "Segmentation fault", "Bus error", "Aborted", WORKER_DIED)
KERNEL_MARKS = re.compile(
    r"out of memory|killed process|oom-kill|segfault|general protection", re.I
)


def retry_reason(output: str) -> str | None:
    """Which known start-up failure ``output`` shows, if any."""
    if PORT_RACE in output:
        return "torch.distributed port race (EADDRINUSE)"
    if WORKER_DIED in output:
        return "a worker died during start-up"
    return None


def evidence(output: str, around: int = 6, dump_lines: int = 160) -> str:
    """The fatal-signal lines of ``output`` for the report of a failed start: a
    ``Fatal Python error`` with the stack dump after it (``dump_lines`` lines, where
    faulthandler lists every thread, the failing one marked "Current thread"), each
    other mark with the ``around`` lines after it, runs of one repeated line (a
    recursion) collapsed; then the kernel's fault lines."""
    lines = output.splitlines()
    kept: list[str] = []
    for index, line in enumerate(lines):
        if any(mark in line for mark in FATAL_MARKS):
            span = dump_lines if "Fatal Python error" in line else around
            kept.extend(lines[index : index + span])
    return "\n".join(collapse_repeats(kept)[:240] + kernel_faults())


def collapse_repeats(lines: list[str]) -> list[str]:
    """A run of one line, or of one pair of lines (a frame's file line and its code
    line), kept once with the count of its repeats."""
    out: list[str] = []
    index = 0
    while index < len(lines):
        for width in (1, 2):
            unit = lines[index : index + width]
            repeats = 1
            while lines[index + repeats * width : index + (repeats + 1) * width] == unit:
                repeats += 1
            if repeats > 2:
                out.extend(unit)
                out.append(f"  [the {width} line(s) above repeated {repeats - 1} more times]")
                index += repeats * width
                break
        else:
            out.append(lines[index])
            index += 1
    return out


def kernel_faults(tail: int = 200) -> list[str]:
    """The kernel log's recent OOM-kill and segfault lines (none where the log cannot
    be read)."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return ["kernel: " + x for x in log.splitlines()[-tail:] if KERNEL_MARKS.search(x)]
