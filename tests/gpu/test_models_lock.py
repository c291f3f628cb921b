"""Two GPU suites in one hold (two releases detached side by side) build their models
one at a time, each model under its own ``suite.models_lock``. Real processes race
for the folder; no GPU is needed for the lock itself."""

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
with (suite.models_lock(suite.Path(models), "tiny-v4") if locked else nullcontext()):
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


def prebuilding_wide(tmp_path: Path, monkeypatch, pause: float):
    """The suite module, pointed at a models folder under ``tmp_path``, and a thread
    running ``suite.prebuild`` of the wide model, already holding its lock. The build
    command is a stand-in that writes the config after ``pause`` s (the real one
    writes 11 GB)."""
    sys.path.insert(0, str(REPO / "tools" / "gpu"))
    import threading

    import suite

    models = tmp_path / "models"
    small, wide = models / suite.TINY_V4.name, models / suite.TINY_V4_WIDE.name
    for name, value in (("MODELS", models), ("TINY_V4", small), ("TINY_V4_WIDE", wide)):
        monkeypatch.setattr(suite, name, value)
    write = f"import time, pathlib; time.sleep({pause}); p = pathlib.Path({str(wide)!r}); "
    write += "p.mkdir(parents=True); (p / 'config.json').write_text('{}')"
    monkeypatch.setattr(suite, "v4_build", lambda model: [sys.executable, "-c", write])
    builder = threading.Thread(target=suite.prebuild, args=(wide.name,))
    builder.start()
    time.sleep(0.3)  # the builder holds the wide model's lock by now
    return suite, builder


def test_a_prebuild_holds_the_folder_until_its_model_is_written(tmp_path, monkeypatch):
    """``run.sh prebuild`` (``suite.prebuild``) builds under the model's lock, so a
    suite detached while it runs waits and then finds the model."""
    suite, builder = prebuilding_wide(tmp_path, monkeypatch, pause=1.0)
    with suite.models_lock(suite.MODELS, suite.TINY_V4_WIDE.name):
        assert (suite.TINY_V4_WIDE / "config.json").exists()
    builder.join(timeout=30)


def test_a_suite_whose_model_is_built_does_not_wait_for_another_models_build(tmp_path, monkeypatch):
    """A 128-expert prebuild (minutes) runs while a suite that needs only the built
    8-expert model starts: that suite's ``build_models`` returns at once."""
    suite, builder = prebuilding_wide(tmp_path, monkeypatch, pause=3.0)
    small, wide = suite.TINY_V4, suite.TINY_V4_WIDE
    small.mkdir(parents=True)
    (small / "config.json").write_text("{}")
    needs_small = [suite.Job("v4-small", [str(small)], False, {}, part="v4-compiled")]
    needs_wide = [suite.Job("v4-wide", [str(wide)], False, {}, part="v4-compiled")]
    suite.build_models(needs_small)
    assert not (wide / "config.json").exists()  # returned before the wide build ended
    # the control: a suite that needs the wide model waits for its build
    suite.build_models(needs_wide)
    assert (wide / "config.json").exists()
    builder.join(timeout=30)


def test_prebuild_of_a_model_the_suite_does_not_build_is_one_line():
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, 'tools/gpu'); import suite; "
            "suite.prebuild('tiny-v4-e7')",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "prebuild: 'tiny-v4-e7' is not a model the suite builds (tiny-v4, tiny-v4-e128)"
    ]
