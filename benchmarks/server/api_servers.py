"""What judging a coding agent's window costs a request, with one API server (the rule in the
API server's process) and with two (the rule in the engine: one engine utility call per judged
request; ``agent_windows.EngineWindows``).

Per server, one session's window grows by a turn per round; each round sends the window twice,
in alternating order: as Claude Code sends it (its session header: the rule judges it, an
``append``) and with no header (the rule does not run). Both read the whole prompt from the
cache and generate one token, so the difference between the two is the rule's cost. Each
request is timed end to end on a kept-alive connection (one API server answers it); medians
and their ratio are reported.

    python -m benchmarks.server.api_servers [--rounds 60] [--messages 40]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import httpx

from jiuwen_kv_protocol.headers import CLAUDE_CODE_SESSION_HEADER
from jiuwen_replay.output import write_json
from vllm_affinity.testing import SERVED_NAME, VLLMServer, filler_text

TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def timed(client: httpx.Client, messages: list[dict[str, str]], headers: dict[str, str]) -> float:
    body = {"model": SERVED_NAME, "messages": messages, "tools": TOOLS, "max_tokens": 1}
    started = time.perf_counter()
    client.post("/chat/completions", json=body, headers=headers).raise_for_status()
    return (time.perf_counter() - started) * 1000


def measure(api_servers: int, rounds: int, messages: int) -> dict[str, Any]:
    extra = ("--api-server-count", str(api_servers)) if api_servers > 1 else ()
    server = VLLMServer(
        plugin=True, num_blocks=1024, max_model_len=16384, eager=True, extra_args=extra
    )
    rng = random.Random(api_servers)
    window = [{"role": "system", "content": filler_text(rng, 60)}]
    for i in range(messages):  # the window the session has so far
        window.append({"role": ("user", "assistant")[i % 2], "content": filler_text(rng, 12)})
    judged: list[float] = []
    plain: list[float] = []
    with server, httpx.Client(base_url=server.base_url, timeout=60) as client:
        session = {CLAUDE_CODE_SESSION_HEADER: f"bench-{api_servers}"}
        timed(client, window, {})  # the window's blocks cached once
        timed(client, window, session)
        for index in range(rounds):
            window.append({"role": "user", "content": filler_text(rng, 12)})
            sides = [(judged, session), (plain, {})]
            for times, headers in sides if index % 2 else sides[::-1]:
                times.append(timed(client, window, headers))
            window.append({"role": "assistant", "content": filler_text(rng, 6)})
        appends = server.metric("vllm_affinity_agent_windows_total", verdict="append")
    judged_ms, plain_ms = statistics.median(judged), statistics.median(plain)
    return {
        "api_servers": api_servers,
        "rounds": rounds,
        "messages_at_start": messages + 1,
        "judged_ms": round(judged_ms, 2),
        "plain_ms": round(plain_ms, 2),
        "ratio": round(judged_ms / plain_ms, 3),
        "added_ms": round(judged_ms - plain_ms, 2),
        "appends": int(appends),  # every judged request of the rounds is one
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--messages", type=int, default=40)
    parser.add_argument("--out", default="benchmarks/results/api_servers.json")
    args = parser.parse_args(argv)
    runs = []
    for count in (1, 2):
        print(f"measuring with {count} API server(s) ...", flush=True)
        runs.append(measure(count, args.rounds, args.messages))
    write_json(args.out, {"runs": runs})
    lines = [
        "| API servers | judged (median ms) | not judged (median ms) | ratio | added ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        lines.append(
            f"| {run['api_servers']} | {run['judged_ms']} | {run['plain_ms']} | "
            f"{run['ratio']} | {run['added_ms']} |"
        )
    md = args.out.removesuffix(".json") + ".md"
    with open(md, "w") as out:
        out.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
