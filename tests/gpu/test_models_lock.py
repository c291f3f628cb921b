"""Two GPU suites in one hold (two releases detached side by side) build their models
one at a time: ``suite.models_lock`` around ``suite.build_models``. Real processes
race for the folder; no GPU is needed for the lock itself."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# each process waits for a common start time, then holds the folder for 0.5 s,
# logging when it entered and left
RACER = """
import sys, time
from contextlib import nullcontext
sys.path.insert(0, {tools!r})
import suite
models, log, start, locked = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1"
time.sleep(max(0.0, start - time.time()))
with (suite.models_lock(suite.Path(models)) if locked else nullcontext()):
    with open(log, "a") as out:
        out.write("enter\\n")
    time.sleep(0.5)
    with open(log, "a") as out:
        out.write("leave\\n")
"""


def race(tmp_path: Path, locked: bool) -> list[str]:
    script = RACER.format(tools=str(REPO / "tools" / "gpu"))
    log = tmp_path / f"log-{int(locked)}"
    start = time.time() + 2.0  # both interpreters are up by then
    args = [str(tmp_path / "models"), str(log), str(start), "1" if locked else "0"]
    racers = [subprocess.Popen([sys.executable, "-c", script, *args]) for _ in range(2)]
    assert [racer.wait(timeout=60) for racer in racers] == [0, 0]
    return log.read_text().split()


def test_two_suites_take_the_models_folder_in_turn(tmp_path):
    assert race(tmp_path, locked=True) == ["enter", "leave", "enter", "leave"]
    # the control: without the lock the two overlap
    assert race(tmp_path, locked=False) == ["enter", "enter", "leave", "leave"]
