"""Should a router send a subagent to its lead's replica? The simulator's answer on a trace.

A router could hash a subagent by its lead's session (the lead's replica may hold a prefix the
subagent reuses) or by its own (as the plugin keys it, which the printed nginx configuration
does). This replays a trace with subagents (default: the Claude Code trace that ``agentinfer``
0.2.0 ships, ``--trace``) over ``--replicas`` replicas with LRU pools of ``--pools`` of the
trace's working set (split evenly), both ways, over ``--placements`` placements of the routing
keys (a salted hash: where nginx's ring puts a handful of sessions is luck), and reports the
fleet's mean, lowest and highest hit rate. It also counts how much of each subagent's first
prompt is a prefix its lead's blocks, or earlier subagents' blocks, already hold.

    python -m benchmarks.fleet.fleet_routing --trace .cache/traces/agentinfer_trace_requests.jsonl

No server: the trace's own block ids (seconds). Output: ``<out>/fleet_routing.{json,md}``.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from jiuwen_replay.formats import FORMATS, agentinfer_trace_path, read_trace
from jiuwen_replay.output import write_outputs
from jiuwen_replay.simulator import Request, simulate, working_set
from jiuwen_replay.trace import Trace, TraceRequest

ROUTES = ("own session", "lead's session")


def route_key(request: TraceRequest, route: str) -> str:
    if route == "lead's session" and request.parent is not None:
        return request.parent
    return request.session


def placed(key: str, replicas: int, salt: int) -> int:
    return int.from_bytes(hashlib.sha1(f"{salt}:{key}".encode()).digest()[:8], "big") % replicas


def _prefix_in(blocks: Sequence[int], held: set[int]) -> int:
    count = 0
    for block in blocks:
        if block not in held:
            break
        count += 1
    return count


def subagent_sharing(requests: Iterable[TraceRequest]) -> dict[str, int]:
    """Blocks of the subagents' first prompts, and how many lead a prefix that their lead's
    blocks, or earlier subagents' blocks, hold."""
    leads: dict[str, set[int]] = {}
    subagents: set[int] = set()
    seen: set[str] = set()
    out = {"blocks": 0, "prefix_in_lead": 0, "prefix_in_earlier_subagents": 0}
    for request in requests:
        if request.parent is not None and request.session not in seen:
            seen.add(request.session)
            out["blocks"] += len(request.blocks)
            out["prefix_in_lead"] += _prefix_in(request.blocks, leads.get(request.parent, set()))
            out["prefix_in_earlier_subagents"] += _prefix_in(request.blocks, subagents)
        if request.parent is not None:
            subagents.update(request.blocks)
        else:
            leads.setdefault(request.session, set()).update(request.blocks)
    return out


def fleet_hit_rate(trace: Trace, route: str, replicas: int, capacity: int, salt: int) -> float:
    """The fleet's token-weighted hit rate (blocks as tokens), each replica an LRU pool."""
    shares: dict[int, list[Request]] = {}
    for request in trace.requests:
        where = placed(route_key(request, route), replicas, salt)
        shares.setdefault(where, []).append(Request(request.session, request.blocks))
    hits = queries = 0.0
    for share in shares.values():
        pool = max(capacity, max(len(r.tokens) for r in share) + 1)
        result = simulate(share, pool, "lru", block=1, generated=0)
        hits += result["hit_tokens"]
        queries += result["query_tokens"]
    return hits / queries


def run(trace: Trace, replicas: Sequence[int], pools: Sequence[float], placements: int
        ) -> dict[str, Any]:  # fmt: skip
    whole = working_set([Request(r.session, r.blocks) for r in trace.requests], block=1)
    cells = []
    for count in replicas:
        for pool in pools:
            capacity = int(pool * whole / count)
            cell: dict[str, Any] = {"replicas": count, "pool": pool, "blocks_each": capacity}
            for route in ROUTES:
                rates = [
                    fleet_hit_rate(trace, route, count, capacity, s) for s in range(placements)
                ]
                cell[route] = {
                    "mean": round(statistics.mean(rates), 4),
                    "min": round(min(rates), 4),
                    "max": round(max(rates), 4),
                }
            cells.append(cell)
            print(f"  {count} replicas, pool {pool}x: {cell}", file=sys.stderr, flush=True)
    return {
        "trace": trace.describe(),
        "working_set_blocks": whole,
        "placements": placements,
        "subagent_first_prompts": subagent_sharing(trace.requests),
        "cells": cells,
    }


def markdown(result: dict[str, Any]) -> str:
    share = result["subagent_first_prompts"]
    lines = [
        f"Subagents' first prompts: {share['blocks']:,} blocks; a prefix of "
        f"{share['prefix_in_lead']:,} is in their lead's blocks, of "
        f"{share['prefix_in_earlier_subagents']:,} in earlier subagents'.",
        "",
        f"Fleet hit rate over {result['placements']} placements, mean (lowest, highest):",
        "",
        "| replicas | pool | subagent routed by its own session | by its lead's |",
        "|---:|---:|---:|---:|",
    ]
    for cell in result["cells"]:
        own, lead = (cell[route] for route in ROUTES)
        lines.append(
            f"| {cell['replicas']} | {cell['pool']}x | {own['mean']:.3f} ({own['min']:.3f}, "
            f"{own['max']:.3f}) | {lead['mean']:.3f} ({lead['min']:.3f}, {lead['max']:.3f}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", help="a trace file (default: the agentinfer package's)")
    parser.add_argument("--format", choices=FORMATS, default="agentinfer")
    parser.add_argument("--replicas", default="2,4")
    parser.add_argument("--pools", default="0.1,0.25,0.5")
    parser.add_argument("--placements", type=int, default=12)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    trace = read_trace(args.trace or agentinfer_trace_path(), args.format)
    replicas = [int(n) for n in args.replicas.split(",")]
    pools = [float(p) for p in args.pools.split(",")]
    result = run(trace, replicas, pools, args.placements)
    write_outputs(args.out, "fleet_routing", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
