"""Throughput with the plugin vs vanilla vLLM on a workload with no releases.

Two servers started the same way (``python -m vllm_affinity serve``, one with ``--vanilla``),
the same multi-session append-only workload replayed on each in alternating rounds (plugin,
vanilla, plugin, ...), each round with fresh session ids. Reports generated tokens per second
and the plugin/vanilla ratio of the medians.

    python benchmarks/server_throughput.py [--rounds 5] [--sessions 16] [--turns 6]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import sys
import time
from typing import Any

import openai
from _common import write_json

from vllm_affinity.testing import SERVED_NAME, VLLMServer, filler_text


def run_session(server: VLLMServer, session: str, turns: int, max_tokens: int) -> int:
    rng = random.Random(session)
    client = openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)
    window: list[dict[str, Any]] = [{"role": "system", "content": filler_text(rng, 60)}]
    generated = 0
    with client:
        for _ in range(turns):
            window.append({"role": "user", "content": filler_text(rng, 80)})
            reply = client.chat.completions.create(
                model=SERVED_NAME,
                messages=window,
                max_tokens=max_tokens,
                extra_body={"cache_salt": session, "ignore_eos": True},
                extra_headers={"X-Session-ID": session},
            )
            generated += reply.usage.completion_tokens
            window.append({"role": "assistant", "content": reply.choices[0].message.content})
    return generated


def one_round(server: VLLMServer, tag: str, args: argparse.Namespace) -> float:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        futures = [
            pool.submit(run_session, server, f"{tag}-{i}", args.turns, args.max_tokens)
            for i in range(args.sessions)
        ]
        tokens = sum(f.result() for f in futures)
    return tokens / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--cores", default="1,0", help="worker cores: vanilla,plugin")
    parser.add_argument("--out", default="benchmarks/results/server_throughput.json")
    args = parser.parse_args()
    vanilla_core, plugin_core = args.cores.split(",")
    servers = {
        "plugin": VLLMServer(
            plugin=True, num_blocks=args.blocks, api_key="bench", cpu_cores=plugin_core
        ),
        "vanilla": VLLMServer(
            plugin=False, num_blocks=args.blocks, api_key="bench", cpu_cores=vanilla_core
        ),
    }
    rates: dict[str, list[float]] = {"plugin": [], "vanilla": []}
    try:
        for name, server in servers.items():
            print(
                f"starting {name} server (log {server.log_path}) ...", file=sys.stderr, flush=True
            )
            server.start()
        for name, server in servers.items():  # warm-up: first requests compile and allocate
            one_round(server, f"warm-{name}", argparse.Namespace(**{**vars(args), "sessions": 2}))
        for r in range(args.rounds):
            for name, server in servers.items():
                rates[name].append(one_round(server, f"{name}-{r}", args))
                print(f"  round {r + 1}/{args.rounds} {name}: {rates[name][-1]:.1f} tok/s",
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for server in servers.values():
            server.stop()
    medians = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "workload": {
            k: getattr(args, k) for k in ("sessions", "turns", "concurrency", "max_tokens")
        },
        "blocks": args.blocks,
        "cores_vanilla_plugin": args.cores,
        "rounds": args.rounds,
        "tokens_per_second": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "median_tokens_per_second": {k: round(v, 1) for k, v in medians.items()},
        "ratio_plugin_vs_vanilla": round(medians["plugin"] / medians["vanilla"], 3),
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
