"""Reproduce HTTP keep-alive's race against vLLM's OpenAI server, with and without reuse.

    python tools/keepalive_race.py TARGET [--rounds 150] [--load-threads 8]

Starts the soak's ``plain`` server (``tools/soak.py``: no speculation, no overlay
patch but ``cpu_seed`` on the CPU backend) with ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE=1`` so
that idle connections expire within a second, keeps it busy with ``--load-threads``
streaming requests, and sends pairs of one-token completions from one client: one,
then an idle pause swept across the keep-alive timeout (0.94 s and up, 1 ms apart),
then the next. It does this twice, with the openai client's pooled connections
reused and with a fresh connection per request, and counts the requests that end in
a connection error ("Server disconnected without sending a response"). The soak's
lost requests were of that kind (docs/performance.md, soak of 2026-12-03).

Prints one ``RESULT`` JSON line: per mode, requests sent and the transport errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from soak import Server, one_connection_per_request, started  # noqa: E402

KEEP_ALIVE_S = 1


def pooled(base: str):  # noqa: ANN201
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def keep_busy(base: str, stop: threading.Event, errors: list[str]) -> None:
    import openai

    client = pooled(base)
    while not stop.is_set():
        try:
            for _ in client.completions.create(
                model="tiny", prompt="class A:", max_tokens=100, stream=True
            ):
                pass
        except openai.APIConnectionError as exc:
            errors.append(repr(exc.__cause__ or exc)[:80])


def pairs(client, rounds: int) -> tuple[int, Counter]:  # noqa: ANN001
    import openai

    sent, errors = 0, Counter()
    for i in range(rounds):
        for pause in (0.0, 0.94 + 0.001 * i):
            time.sleep(pause)
            sent += 1
            try:
                client.completions.create(model="tiny", prompt="def f(", max_tokens=1)
            except openai.APIConnectionError as exc:
                errors[repr(exc.__cause__ or exc)[:80]] += 1
    return sent, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--load-threads", type=int, default=8)
    args = parser.parse_args()
    os.environ["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(KEEP_ALIVE_S)
    server = Server("plain", args.target, None, kv_blocks=64)
    if not started(server):
        sys.exit("the server did not start (port race); run again")
    stop, load_errors = threading.Event(), []
    threads = [
        threading.Thread(target=keep_busy, args=(server.base, stop, load_errors), daemon=True)
        for _ in range(args.load_threads)
    ]
    result: dict = {"keep_alive_s": KEEP_ALIVE_S, "load_threads": args.load_threads}
    try:
        for thread in threads:
            thread.start()
        for mode, client in (
            ("reused", pooled(server.base)),
            ("one_per_request", one_connection_per_request(server.base)),
        ):
            sent, errors = pairs(client, args.rounds)
            result[mode] = {"sent": sent, "lost": sum(errors.values()), "errors": dict(errors)}
    finally:
        stop.set()
        server.stop()
    result["load_lost"] = len(load_errors)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
