"""On a GPU, one command: the Claude Code trace against vanilla vLLM, vanilla with vLLM's native
CPU offload, the plugin, and the plugin with the same offload, one server after another.

    python -m benchmarks.gpu.offload_sides --model Qwen/Qwen3-8B

Each side gets a fresh ``vllm serve`` (``python -m vllm_affinity serve``, ``--vanilla`` for the
vanilla sides) on 127.0.0.1 with prefix caching; the offload sides add
``--kv-transfer-config`` for vLLM's ``OffloadingConnector`` with a CPU tier of ``--cpu-gib``.
The agentinfer Claude Code trace (``jiuwen-bench replay``'s default: ``pip install
agentinfer==0.2.0``) is replayed at 1x prompt tokens through the ``anthropic`` SDK, each call
with Claude Code's own session header (no hook: the server tells compactions from the windows,
as with the real agent), answers capped at ``--max-output-tokens`` so that a side takes a few
minutes on one H100 with an 8B model. The server's own counters say where each prompt token
came from (``vllm:prompt_tokens_by_source``: computed, hit on the GPU, loaded from the CPU
tier); the plugin sides add their releases and ``released_hit``. The table is the one
``benchmarks/engine/trace_engine.py`` prints for the model-less replay.

Not run here (no GPU; vLLM's CPU build cannot run the ``OffloadingConnector``'s worker side):
``--sides vanilla,plugin`` runs the no-offload half on any machine, and ``--dry-run`` prints
the four servers' commands.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

RESULTS = Path(__file__).resolve().parents[1] / "results"
SERVED = "bench"


@dataclass(frozen=True)
class Side:
    name: str
    plugin: bool
    offload: bool


SIDES = {
    side.name: side
    for side in (
        Side("vanilla", False, False),
        Side("vanilla+offload", False, True),
        Side("plugin", True, False),
        Side("plugin+offload", True, True),
    )
}


def command(side: Side, args: argparse.Namespace) -> list[str]:
    """The side's server: this package's launcher (vLLM's own CLI, the plugin loaded or not)."""
    cmd = [sys.executable, "-m", "vllm_affinity", "serve", args.model]
    if not side.plugin:
        cmd.append("--vanilla")
    cmd += [
        "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(args.port),
        "--enable-prefix-caching", "--max-model-len", str(args.max_model_len),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
    ]  # fmt: skip
    cmd += shlex.split(args.vllm_args)
    if side.offload:
        tier = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": int(args.cpu_gib * (1 << 30))},
        }
        cmd += ["--kv-transfer-config", json.dumps(tier)]
    return cmd


@contextmanager
def serving(side: Side, args: argparse.Namespace, log: Path) -> Iterator[str]:
    """The side's server, up (``/health`` answers), until the block ends; its root URL."""
    root = f"http://127.0.0.1:{args.port}"
    with log.open("wb") as out:
        process = subprocess.Popen(command(side, args), stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + args.startup_timeout
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{side.name}: the server exited; see {log}")
                try:
                    if httpx.get(root + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{side.name}: no /health in {args.startup_timeout}s")
                time.sleep(2)
            yield root
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def token_sources(root: str) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source`` summed per source (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    text = httpx.get(root + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total":
                source = sample.labels["source"]
                out[source] = out.get(source, 0.0) + sample.value
    return out


def run_side(side: Side, trace: Any, args: argparse.Namespace) -> dict[str, Any]:
    from jiuwen_replay.compare import summarize
    from jiuwen_replay.runner import ReplayOptions, Target, run

    options = ReplayOptions(
        model=SERVED, scale=args.scale, speed=0.0 if args.sequential else 1.0,
        concurrency=args.concurrency, max_output_tokens=args.max_output_tokens, api="messages",
        next_use="finish", progress=not args.quiet,
    )  # fmt: skip
    log = Path(args.out).with_name(f"{Path(args.out).name}_{side.name}.log")
    print(f"{side.name}: starting the server (log {log}) ...", flush=True)
    with serving(side, args, log) as root:
        before = token_sources(root)
        result = run(trace, Target(side.name, root + "/v1", False, agent_headers=True), options, 1)
        after = token_sources(root)
        sources = {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}
        row = {"side": side.name, **summarize(result), "sources": sources}
        if side.plugin:
            from jiuwen_kv_protocol.models import EngineStats

            (engine,) = httpx.get(root + "/affinity/stats", timeout=10).json()["engines"]
            stats = EngineStats.model_validate(engine)
            row["released"] = stats.counter("blocks_moved") + stats.counter("blocks_pending")
            row["released_hit"] = stats.released_hit
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| side | prompt tokens | hit (GPU) | loaded (CPU) | computed | TTFT p50 / p90 ms "
        "| released (hit again) |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        src = row["sources"]
        released = f"{row['released']:,} ({row['released_hit']})" if "released" in row else ""
        lines.append(
            f"| {row['side']} | {sum(src.values()):,} | {src.get('local_cache_hit', 0):,} "
            f"| {src.get('external_kv_transfer', 0):,} | {src.get('local_compute', 0):,} "
            f"| {row['ttft_ms_p50']} / {row['ttft_ms_p90']} | {released} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model vLLM serves on this GPU")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--cpu-gib", type=float, default=64.0, help="the CPU tier's size")
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-output-tokens", type=int, default=32)
    parser.add_argument("--scale", type=float, default=1.0, help="prompt token multiplier")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sequential", action="store_true", help="one call at a time")
    parser.add_argument("--limit", type=int, default=0, help="the first N calls (0: all)")
    parser.add_argument("--trace", help="the trace file (default: agentinfer's Claude Code)")
    parser.add_argument("--vllm-args", default="", help="more arguments for every server")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--startup-timeout", type=float, default=1200.0)
    parser.add_argument("--dry-run", action="store_true", help="print the servers' commands")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "gpu_offload_sides"))
    args = parser.parse_args(argv)
    unknown = [name for name in args.sides.split(",") if name not in SIDES]
    if unknown:
        print(f"offload_sides: unknown sides {unknown}: of {list(SIDES)}", file=sys.stderr)
        return 2
    sides = [SIDES[name] for name in args.sides.split(",")]
    if args.dry_run:
        for side in sides:
            print(f"{side.name}: {subprocess.list2cmdline(command(side, args))}")
        return 0
    from dataclasses import replace

    from jiuwen_replay.formats import TraceFormatError, agentinfer_trace_path, read_trace

    try:
        trace = read_trace(args.trace or agentinfer_trace_path(), "agentinfer")
    except (TraceFormatError, ValueError) as exc:
        print(f"offload_sides: {exc}", file=sys.stderr)
        return 2
    if args.limit:
        trace = replace(trace, requests=trace.requests[: args.limit])
    os.makedirs(Path(args.out).parent, exist_ok=True)
    rows = [run_side(side, trace, args) for side in sides]
    text = table(rows)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(f"`{subprocess.list2cmdline(sys.argv)}`\n\n{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
