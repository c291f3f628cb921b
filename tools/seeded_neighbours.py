"""Whether a seeded sampled request's output depends on what shares its batch.

    python tools/seeded_neighbours.py TARGET DRAFT [--servers dspark-sampled,dspark-probabilistic]

For each server kind of ``tools/soak.py``: six seeded requests (T = 0.8, 48 tokens),
each served alone, then again while an unrelated long request is running (sent
0.3 s before it), then alone once more. Prints, per server, how many repeated alone
and how many equal their alone output when they had a neighbour.

Confidence-scheduled verification plans every request's verify length from the
whole batch (Algorithm 1 admits draft slots across requests while the step's
expected throughput improves), so a neighbour changes how many of a request's
drafts are verified, and with it how its random draws are used. A request with
``n > 1`` is sent by vLLM's front end as one engine request per choice, one message
each, so whether the siblings share their first steps depends on timing.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from soak import Server, wait_healthy

SEEDS = range(2000, 2006)


def complete(
    client, seed: int, max_tokens: int = 48, prompt: str = "class Parser:"
) -> str:  # noqa: ANN001
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.8, seed=seed
    )
    return reply.choices[0].text


def with_neighbour(client, seed: int) -> str:  # noqa: ANN001
    neighbour = threading.Thread(target=complete, args=(client, 999, 200, "def main("))
    neighbour.start()
    time.sleep(0.3)
    text = complete(client, seed)
    neighbour.join()
    return text


def measure(name: str, target: Path, draft: Path) -> dict:
    import openai

    server = Server(name, str(target), str(draft), kv_blocks=6)
    try:
        wait_healthy(server.base, server.process)
        client = openai.OpenAI(
            base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120
        )
        alone = [complete(client, seed) for seed in SEEDS]
        neighboured = [with_neighbour(client, seed) for seed in SEEDS]
        again = [complete(client, seed) for seed in SEEDS]
    finally:
        server.stop()
    return {
        "seeds": len(SEEDS),
        "alone_repeat_equal": sum(a == b for a, b in zip(alone, again, strict=True)),
        "with_neighbour_equal_alone": sum(a == b for a, b in zip(alone, neighboured, strict=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("draft", type=Path)
    parser.add_argument("--servers", default="dspark-sampled,dspark-probabilistic")
    args = parser.parse_args()
    results = {name: measure(name, args.target, args.draft) for name in args.servers.split(",")}
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
