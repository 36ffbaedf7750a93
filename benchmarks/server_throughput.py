"""Throughput and TTFT with the plugin vs vanilla vLLM on workloads with no releases.

Two servers started the same way (``python -m vllm_affinity serve``, one with ``--vanilla``),
each pinned with its whole process tree to its own core. The same multi-session append-only
workload is replayed on each in paired rounds, the server that goes first alternating every
round, each round with fresh session ids. Per round: generated tokens per second and TTFT p50 on
each side, and their plugin/vanilla ratios; reported as the median of the per-round ratios with
their spread. Variants: ``mixed`` (chat turns), ``decode`` (short prompts, long answers) and
``prefill`` (long prompts, short answers).

    python benchmarks/server_throughput.py [--variants mixed,decode,prefill] [--rounds 6]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import openai
from _common import write_json

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
                extra_headers={"X-Session-ID": session},
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
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = ("plugin", "vanilla") if r % 2 == 0 else ("vanilla", "plugin")
        row: dict[str, Any] = {"first": order[0]}
        for side in order:
            row[side] = one_round(servers[side], f"{name}-{r}", v, args.sessions, args.concurrency)
        row["throughput_ratio"] = (
            row["plugin"]["tokens_per_second"] / row["vanilla"]["tokens_per_second"]
        )
        row["ttft_p50_ratio"] = row["plugin"]["ttft_p50_ms"] / row["vanilla"]["ttft_p50_ms"]
        rounds.append(row)
        print(
            f"  {name} round {r + 1}/{args.rounds} ({order[0]} first): throughput ratio "
            f"{row['throughput_ratio']:.3f}, TTFT p50 ratio {row['ttft_p50_ratio']:.3f}",
            file=sys.stderr,
            flush=True,
        )
    return {
        "workload": {**vars(v), "sessions": args.sessions, "concurrency": args.concurrency},
        "throughput_ratio": spread([r["throughput_ratio"] for r in rounds]),
        "ttft_p50_ratio": spread([r["ttft_p50_ratio"] for r in rounds]),
        "rounds": [
            {
                "first": r["first"],
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="mixed,decode,prefill")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--cores", default="1,0", help="cores: vanilla,plugin (whole servers)")
    parser.add_argument("--out", default="benchmarks/results/server_throughput.json")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    vanilla_core, plugin_core = args.cores.split(",")
    servers = {
        "plugin": VLLMServer(
            plugin=True,
            num_blocks=args.blocks,
            api_key="bench",
            cpu_cores=plugin_core,
            pin_process=True,
        ),
        "vanilla": VLLMServer(
            plugin=False,
            num_blocks=args.blocks,
            api_key="bench",
            cpu_cores=vanilla_core,
            pin_process=True,
        ),
    }
    result: dict[str, Any] = {"blocks": args.blocks, "rounds": args.rounds, "variants": {}}
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
            cores = {"vanilla": vanilla_core, "plugin": plugin_core}
            write_json(args.out, result, echo=False, server_cores=cores)  # after every variant
    finally:
        for server in servers.values():
            server.stop()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
