"""Shared fixtures: the tiny model, an HF reference, and subprocess runners.

Subprocesses start from a scratch working directory so that the overlay is on
``sys.path`` only where a test puts it there on purpose.

The session also orders and overlaps the slow parts: the sweep runs last, the
downloads the selected tests need are fetched in a background process from the
start (``vllm_builds.py``), and engine runs can go to a pool of two (``engines``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
# the tests are grouped as the package is (core, patches, dspark, serving); a few
# share helpers across groups (test_versions' build environment, test_dspark_e2e's
# draft recorder), so every group's folder is importable whichever runs first
TEST_GROUPS = ("core", "patches", "dspark", "serving")
sys.path[1:1] = [str(REPO / "tests" / group) for group in TEST_GROUPS]

import start_faults  # noqa: E402  (tools/, on the path above)

MODEL_DIR = REPO / ".cache" / "models" / "tiny-llama"
DSPARK_TARGET_DIR = REPO / ".cache" / "models" / "tiny-qwen3"
DSPARK_DRAFT_DIR = REPO / ".cache" / "models" / "tiny-qwen3-dspark"
PREFETCH_LOG = REPO / ".cache" / "prefetch.log"
# An engine run keeps about one core busy (vLLM's CPU worker runs torch on one
# thread; start-up is Python): two at a time fill this 2-core machine.
ENGINE_WORKERS = 2
# The pool's jobs and the tests that start servers themselves take one slot per
# engine they run, so no more than two engines run together: a test's own servers
# on top of the pool's two engines oversubscribed the 2 cores, and engine starts
# failed in CI under that load (the cause was not established beyond the overlap).
ENGINE_SLOTS = threading.BoundedSemaphore(ENGINE_WORKERS)
BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    # a process killed by a fatal signal prints every thread's stack (start_faults)
    "PYTHONFAULTHANDLER": "1",
}
# (command, reason, evidence) of each engine start that got one more try
START_RETRIES: list[tuple[str, str, str]] = []


def clean_env(**overrides: str) -> dict[str, str]:
    """The test environment without any overlay or overlay setting."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("VLLM_V4_PATCH") and key != "PYTHONPATH"
    }
    env.update(BASE_ENV)
    env.update(overrides)
    return env


def vllm_cache_root(pythonpath: list[str] | tuple[str, ...]) -> str:
    """A vLLM cache directory per vLLM build (the venv's, or a build on the path).

    vLLM caches each model class's inspection (a Python subprocess importing vLLM,
    about 10 s on CI) under one file name per class, checked against the source it
    came from: builds sharing one directory overwrite each other's entries, and each
    engine start then inspects again."""
    for entry in pythonpath:
        if (Path(entry) / "vllm").is_dir():
            return str(REPO / ".cache" / "vllm-cache" / Path(entry).name)
    return str(REPO / ".cache" / "vllm-cache" / "venv")


def run_python(
    args: list[str],
    *,
    pythonpath: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 600,
    check: bool = True,
) -> subprocess.CompletedProcess:
    full_env = clean_env(**{"VLLM_CACHE_ROOT": vllm_cache_root(pythonpath), **(env or {})})
    if pythonpath:
        full_env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, *args],
            env=full_env,
            cwd=str(cwd) if cwd else str(REPO / ".cache"),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        # the start-up failures that are vLLM's or the machine's get one more try,
        # reported at the end of the session (start_faults)
        output = result.stdout + result.stderr
        reason = start_faults.retry_reason(output) if result.returncode != 0 else None
        if reason is None:
            break
        START_RETRIES.append((" ".join(map(str, args)), reason, start_faults.evidence(output)))
    if check and result.returncode != 0:
        raise AssertionError(
            f"{args} exited {result.returncode}\n--- error lines\n{error_lines(result)}"
            f"\n--- fault evidence\n{start_faults.evidence(result.stdout + result.stderr)}"
            f"\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-8000:]}"
        )
    return result


def error_lines(result: subprocess.CompletedProcess | str, limit: int = 40) -> str:
    """The lines naming an error, from anywhere in a process's output (or a log): a
    child process's root cause (an engine core's) is often far above the tails the
    message keeps."""
    text = result if isinstance(result, str) else result.stdout + result.stderr
    lines = text.splitlines()
    marked = [x for x in lines if " ERROR " in x or "Error:" in x or "Exception:" in x]
    return "\n".join(marked[:limit])


GENERATE = str(REPO / "tools" / "generate.py")


def engine_run(key: str, model: Path, *, multiprocess: bool, **options: Any) -> dict:
    """One run of a ``tools/generate.py`` plan (see ``run_plan``): ``generate``'s
    defaults (greedy, eager, its three prompts) and 12 tokens, unless ``options``
    say otherwise."""
    run = {"max_tokens": 12, **options}
    return {"key": key, "model": str(model), "multiprocess": multiprocess, **run}


def run_plan(
    runs: list[dict],
    *,
    pythonpath: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    scratch: Path,
) -> dict[str, dict]:
    """Several engines one after another in one Python process (``generate.py
    --plan``), each result by its key: one interpreter and vLLM import for all of
    them. Runs share a process only where they share its path and environment."""
    scratch.mkdir(parents=True, exist_ok=True)
    plan = scratch / f"plan-{runs[0]['key']}-{len(list(scratch.glob('plan-*')))}.json"
    plan.write_text(json.dumps(runs))
    result = run_python([GENERATE, "--plan", str(plan)], pythonpath=pythonpath, env=env)
    found = {}
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            entry = json.loads(line.removeprefix("RESULT "))
            found[entry.pop("key")] = entry
    return found


def hf_greedy(model_dir: Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy tokens from HF transformers on the same weights (independent reference)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=max_tokens)
        reference.append(out[0, ids.shape[1] :].tolist())
    return reference


# what a matrix cell becomes at run time when the patch is switched on
RUNTIME_OUTCOME = {
    "needed": "applied",
    "not-needed": "not-needed",
    "absent": "absent",
    "out-of-range": "out-of-range",  # a patch whose declared versions leave this release out
}


def matrix_outcomes(version: str) -> dict[str, str]:
    """Each patch's run-time outcome on ``version``, read from the committed matrix."""
    from vllm_v4_patches import compat

    row = compat.load_matrix()["versions"][version]["patches"]
    return {patch_id: RUNTIME_OUTCOME[cell["outcome"]] for patch_id, cell in row.items()}


def read_status_files(directory: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from build_tiny_model import build

    return Path(build(str(MODEL_DIR)))


@pytest.fixture(scope="session")
def dspark_variants(dspark_pair) -> dict[str, Path]:
    """The distilled draft with a gated and with an rnn Markov head added (seconds)."""
    from dspark_model import write_markov_variant

    _, draft = dspark_pair
    return {
        kind: Path(write_markov_variant(draft, f"{draft}-{kind}", kind))
        for kind in ("gated", "rnn")
    }


@pytest.fixture(scope="session")
def dspark_pair() -> tuple[Path, Path]:
    """The tiny trained Qwen3 target and its distilled DSpark draft (built if missing)."""
    if not (DSPARK_DRAFT_DIR / "model.safetensors").exists():
        script = str(REPO / "tools" / "distill_dspark.py")
        run_python([script, str(DSPARK_TARGET_DIR.parent)], cwd=REPO, timeout=1800)
    return DSPARK_TARGET_DIR, DSPARK_DRAFT_DIR


@pytest.fixture(scope="session")
def engines() -> Iterator[ThreadPoolExecutor]:
    """A pool that runs engine subprocesses two at a time."""
    pool = ThreadPoolExecutor(ENGINE_WORKERS, thread_name_prefix="engine")
    yield pool
    pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class Inputs:
    """What a module's engine runs read: the tiny models and its scratch directory."""

    tiny: Path
    target: Path
    draft: Path
    variants: dict[str, Path]
    scratch: Path


class Scheduled:
    """Every engine run of the session, submitted ahead to the pool and read back by
    key: a test waits for its own while the pool works on the others.

    ``add`` puts an engine run into a named plan process (``run_plan``) instead:
    runs that share a path and environment share one Python and vLLM start-up.
    Nothing starts before ``start``, once every selected test's runs are known."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self.pending: dict[object, tuple] = {}
        self.futures: dict[object, Future] = {}
        self.plans: dict[object, dict[str, Any]] = {}
        self.members: dict[object, tuple[object, str]] = {}
        self.views: dict[str, ModuleRuns] = {}  # filled by the ``scheduled`` fixture

    def submit(self, key: object, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run ``fn(*args, **kwargs)`` under ``key``, once: tests that read one run share it."""
        self.pending.setdefault(key, (fn, args, kwargs))

    def add(self, key: object, plan: object, run: dict, *, scratch: Path, **process: Any) -> None:
        """Add ``run`` (``engine_run``) under ``key`` to the plan process ``plan``, once;
        ``process`` is ``run_plan``'s path and environment, one for all of a plan's runs."""
        entry = self.plans.setdefault(plan, {"runs": {}, "process": process, "scratch": scratch})
        assert entry["process"] == process, f"plan {plan!r}: runs need one path and environment"
        entry["runs"].setdefault(run["key"], run)
        self.members[key] = (plan, run["key"])

    def start(self) -> Scheduled:
        """Submit the plan processes, longest first (they hold the most runs), then
        the other runs in the order they were submitted."""
        by_size = sorted(self.plans.items(), key=lambda item: -len(item[1]["runs"]))
        for plan, entry in by_size:
            runs = list(entry["runs"].values())
            scratch = entry["scratch"] / "-".join(str(part) for part in plan).replace(" ", "-")
            label = f"{plan} plan: {', '.join(entry['runs'])}"
            future = self.pool.submit(
                timed, label, run_plan, runs, scratch=scratch, **entry["process"]
            )
            self.futures["plan", plan] = future
        for key, (fn, args, kwargs) in self.pending.items():
            self.futures[key] = self.pool.submit(timed, str(key), fn, *args, **kwargs)
        return self

    def __getitem__(self, key: object) -> Any:
        if key in self.members:
            plan, run_key = self.members[key]
            return self.futures["plan", plan].result()[run_key]
        return self.futures[key].result()


ENGINE_RUN_SECONDS: list[tuple[str, float]] = []  # each pool job's wall time, for the summary


@contextmanager
def engine_slots(count: int = 1) -> Iterator[None]:
    """Hold ``count`` of the engine slots (see ``ENGINE_SLOTS``); a test holding
    slots must not wait on a pool job."""
    for _ in range(count):
        ENGINE_SLOTS.acquire()
    try:
        yield
    finally:
        for _ in range(count):
            ENGINE_SLOTS.release()


def timed(label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with engine_slots():
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            ENGINE_RUN_SECONDS.append((label, time.perf_counter() - started))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Each engine start that got one more try, with its evidence; each pool job's
    wall time (two ran at a time): where the engine time went."""
    if START_RETRIES:
        terminalreporter.section(f"engine starts retried: {len(START_RETRIES)}")
        for command, reason, found in START_RETRIES:
            terminalreporter.write_line(f"{reason}: {command}")
            terminalreporter.write_line(found or "(no fatal-signal or kernel fault lines)")
    if not ENGINE_RUN_SECONDS:
        return
    total = sum(seconds for _, seconds in ENGINE_RUN_SECONDS)
    terminalreporter.section(f"engine runs: {len(ENGINE_RUN_SECONDS)} jobs, {total:.0f} s in all")
    for label, seconds in sorted(ENGINE_RUN_SECONDS, key=lambda entry: -entry[1]):
        terminalreporter.write_line(f"{seconds:7.1f} s  {label}")


class ModuleRuns:
    """One test module's part of the session's runs: its own keys and plan names,
    and the inputs its plans were given."""

    def __init__(self, scheduled: Scheduled, module: str, inputs: Inputs) -> None:
        self.scheduled = scheduled
        self.module = module
        self.inputs = inputs

    def submit(self, key: object, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.scheduled.submit((self.module, key), fn, *args, **kwargs)

    def add(self, plan: str, run: dict, **process: Any) -> None:
        """``Scheduled.add`` for this module, its runs read back by their own key."""
        key = (self.module, run["key"])
        self.scheduled.add(key, (self.module, plan), run, scratch=self.inputs.scratch, **process)

    def __getitem__(self, key: object) -> Any:
        return self.scheduled[self.module, key]


@pytest.fixture(scope="session", autouse=True)
def scheduled(
    request: pytest.FixtureRequest,
    engines: ThreadPoolExecutor,
    tmp_path_factory: pytest.TempPathFactory,
) -> Scheduled:
    """The engine runs of every selected test whose module maps its name to a plan
    (a module-level ``PLANS``: ``plan(runs, inputs, **test parameters)``), all
    submitted before the first test runs: the pool of two stays busy across module
    boundaries and under the tests that start no engine."""
    scheduled = Scheduled(engines)
    views = scheduled.views
    for item in request.session.items:
        module = getattr(item, "module", None)
        plan = getattr(module, "PLANS", {}).get(getattr(item, "originalname", None))
        if plan is None:
            continue
        if module.__name__ not in views:
            views[module.__name__] = ModuleRuns(
                scheduled, module.__name__, module_inputs(request, tmp_path_factory, module)
            )
        callspec = getattr(item, "callspec", None)
        plan(
            views[module.__name__],
            views[module.__name__].inputs,
            **(dict(callspec.params) if callspec else {}),
        )
    return scheduled.start()


def module_inputs(
    request: pytest.FixtureRequest, factory: pytest.TempPathFactory, module: Any
) -> Inputs:
    """The models (built here if missing) and a scratch directory for ``module``."""
    target, draft = request.getfixturevalue("dspark_pair")
    tiny = request.getfixturevalue("tiny_model")
    variants = request.getfixturevalue("dspark_variants")
    return Inputs(tiny, target, draft, variants, factory.mktemp(module.__name__))


@pytest.fixture(scope="module")
def runs(scheduled: Scheduled, request: pytest.FixtureRequest) -> ModuleRuns:
    """This module's runs (see ``scheduled``)."""
    return scheduled.views[request.module.__name__]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The sweep goes last, so that the background prefetch has fetched the sources."""
    items.sort(key=lambda item: item.get_closest_marker("sweep") is not None)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm_build(version): the vllm-cpu build a test runs on (prefetched)"
    )


def builds_needed(items: list[pytest.Item]) -> list[str]:
    """The vllm-cpu builds the selected tests run on, in the order they need them:
    a test's ``version`` parameter or its ``vllm_build`` marker."""
    from vllm_builds import INSTALLED

    builds: dict[str, None] = {}
    for item in items:
        callspec = getattr(item, "callspec", None)
        marker = item.get_closest_marker("vllm_build")
        version = callspec.params.get("version") if callspec else None
        for build in (version, *(marker.args if marker else ())):
            if build and build != INSTALLED and Path(str(item.fspath)).name == "test_versions.py":
                builds[build] = None
    return list(builds)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start fetching what the selected tests will download, in the background."""
    builds = builds_needed(session.items)
    sweep = any(item.get_closest_marker("sweep") for item in session.items)
    if not builds and not sweep:
        return
    args = [str(REPO / "tests" / "vllm_builds.py"), "--builds", *builds]
    PREFETCH_LOG.parent.mkdir(parents=True, exist_ok=True)
    # niced: the downloads are mostly pip's own CPU time, which should only take
    # what the tests leave idle
    with open(PREFETCH_LOG, "w") as log:
        session.config.stash[_PREFETCH] = subprocess.Popen(
            ["nice", "-n", "10", sys.executable, *args, *(["--sources"] if sweep else [])],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop a prefetch that is still running (a failed or partial run); what it
    left half-written has no ``.complete`` marker and is fetched again next time."""
    process = session.config.stash.get(_PREFETCH, None)
    if process is not None and process.poll() is None:
        process.terminate()
        process.wait()


_PREFETCH = pytest.StashKey[subprocess.Popen]()
