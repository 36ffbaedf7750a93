"""Hybrid models in the simulator, cell by cell: vanilla (LRU), vanilla with a retention
interval, the plugin's release alone and the plugin as shipped on a hybrid model (release and
the instructions' checkpoint), with the full-attention Belady bound beside them
(``jiuwen_replay/hybrid_simulator.py``). Never worse than vanilla: the plugin's column must not
exceed vanilla's in any cell.

No server: each trace block is one token, and a cache block holds ``--per-block`` of them (1 by
default; 16:
the Claude Code trace at 1/64 of its tokens, 2 tokens a trace block, in 32-token blocks). The
model shapes: gpt-oss (one sliding-window group, 128 tokens: 4 blocks), Gemma 3 (three), and
Qwen3-Next (one Mamba group; its blocks are five times larger: 160 tokens). The instructions of
a request are the trace's (the agentinfer reader's shared leading blocks); traces that do not
say give the checkpoint nothing to keep.

    python -m benchmarks.hybrid.hybrid_sim                                  # the synthetic trace
    python -m benchmarks.hybrid.hybrid_sim --traces agentinfer=PATH --per-block 16

(``agentinfer`` alone: the trace in the installed ``agentinfer`` package; PATH: that file,
``agentinfer/agentbench/data/agentinfer_trace_requests.jsonl`` in its 0.2.0 wheel.)

Output: ``<out>/<name>.json`` and ``.md`` (default ``hybrid_sim``); exit status 0 either way
(the report says).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.lifecycle.never_worse_sim import synthetic_traces
from jiuwen_replay.formats import agentinfer_trace_path, read_trace
from jiuwen_replay.hybrid_simulator import (
    HybridModel,
    HybridRequest,
    full_attention_bound,
    simulate_hybrid,
)
from jiuwen_replay.output import write_outputs
from jiuwen_replay.simulator import CapacityError, Request, working_set
from jiuwen_replay.trace import Trace

POOLS = (0.1, 0.2, 0.35, 0.5, 1.0)
#: Per shape: the sparse group kind, how many, a window's blocks, and the block's size against a
#: 32-token block.
SHAPES: dict[str, tuple[str, int, int, int]] = {
    "gpt-oss": ("sliding_window", 1, 4, 1),
    "gemma3": ("sliding_window", 3, 4, 1),
    "qwen3-next": ("mamba", 1, 1, 5),
}
#: vLLM's retention interval on the interval side: 480 tokens, in 32-token blocks.
INTERVAL_BLOCKS = 15


def requests(trace: Trace) -> list[HybridRequest]:
    """One request a call, its trace blocks as tokens and its instructions as the trace says."""
    return [HybridRequest(r.session, tuple(r.blocks), r.instructions) for r in trace.requests]


def computed(result: dict[str, float]) -> int:
    return int(result["query_tokens"] - result["hit_tokens"])


def grid(
    name: str,
    trace: Trace,
    pools: tuple[float, ...],
    per_block: int,
    shapes: tuple[str, ...] = tuple(SHAPES),
    blocks: bool = False,
) -> list[dict[str, Any]]:
    """One row per shape and pool (``blocks``: the pools are sizes in blocks, not fractions of
    the working set)."""
    calls = requests(trace)
    rows = []
    for shape in shapes:
        kind, groups, window, scale = SHAPES[shape]
        model = HybridModel(per_block * scale, kind, groups, window)
        whole = working_set([Request(c.session, c.tokens) for c in calls], model.block)
        interval = max(1, INTERVAL_BLOCKS // scale)
        for pool in pools:
            capacity = int(pool) if blocks else max(1, int(pool * whole))
            try:
                row = {
                    policy: computed(simulate_hybrid(calls, capacity, model, policy, interval))
                    for policy in ("lru", "interval", "release", "checkpoint")
                }
            except CapacityError:
                continue  # the pool cannot hold the longest call
            bound = computed(full_attention_bound(calls, capacity, model))
            rows.append(
                {"trace": name, "shape": shape, "pool": None if blocks else pool,
                 "blocks": capacity, **row,
                 "bound": bound}
            )  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    worse = [r for r in rows if r["checkpoint"] > r["lru"]]
    lines = [
        "# Hybrid models in the simulator",
        "",
        f"`{command}`: prompt tokens computed (trace tokens). **{len(worse)} of {len(rows)} "
        "cells** computed more than vanilla with the plugin; the bound gives the whole pool to "
        "full attention under Belady (no policy on the hybrid pool computes less).",
        "",
        "| trace | shape | pool | blocks | vanilla (LRU) | interval 480 | release | plugin "
        "(release + checkpoint) | vs vanilla | bound |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = r["lru"] or 1
        pool = "-" if r["pool"] is None else f"{r['pool']}x"
        lines.append(
            f"| {r['trace']} | {r['shape']} | {pool} "
            f"| {r['blocks']} | {r['lru']:,} "
            f"| {r['interval']:,} | {r['release']:,} | {r['checkpoint']:,} "
            f"| {r['checkpoint'] / base:.3f} | {r['bound']:,} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="synthetic", help="synthetic, or format=path,...")
    parser.add_argument("--pools", default=",".join(map(str, POOLS)))
    parser.add_argument("--blocks", help="pool sizes in blocks instead of --pools")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=", ".join(SHAPES))
    parser.add_argument("--per-block", type=int, default=1, help="trace blocks per cache block")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="hybrid_sim")
    args = parser.parse_args(argv)
    pools = tuple(float(p) for p in (args.blocks or args.pools).split(","))
    shapes = tuple(s.strip() for s in args.shapes.split(",") if s.strip())
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shapes {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.traces.split(","):
            fmt, _, path = item.partition("=")
            if fmt == "synthetic":
                named = synthetic_traces(Path(tmp))
            else:
                found = path or (agentinfer_trace_path() if fmt == "agentinfer" else "")
                named = {fmt: read_trace(found, fmt)}
            for name, trace in named.items():
                print(f"{name}: {trace.describe()['requests']} calls ...", file=sys.stderr)
                rows += grid(name, trace, pools, args.per_block, shapes, bool(args.blocks))
    command = "python -m benchmarks.hybrid.hybrid_sim " + " ".join(argv or sys.argv[1:])
    text = markdown(rows, command.strip())
    write_outputs(Path(args.out), args.name, {"command": command.strip(), "rows": rows}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
