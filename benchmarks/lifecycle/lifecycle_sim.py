"""Beyond release, in the simulator first: how much of the LRU → Belady gap each eviction policy
closes, on the ordered agent trace and on timed traces (tool calls of seconds, users of tens of
seconds: ``agent_trace.Timing``).

Every window is tokenised with vLLM's own renderer (``/tokenize`` of a real server), then
``jiuwen_replay.simulator.simulate`` replays the trace under every policy at several pool
sizes (fractions of the trace's working set). ``lifecycle`` is what the plugin runs (its IDLE
segment); ``benchmarks/lifecycle/lifecycle_replay.py`` checks the simulator against real servers.

    python -m benchmarks.lifecycle.lifecycle_sim  # ~1 minute (one server start to tokenise)

Output: ``<out>/lifecycle_sim.json`` and ``.md`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any

from benchmarks.agents.agent_bench import API_KEY, MAX_TOKENS, say, tokenize
from benchmarks.agents.agent_trace import (
    Call,
    Timing,
    TraceConfig,
    describe,
    generate,
    generate_timed,
)
from jiuwen_replay.output import write_outputs
from jiuwen_replay.simulator import (
    ORACLES,
    POLICIES,
    Request,
    gap_closed,
    simulate,
    working_set,
)
from vllm_affinity.testing import BLOCK_SIZE, VLLMServer

#: The policies whose share of the LRU → Belady gap is reported (the oracles: what lifecycle
#: would gain from knowing the next compaction one call ahead, or who comes back first).
CLOSERS = ("lru_release", "lifecycle", *ORACLES)


def traces() -> dict[str, list[Call]]:
    return {
        "ordered (the agent benchmark's)": generate(TraceConfig()),
        "timed, 10 sessions": generate_timed(TraceConfig()),
        "timed, 20 sessions": generate_timed(TraceConfig(sessions=20)),
    }


def table(requests: list[Request], pools: list[float]) -> list[dict[str, Any]]:
    ws = working_set(requests, BLOCK_SIZE)
    floor = -(-(max(len(r.tokens) for r in requests) + MAX_TOKENS) // BLOCK_SIZE) + 1
    rows = []
    for fraction in pools:
        capacity = max(math.ceil(fraction * ws), floor)
        results = {
            p: simulate(requests, capacity, p, BLOCK_SIZE, MAX_TOKENS) for p in POLICIES + ORACLES
        }
        rows.append(
            {
                "pool": fraction,
                "blocks": capacity,
                "hit_rate": {p: round(r["hit_rate"], 4) for p, r in results.items()},
                "gap_closed": {
                    p: None if (g := gap_closed(results, p)) is None else round(g, 3)
                    for p in CLOSERS
                },
            }
        )
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for name, trace in result["traces"].items():
        lines += [
            f"**{name}**: {trace['calls']} calls, {trace['sessions']} sessions, "
            f"finish {trace['finish']}, working set {trace['working_set_blocks']} blocks.",
            "",
            "| pool | " + " | ".join(POLICIES) + " | gap closed: " + " / ".join(CLOSERS) + " |",
            "|---:|" + "---:|" * (len(POLICIES) + 1),
        ]
        for row in trace["rows"]:
            closed = " / ".join(
                "n/a" if (g := row["gap_closed"][p]) is None else f"{g:.0%}" for p in CLOSERS
            )
            rates = " | ".join(f"{row['hit_rate'][p]:.3f}" for p in POLICIES)
            lines.append(f"| {row['pool']}x | {rates} | {closed} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", default="0.25,0.5,0.75,1.0")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    pools = [float(p) for p in args.pools.split(",")]
    found = traces()
    say("tokenising the traces with vLLM's renderer ...")
    with VLLMServer(plugin=False, num_blocks=512, api_key=API_KEY) as server:
        tokens = {name: tokenize(server, calls) for name, calls in found.items()}
    result: dict[str, Any] = {"timing": dataclasses.asdict(Timing()), "traces": {}}
    for name, calls in found.items():
        requests = [
            Request(c.session, t, c.finish, c.at) for c, t in zip(calls, tokens[name], strict=True)
        ]
        result["traces"][name] = {
            **describe(calls),
            "working_set_blocks": working_set(requests, BLOCK_SIZE),
            "rows": table(requests, pools),
        }
        say(f"{name}: simulated")
    write_outputs(args.out, "lifecycle_sim", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
