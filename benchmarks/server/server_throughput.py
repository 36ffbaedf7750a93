"""Throughput and TTFT with the plugin vs vanilla vLLM on workloads with no releases.

Two servers started the same way (``python -m vllm_affinity serve``, one with ``--vanilla``),
each pinned with its whole process tree to its own core. The same multi-session append-only
workload (fresh session ids every round) runs on one server, then, after a pause that lets the
first server's worker threads stop spinning, on the other. Two effects larger than the one
measured were found on this 2-core VM and are cancelled by design: the side that runs first is
faster (the load generator shares the idle server's core), and the two cores differ. So every
round flips both the order and the core assignment, and the result is the median, over pairs of
consecutive rounds, of each pair's geometric-mean plugin/vanilla ratio, with its spread.
Variants: ``mixed`` (chat turns), ``decode`` (short prompts, long answers) and ``prefill``
(long prompts, short answers).

    python -m benchmarks.server.server_throughput [--variants mixed,decode,prefill] [--rounds 8] \
        [--aa]

``--aa`` runs the same harness with *two vanilla servers* (the "plugin" side is a second vanilla
server): the ratios it reports are this machine's floor for the measurement.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import openai

from jiuwen_kv_protocol.headers import SESSION_HEADER
from jiuwen_replay.output import write_json
from vllm_affinity.testing import SERVED_NAME, VLLMServer, filler_text


@dataclass(frozen=True)
class Variant:
    system_words: int
    user_words: int
    max_tokens: int
    turns: int


VARIANTS = {
    "mixed": Variant(system_words=60, user_words=80, max_tokens=64, turns=6),
    "decode": Variant(system_words=20, user_words=10, max_tokens=192, turns=3),
    "prefill": Variant(system_words=300, user_words=150, max_tokens=4, turns=3),
}


def run_session(server: VLLMServer, session: str, v: Variant) -> tuple[int, list[float]]:
    """One agent session; returns tokens generated and the TTFT of each turn (streamed)."""
    rng = random.Random(session.split("/")[-1])  # same content on both servers
    client = openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)
    window: list[dict[str, Any]] = [{"role": "system", "content": filler_text(rng, v.system_words)}]
    generated, ttfts = 0, []
    with client:
        for _ in range(v.turns):
            window.append({"role": "user", "content": filler_text(rng, v.user_words)})
            started = time.perf_counter()
            first: float | None = None
            parts: list[str] = []
            stream = client.chat.completions.create(
                model=SERVED_NAME,
                messages=window,
                max_tokens=v.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
                extra_headers={SESSION_HEADER: session},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if first is None:
                        first = time.perf_counter() - started
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    generated += chunk.usage.completion_tokens
            ttfts.append(first if first is not None else time.perf_counter() - started)
            window.append({"role": "assistant", "content": "".join(parts)})
    return generated, ttfts


def one_round(server: VLLMServer, tag: str, v: Variant, sessions: int, concurrency: int) -> dict:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(run_session, server, f"{tag}/{i}", v) for i in range(sessions)]
        results = [f.result() for f in futures]
    elapsed = time.perf_counter() - start
    ttfts = [t for _, ts in results for t in ts]
    return {
        "tokens_per_second": sum(g for g, _ in results) / elapsed,
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
    }


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def measure(servers: dict[str, VLLMServer], name: str, args: argparse.Namespace) -> dict:
    v = VARIANTS[name]
    for side, server in servers.items():  # warm-up: compile, allocate, fill caches alike
        one_round(server, f"warm-{name}-{side}", v, 2, args.concurrency)
    cores = args.cores.split(",")
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        flip = r % 2
        order = ("plugin", "vanilla") if flip else ("vanilla", "plugin")
        placed = {"vanilla": cores[flip], "plugin": cores[1 - flip]}
        for side, server in servers.items():
            server.pin(placed[side])
        row: dict[str, Any] = {"first": order[0], "plugin_core": placed["plugin"]}
        for side in order:
            time.sleep(args.settle)
            row[side] = one_round(servers[side], f"{name}-{r}", v, args.sessions, args.concurrency)
        row["throughput_ratio"] = (
            row["plugin"]["tokens_per_second"] / row["vanilla"]["tokens_per_second"]
        )
        row["ttft_p50_ratio"] = row["plugin"]["ttft_p50_ms"] / row["vanilla"]["ttft_p50_ms"]
        rounds.append(row)
        print(
            f"  {name} round {r + 1}/{args.rounds} ({order[0]} first, plugin on core "
            f"{placed['plugin']}): throughput ratio {row['throughput_ratio']:.3f}, "
            f"TTFT p50 ratio {row['ttft_p50_ratio']:.3f}",
            file=sys.stderr,
            flush=True,
        )
    return {
        "workload": {**vars(v), "sessions": args.sessions, "concurrency": args.concurrency},
        "throughput_ratio": spread(paired(rounds, "throughput_ratio")),
        "ttft_p50_ratio": spread(paired(rounds, "ttft_p50_ratio")),
        "rounds": [
            {
                "first": r["first"],
                "plugin_core": r["plugin_core"],
                **{
                    side: {k: round(x, 2) for k, x in r[side].items()}
                    for side in ("plugin", "vanilla")
                },
                "throughput_ratio": round(r["throughput_ratio"], 4),
                "ttft_p50_ratio": round(r["ttft_p50_ratio"], 4),
            }
            for r in rounds
        ],
    }


def paired(rounds: list[dict[str, Any]], key: str) -> list[float]:
    """Geometric mean of each pair of consecutive rounds (order and cores flipped between them,
    so multiplicative order and core effects cancel)."""
    return [math.sqrt(rounds[i][key] * rounds[i + 1][key]) for i in range(0, len(rounds) - 1, 2)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="mixed,decode,prefill")
    parser.add_argument("--rounds", type=int, default=8, help="an even number")
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--cores", default="0,1", help="the two cores the servers swap")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between the sides")
    parser.add_argument("--aa", action="store_true", help="both servers vanilla (A/A control)")
    parser.add_argument("--out", default="benchmarks/results/server_throughput.json")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.rounds < 2 or args.rounds % 2:
        parser.error("--rounds must be an even number (rounds are paired by core)")
    first, second = args.cores.split(",")
    servers = {
        "plugin": VLLMServer(
            plugin=not args.aa,
            num_blocks=args.blocks,
            api_key="bench",
            cpu_cores=second,
            pin_process=True,
        ),
        "vanilla": VLLMServer(
            plugin=False,
            num_blocks=args.blocks,
            api_key="bench",
            cpu_cores=first,
            pin_process=True,
        ),
    }
    result: dict[str, Any] = {
        "blocks": args.blocks,
        "rounds": args.rounds,
        "aa_control": args.aa,
        "variants": {},
    }
    try:
        for name, server in servers.items():
            print(f"starting {name} server (log {server.log_path}) ...", file=sys.stderr)
            server.start()
        for name in variants:
            result["variants"][name] = measure(servers, name, args)
            summary = result["variants"][name]
            print(
                f"{name}: throughput ratio {summary['throughput_ratio']}, "
                f"TTFT p50 ratio {summary['ttft_p50_ratio']}",
                flush=True,
            )
            write_json(args.out, result, echo=False, server_cores=args.cores)  # after every variant
    finally:
        for server in servers.values():
            server.stop()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
