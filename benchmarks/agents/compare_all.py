"""The whole comparison in one command: vanilla vLLM, the plugin with the hook, the plugin with
coding agents' own headers and no hook, and AgentInfer 0.2, on one trace, per pool size, with
and without the hook ending sessions, one call at a time and on the trace's clock; one report
that says, cell by cell, whether the plugin computed more prompt tokens than vanilla.

On a GPU machine (a real model in a local folder; ``make peer-agentinfer`` for the peer):

    python -m benchmarks.agents.compare_all --model /models/Qwen2.5-7B-Instruct --scale 1 --speed 1

Here, on CPU with the small local model (the default), a reduced grid:

    python -m benchmarks.agents.compare_all --pools 0.35 --scale 0.015625 --speed 16 --limit 200

First the engine's cost at GPU pool sizes (``benchmarks/engine/engine_scale.py``: vLLM's
scheduler-side classes, no model; ``--engine-scale ""`` skips it). Each cell is
``benchmarks/agents/trace_replay.py`` (a fresh server per scenario, the simulator beside each run);
its results are kept as ``<out>/compare_<ends>_<clock>.{json,md}``, and the report is
``<out>/compare.md``. Without AgentInfer installed, its scenario is left out (and said so).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.agents import trace_replay
from benchmarks.agents.peers import AGENTINFER_VENV, agentinfer_trace
from benchmarks.engine.engine_scale import DEFAULT_CELLS

SCENARIOS = ("vanilla", "lifecycle", "agent-headers", "agentinfer")
LABELS = {
    "vanilla": "vanilla",
    "lifecycle": "plugin + hook",
    "agent-headers": "plugin, agent headers",
    "agentinfer": "AgentInfer 0.2",
}


def cells(args: argparse.Namespace) -> list[tuple[str, bool, float, str]]:
    """(file stem, ends, speed, pools) per run."""
    out = []
    for ends in (False, True):
        for speed in (0.0, args.speed):
            clock = "sequential" if speed == 0 else f"clock{speed:g}"
            pools = args.clocked_pools if speed and args.clocked_pools else args.pools
            out.append((f"compare_{'ends' if ends else 'no-ends'}_{clock}", ends, speed, pools))
    return out


def run_cell(args: argparse.Namespace, stem: str, ends: bool, speed: float, pools: str,
             scenarios: list[str]) -> dict[str, Any]:  # fmt: skip
    argv = [
        "--traces", args.traces, "--api", "messages", "--pools", pools,
        "--scale", str(args.scale), "--speed", str(speed), "--scenarios", ",".join(scenarios),
        "--out", args.out, "--name", stem, "--quiet",
    ]  # fmt: skip
    if ends:
        argv.append("--end-sessions")
    if args.model:
        argv += ["--model", args.model]
    if args.limit:
        argv += ["--limit", str(args.limit)]
    if args.sessions:
        argv += ["--sessions", str(args.sessions)]
    if trace_replay.main(argv) != 0:
        raise SystemExit(f"{stem}: trace_replay failed")
    return json.loads((Path(args.out) / f"{stem}.json").read_text())


def verdicts(stem: str, result: dict[str, Any]) -> list[str]:
    """One line per trace and pool: each side's prompt tokens computed, against vanilla's."""
    lines = []
    for row in result["traces"]:
        for pool in row["pools"]:
            runs = pool["scenarios"]
            base = runs["vanilla"]["computed_tokens"]
            sides = []
            worse = False
            for name, run in runs.items():
                computed = run["computed_tokens"]
                ratio = computed / base if base else float("nan")
                sides.append(f"{computed:,} ({ratio:.3f})")
                worse |= name in ("lifecycle", "agent-headers") and computed > base
            verdict = "**more than vanilla**" if worse else "never more"
            lines.append(
                f"| {stem.removeprefix('compare_')} | {row['trace']['format']} | {pool['pool']}x "
                f"| {' | '.join(sides)} | {verdict} |"
            )
    return lines


def engine_section(cells: str, out: Path) -> list[str]:
    """The engine's cost at GPU pool sizes (``benchmarks/engine/engine_scale.py``), run before the
    traces so a GPU run reports the plugin's scheduler time beside its hits; its table."""
    if not cells:
        return []
    from benchmarks.engine import engine_scale

    engine_scale.main(["--cells", cells, "--hybrid", "--out", str(out)])
    table = (out / "engine_scale.md").read_text().strip().splitlines()
    return ["# The engine's cost", "", *table, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="agentinfer", help="as trace_replay's --traces")
    parser.add_argument("--pools", default="0.1,0.2,0.35,0.5,1.0")
    parser.add_argument("--scale", type=float, default=1 / 16)
    parser.add_argument("--speed", type=float, default=16.0, help="the clocked runs' speed-up")
    parser.add_argument("--model", help="a real model's folder (default: the small test model)")
    parser.add_argument("--limit", type=int, help="the first N calls of the trace only")
    parser.add_argument("--sessions", type=int, help="the first N agent sessions only")
    parser.add_argument("--clocked-pools", help="the clocked runs' pools (default: --pools)")
    parser.add_argument("--no-peer", action="store_true", help="leave AgentInfer out")
    parser.add_argument("--out", default="benchmarks/results/compare")
    parser.add_argument(
        "--engine-scale", default=DEFAULT_CELLS,
        help="first, the plugin's engine cost at these pool sizes (benchmarks.engine.engine_scale "
        "cells, one group and hybrid); empty: skip it",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.traces == "agentinfer" and (trace := agentinfer_trace()) is not None:
        args.traces = f"agentinfer={trace}"  # the package is in the peer's virtualenv
    scenarios = list(SCENARIOS)
    notes = []
    if args.no_peer:
        scenarios.remove("agentinfer")
        notes.append("AgentInfer left out (`--no-peer`).")
    elif not (AGENTINFER_VENV / "bin" / "python").exists():
        scenarios.remove("agentinfer")
        notes.append(f"AgentInfer is not installed ({AGENTINFER_VENV}): `make peer-agentinfer`.")
    header = " | ".join(LABELS[s] for s in scenarios)
    lines = [
        "# The comparison",
        "",
        f"`python -m benchmarks.agents.compare_all {' '.join(argv or sys.argv[1:])}`; "
        "prompt tokens "
        "computed (against vanilla). The plugin's sides must never compute more than vanilla.",
        *notes,
        "",
        f"| run | trace | pool | {header} | plugin vs vanilla |",
        "|---|---|---:|" + "---:|" * len(scenarios) + "---|",
    ]
    lines = [*engine_section(args.engine_scale, Path(args.out)), *lines]
    for stem, ends, speed, pools in cells(args):
        lines += verdicts(stem, run_cell(args, stem, ends, speed, pools, scenarios))
    report = "\n".join(lines) + "\n"
    (Path(args.out) / "compare.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
