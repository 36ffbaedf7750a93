""" "Never worse than vanilla", cell by cell, in the simulator: every trace and format, pools
from 0.1x to 1x, with and without the hook ending sessions, calls ending as a real agent's
would (``finish``) or as the trace's gaps say (``gap``); the plugin's policy as shipped (release
and lifecycle with the idle guard) and without the guard, against LRU (vanilla vLLM).

No server: each trace block is one token, and a cache block holds ``--per-block`` of them (16
matches the real replay of the Claude Code trace at 1/64 of its tokens: 2 tokens per trace
block, 32 per vLLM block). The real-server grid is ``benchmarks/agents/compare_all.py``; the
simulator agrees with the server within a few thousandths of hit rate (``docs/benchmarks.md``).

    python -m benchmarks.lifecycle.never_worse_sim  # the synthetic trace, 4 formats
    python -m benchmarks.lifecycle.never_worse_sim --traces agentinfer=PATH --per-block 16
    python -m benchmarks.lifecycle.never_worse_sim --traces agentinfer=PATH --per-block 16 \
        --copies 8

``--picker`` runs the plugin with its opt-in predicted-return picker on (the simulator's
``lifecycle+return-unguarded``). ``--copies N`` runs N copies of every session over one pool
(``Trace.copies``: content of their own, each copy started ``--stagger`` trace seconds after the
previous), as the load benchmark does on a real server.

Output: ``<out>/<name>.json`` and ``.md``; exit status 0 either way (the report says).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from jiuwen_replay.compare import sim_requests
from jiuwen_replay.formats import FORMATS, WRITERS, read_trace
from jiuwen_replay.output import write_outputs
from jiuwen_replay.runner import ReplayOptions
from jiuwen_replay.simulator import CapacityError, Request, simulate, working_set
from jiuwen_replay.synthetic import SyntheticConfig, generate
from jiuwen_replay.trace import Trace

POOLS = (0.1, 0.2, 0.35, 0.5, 1.0)
SIGNALS = ("finish", "gap")


def requests(trace: Trace, signal: str, ends: bool, hinted: bool = True) -> list[Request]:
    """The trace as the hook replays it one call at a time (``hinted``: with its hints; a
    coding agent's own headers carry none)."""
    options = ReplayOptions(model="-", next_use=signal, end_sessions=ends, speed=0)
    return sim_requests(trace, options, hinted=hinted)


def computed(calls: list[Request], capacity: int, policy: str, block: int, guard: bool) -> int:
    result = simulate(calls, capacity, policy, block, generated=1, idle_guard=guard)
    return int(result["query_tokens"] - result["hit_tokens"])


def grid(
    name: str, trace: Trace, pools: tuple[float, ...], block: int, policy: str = "lifecycle"
) -> list[dict[str, Any]]:
    """One row per cell: prompt tokens computed by LRU, the plugin (``policy``), the plugin
    without guard and Belady (the least any eviction order computes)."""
    rows = []
    for signal in SIGNALS:
        for ends in (False, True):
            calls = requests(trace, signal, ends)
            whole = working_set(calls, block)
            for pool in pools:
                capacity = max(1, int(pool * whole))
                try:
                    lru = computed(calls, capacity, "lru", block, True)
                except CapacityError:
                    continue  # the pool cannot hold the longest call
                rows.append(
                    {
                        "trace": name,
                        "signal": signal,
                        "ends": ends,
                        "pool": pool,
                        "blocks": capacity,
                        "vanilla": lru,
                        "plugin": computed(calls, capacity, policy, block, True),
                        "unguarded": computed(calls, capacity, policy, block, False),
                        "belady": computed(calls, capacity, "belady", block, True),
                    }
                )
    return rows


def synthetic_traces(folder: Path) -> dict[str, Trace]:
    """The synthetic trace written and read back in every format."""
    trace = generate(SyntheticConfig())
    out = {}
    for fmt in FORMATS:
        path = folder / f"synthetic.{fmt}.jsonl"
        WRITERS[fmt](trace, path)
        out[f"synthetic/{fmt}"] = read_trace(path, fmt)
    return out


def gap_closed(row: dict[str, Any]) -> str:
    """The share of the LRU → Belady gap (computed tokens) the plugin closes in a cell."""
    gap = row["vanilla"] - row["belady"]
    return f"{(row['vanilla'] - row['plugin']) / gap:.0%}" if gap > 0 else "-"


def markdown(rows: list[dict[str, Any]], command: str, plugin: str = "as shipped") -> str:
    worse = [r for r in rows if r["plugin"] > r["vanilla"]]
    lines = [
        "# Never worse than vanilla: the simulator's grid",
        "",
        f"`{command}`: prompt tokens computed. **{len(worse)} of {len(rows)} cells** computed "
        f"more than vanilla with the plugin {plugin}; "
        f"{sum(r['unguarded'] > r['vanilla'] for r in rows)} without the idle guard.",
        "",
        "| trace | calls end by | ends | pool | vanilla (LRU) | plugin | vs vanilla "
        "| no idle guard | vs vanilla | Belady | gap closed |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = r["vanilla"] or 1
        lines.append(
            f"| {r['trace']} | {r['signal']} | {'yes' if r['ends'] else 'no'} | {r['pool']}x "
            f"| {r['vanilla']:,} | {r['plugin']:,} | {r['plugin'] / base - 1:+.1%} "
            f"| {r['unguarded']:,} | {r['unguarded'] / base - 1:+.1%} "
            f"| {r['belady']:,} | {gap_closed(r)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="synthetic", help="synthetic, or format=path,...")
    parser.add_argument("--pools", default=",".join(str(p) for p in POOLS))
    parser.add_argument("--per-block", type=int, default=1, help="trace blocks per cache block")
    parser.add_argument("--copies", type=int, default=1, help="copies of every session")
    parser.add_argument("--stagger", type=float, default=60.0, help="trace seconds between copies")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="never_worse_sim")
    parser.add_argument(
        "--picker", action="store_true",
        help="the plugin with its predicted-return picker on (VLLM_AFFINITY_PREDICT_RETURN)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    pools = tuple(float(p) for p in args.pools.split(","))
    policy = "lifecycle+return-unguarded" if args.picker else "lifecycle"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        for item in args.traces.split(","):
            if item == "synthetic":
                for name, trace in synthetic_traces(Path(folder)).items():
                    rows += grid(name, trace, pools, args.per_block, policy)
                continue
            fmt, _, path = item.partition("=")
            if fmt not in FORMATS or not path:
                raise SystemExit(f"--traces: expected format=path, got {item!r}")
            trace = read_trace(path, fmt).copies(args.copies, args.stagger)
            copies = f", {args.copies} copies" if args.copies > 1 else ""
            name = f"{fmt}:{Path(path).name}{copies}"
            rows += grid(name, trace, pools, args.per_block, policy)
    command = "python -m benchmarks.lifecycle.never_worse_sim " + " ".join(argv or sys.argv[1:])
    report = markdown(
        rows, command.strip(), "with its predicted-return picker" if args.picker else "as shipped"
    )
    write_outputs(args.out, args.name, {"per_block": args.per_block, "cells": rows}, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
