"""What Belady keeps that the plugin lets go, and which predictor closes most of it, in the
simulator at tight pools (issue 36).

For each cell (how calls end: a real agent's finish reasons or the trace's gaps; the hook ending
sessions or not; the pool as a share of the working set) the trace is simulated under LRU
(vanilla), the plugin's policy as shipped (``lifecycle``), the candidates of
``jiuwen_replay.simulator.PREDICTORS`` and Belady. Every call Belady serves better than the
plugin is classed by what its session was doing (``jiuwen_replay.gap``).

No server: each trace block is one token, a cache block holds ``--per-block`` of them (16: the
real replay of the Claude Code trace at 1/64 of its tokens), as in ``never_worse_sim``.

    python -m benchmarks.lifecycle.belady_gap --trace .cache/traces/agentinfer_trace_requests.jsonl

Output: ``<out>/<name>.json`` and ``.md`` (default ``benchmarks/results/belady_gap``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from benchmarks.lifecycle.never_worse_sim import requests as cell_requests
from jiuwen_replay.formats import FORMATS, agentinfer_trace_path, read_trace
from jiuwen_replay.gap import CLASSES, classify
from jiuwen_replay.output import write_outputs
from jiuwen_replay.simulator import PREDICTORS, CapacityError, hits_per_request, working_set
from jiuwen_replay.trace import Trace

POOLS = (0.1, 0.2, 0.35)
#: The policies of every cell, vanilla first and Belady last.
COMPARED = ("lru", "lifecycle", *PREDICTORS, "belady")


def share(hits: dict[str, int], policy: str) -> float | None:
    """The share of the LRU → Belady gap ``policy`` closes (``None`` when there is none)."""
    gap = hits["belady"] - hits["lru"]
    return (hits[policy] - hits["lru"]) / gap if gap > 0 else None


def cell(trace: Trace, signal: str, ends: bool, pool: float, block: int) -> dict[str, Any]:
    calls = cell_requests(trace, signal, ends)
    capacity = max(1, int(pool * working_set(calls, block)))
    per_call = {p: hits_per_request(calls, capacity, p, block, generated=1) for p in COMPARED}
    hits = {p: sum(h) for p, h in per_call.items()}
    parents = {r.session: r.parent for r in trace.requests if r.parent is not None}
    classes = classify(calls, parents, per_call["lifecycle"], per_call["belady"])
    return {
        "signal": signal,
        "ends": ends,
        "pool": pool,
        "blocks": capacity,
        "prompt_tokens": sum(len(c.tokens) for c in calls),
        "hit_tokens": hits,
        "gap_closed": {p: share(hits, p) for p in COMPARED[1:-1]},
        "classes": {k: dataclasses.asdict(v) for k, v in classes.items()},
    }


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def markdown(cells: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# What Belady keeps that the plugin lets go",
        "",
        f"`{command}`",
        "",
        "## The candidates: share of the LRU → Belady gap closed (hit rate)",
        "",
        "| calls end by | ends | pool | LRU | " + " | ".join(COMPARED[1:-1]) + " | Belady |",
        "|---|---|---:|---:|" + "---:|" * (len(COMPARED) - 1),
    ]
    for c in cells:
        rate = {p: h / c["prompt_tokens"] for p, h in c["hit_tokens"].items()}
        shares = " | ".join(f"{rate[p]:.4f} ({_pct(c['gap_closed'][p])})" for p in COMPARED[1:-1])
        lines.append(
            f"| {c['signal']} | {'yes' if c['ends'] else 'no'} | {c['pool']}x "
            f"| {rate['lru']:.4f} | {shares} | {rate['belady']:.4f} |"
        )
    lines += [
        "",
        "## Where the plugin (`lifecycle`) falls behind Belady, by what the session was doing",
        "",
        "Tokens Belady hits and the plugin misses, summed over the calls of each class (and, "
        "after the slash, the tokens the plugin hits and Belady misses on them).",
        "",
    ]
    for c in cells:
        behind = sum(v["behind"] for v in c["classes"].values()) or 1
        lines += [
            f"**{c['signal']}, {'ends' if c['ends'] else 'no ends'}, {c['pool']}x** "
            f"({c['blocks']} blocks):",
            "",
            "| class | calls | behind / ahead (tokens) | share of behind |",
            "|---|---:|---:|---:|",
        ]
        for name in CLASSES:
            v = c["classes"][name]
            if v["behind"] or v["ahead"]:
                lines.append(
                    f"| {name} | {v['calls']} | {v['behind']:,} / {v['ahead']:,} "
                    f"| {v['behind'] / behind:.0%} |"
                )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", help="the trace (default: the agentinfer package's)")
    parser.add_argument("--format", default="agentinfer", choices=FORMATS)
    parser.add_argument("--pools", default=",".join(str(p) for p in POOLS))
    parser.add_argument("--per-block", type=int, default=16, help="trace blocks per cache block")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="belady_gap")
    args = parser.parse_args(argv)
    pools = [float(p) for p in args.pools.split(",")]
    trace = read_trace(args.trace or agentinfer_trace_path(), args.format)
    cells = []
    for signal in ("finish", "gap"):
        for ends in (False, True):
            for pool in pools:
                try:
                    cells.append(cell(trace, signal, ends, pool, args.per_block))
                except CapacityError:
                    print(f"{signal}, ends={ends}, {pool}x: the pool cannot hold the longest call")
                    continue
                print(f"{signal}, ends={ends}, {pool}x: done", flush=True)
    command = "python -m benchmarks.lifecycle.belady_gap " + " ".join(argv or sys.argv[1:])
    write_outputs(
        args.out, args.name, {"per_block": args.per_block, "cells": cells}, markdown(cells, command)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
