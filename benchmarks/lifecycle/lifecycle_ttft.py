"""TTFT of release + lifecycle against release alone, side by side: the two plugin servers run
at once, each on a core of its own, and every call of the timed trace goes to both, back to
back, the side going first alternating. Per-call ratios (lifecycle / release) are robust to the
drift of a shared machine, which moves both calls of a pair; a second round swaps the cores.

Each side has its own sessions (the trace's, suffixed with the side's name), so the one hook
keeps a separate history for each; servers, pools and calls are otherwise identical.

    python -m benchmarks.lifecycle.lifecycle_ttft [--pool 0.25] [--rounds 2]      # ~5 minutes

Output: ``<out>/lifecycle_ttft.json`` and ``.md`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from typing import Any

import jiuwen_hooks
from benchmarks.agents.agent_bench import (
    API_KEY,
    MAX_TOKENS,
    percentile,
    prefix_counters,
    say,
    tokenize,
)
from benchmarks.agents.agent_trace import Timing, TraceConfig, generate_timed
from benchmarks.lifecycle.lifecycle_replay import SCENARIOS, Replayer
from jiuwen_replay.output import write_outputs
from jiuwen_replay.simulator import Request, working_set
from vllm_affinity.testing import BLOCK_SIZE, VLLMServer

SIDES = tuple(s for s in SCENARIOS if s.name in ("release", "lifecycle"))


def one_round(calls: list[Any], capacity: int, cores: tuple[str, str]) -> dict[str, Any]:
    """Both servers up, the trace on both, per-call TTFT and hit rates."""
    servers = [
        VLLMServer(
            plugin=True, num_blocks=capacity + 1, api_key=API_KEY, cpu_cores=core,
            max_model_len=min(capacity * BLOCK_SIZE, 32768),
            env={"VLLM_AFFINITY_LIFECYCLE": "true" if side.lifecycle else "false"},
        )
        for side, core in zip(SIDES, cores, strict=True)
    ]  # fmt: skip
    for server in servers:
        server.start(wait=False)
    hook = jiuwen_hooks.install()
    try:
        for server in servers:
            server.wait_healthy()
        replayers = [Replayer(s, side, Timing()) for s, side in zip(servers, SIDES, strict=True)]
        for replayer in replayers:  # one-off costs first, and the hook's capability probe
            warm = dataclasses.replace(calls[0], session=f"warm-up~{replayer.scenario.name}")
            replayer.one(-1, warm, wait_for_signals=False)
        hook.flush()
        for replayer in replayers:
            replayer.per_call.clear()
        before = [prefix_counters(s) for s in servers]
        for index, call in enumerate(calls):
            order = replayers if index % 2 == 0 else replayers[::-1]
            for replayer in order:
                mine = dataclasses.replace(call, session=f"{call.session}~{replayer.scenario.name}")
                replayer.one(index, mine, wait_for_signals=True)
            if (index + 1) % 40 == 0:
                say(f"  {index + 1}/{len(calls)} calls on both sides")
        hook.flush()
        out: dict[str, Any] = {"cores": dict(zip((s.name for s in SIDES), cores, strict=True))}
        for replayer, server, (hits0, queries0) in zip(replayers, servers, before, strict=True):
            hits, queries = prefix_counters(server)
            ttft = [ms for _, ms, _ in replayer.per_call]
            out[replayer.scenario.name] = {
                "hit_rate": round((hits - hits0) / (queries - queries0), 4),
                "ttft_ms_p50": round(percentile(ttft, 50), 1),
                "ttft_ms_p90": round(percentile(ttft, 90), 1),
                "computed_tokens": sum(c for _, _, c in replayer.per_call),
                "calls": replayer.per_call,
            }
            replayer.close()
        return out
    finally:
        jiuwen_hooks.uninstall()
        for server in servers:
            server.stop()


def paired(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-call lifecycle / release TTFT over every round."""
    ratios = []
    for r in rounds:
        release = {i: ms for i, ms, _ in r["release"]["calls"]}
        ratios += [ms / release[i] for i, ms, _ in r["lifecycle"]["calls"] if release[i] > 0]
    return {
        "pairs": len(ratios),
        "median": round(statistics.median(ratios), 3),
        "p10": round(percentile(ratios, 10), 3),
        "p90": round(percentile(ratios, 90), 3),
        "faster_share": round(sum(r < 1 for r in ratios) / len(ratios), 3),
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Timed trace, {result['calls']} calls on both sides, pool {result['pool']}x "
        f"({result['blocks']} blocks).",
        "",
        "| round | cores release / lifecycle | hit rate | TTFT p50 (ms) | TTFT p90 (ms) |",
        "|---:|---|---:|---:|---:|",
    ]
    for n, r in enumerate(result["rounds"], 1):
        rel, life = r["release"], r["lifecycle"]
        lines.append(
            f"| {n} | {r['cores']['release']} / {r['cores']['lifecycle']} | "
            f"{rel['hit_rate']:.3f} / {life['hit_rate']:.3f} | "
            f"{rel['ttft_ms_p50']} / {life['ttft_ms_p50']} | "
            f"{rel['ttft_ms_p90']} / {life['ttft_ms_p90']} |"
        )
    p = result["paired"]
    lines += [
        "",
        f"Per-call TTFT lifecycle / release over {p['pairs']} pairs: median {p['median']} "
        f"(p10 {p['p10']}, p90 {p['p90']}); lifecycle faster in {p['faster_share']:.0%}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    calls = generate_timed(TraceConfig())
    say("tokenising the trace with vLLM's renderer ...")
    with VLLMServer(plugin=False, num_blocks=512, api_key=API_KEY) as server:
        tokens = tokenize(server, calls)
    requests = [Request(c.session, t) for c, t in zip(calls, tokens, strict=True)]
    floor = -(-(max(len(t) for t in tokens) + MAX_TOKENS) // BLOCK_SIZE) + 1
    capacity = max(math.ceil(args.pool * working_set(requests, BLOCK_SIZE)), floor)
    rounds = []
    for n in range(args.rounds):
        cores = ("0", "1") if n % 2 == 0 else ("1", "0")
        say(f"round {n + 1}/{args.rounds}: release on core {cores[0]}, lifecycle on {cores[1]}")
        rounds.append(one_round(calls, capacity, cores))
    result = {
        "pool": args.pool,
        "blocks": capacity,
        "calls": len(calls),
        "rounds": rounds,
        "paired": paired(rounds),
    }
    write_outputs(args.out, "lifecycle_ttft", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
