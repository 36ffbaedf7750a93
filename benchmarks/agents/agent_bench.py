"""Multi-session agent benchmark: vanilla vLLM vs vLLM + vllm_affinity + jiuwen_hooks.

For each KV pool size (a fraction of the trace's working set) two servers are started the same
way, one with the plugin and one without, and the same agent trace (``agent_trace.py``) is
replayed on both, call by call interleaved, streamed:

- vanilla: plain chat requests (vLLM shares identical prefixes across sessions);
- plugin: the same requests through the installed hook (the session rides in ``X-Session-ID``,
  so prefixes are shared too; a rewritten window carries its release in ``X-KV-Release``, or, with
  ``--release post``, is preceded by ``POST /release_kv_cache``).

The two sides alternate which goes first, call by call.

Measured per side: token hit rate (``/metrics`` deltas), TTFT p50/p90/p99 (first streamed
chunk), prompt tokens actually computed, end-to-end time. The offline simulator
(``jiuwen_replay/simulator.py``) replays the same tokens under infinite cache, LRU,
LRU + release and Belady, and its LRU is compared with the real vanilla hit rate.

    python -m benchmarks.agents.agent_bench                       # full sweep (~15 min on 2 cores)
    python -m benchmarks.agents.agent_bench --quick               # the pipeline check CI runs
    python -m benchmarks.agents.agent_bench --model heavy         # a model whose prefill costs more

Output: ``<out>/agent_benchmark.json``, ``.md`` and ``.png`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai

import jiuwen_hooks
from benchmarks.agents.agent_trace import Call, TraceConfig, describe, generate
from jiuwen_replay.output import write_outputs
from jiuwen_replay.simulator import Request, gap_closed, simulate, working_set
from vllm_affinity.testing import BLOCK_SIZE, SERVED_NAME, VLLMServer
from vllm_affinity.testing.tiny_model import build as build_model

API_KEY = "bench"
#: Worker cores of the vanilla and the plugin server: one each, so neither slows the other.
SIDE_CORES = ("1", "0")
MAX_TOKENS = 4
#: The simulator's policies beside the real replay (lifecycle ones: ``lifecycle_sim.py``).
POLICIES = ("infinite", "lru", "lru_release", "belady")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def tokenize(server: VLLMServer, calls: list[Call]) -> list[tuple[int, ...]]:
    """Exact prompt tokens with vLLM's own renderer (``/tokenize``)."""
    out = []
    with httpx.Client(timeout=60, headers=server.headers()) as client:
        for call in calls:
            body = {
                "model": SERVED_NAME,
                "messages": call.window,
                "tools": call.tools,
                "add_generation_prompt": True,
            }
            response = client.post(server.root_url + "/tokenize", json=body)
            response.raise_for_status()
            out.append(tuple(response.json()["tokens"]))
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclasses.dataclass
class Side:
    """One server's measurements over a replay."""

    ttft: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0

    def summary(self, hits: float, queries: float) -> dict[str, Any]:
        return {
            "hit_rate": round(hits / queries, 4) if queries else None,
            "ttft_ms_p50": round(percentile(self.ttft, 50) * 1e3, 1),
            "ttft_ms_p90": round(percentile(self.ttft, 90) * 1e3, 1),
            "ttft_ms_p99": round(percentile(self.ttft, 99) * 1e3, 1),
            "prompt_tokens": self.prompt_tokens,
            "computed_tokens": self.prompt_tokens - self.cached_tokens,
            "end_to_end_s": round(self.seconds, 2),
        }


def stream_call(
    client: openai.OpenAI, call: Call, side: Side, headers: dict[str, str] | None = None
) -> None:
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=call.window,
        tools=call.tools or openai.omit,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        extra_headers=headers,
    )
    first = None
    for chunk in stream:
        if first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            side.prompt_tokens += chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            side.cached_tokens += (details.cached_tokens or 0) if details else 0
    end = time.perf_counter()
    side.ttft.append((first or end) - start)
    side.seconds += end - start


def prefix_counters(server: VLLMServer) -> tuple[float, float]:
    return (
        server.metric("vllm:prefix_cache_hits_total"),
        server.metric("vllm:prefix_cache_queries_total"),
    )


def warm_up(vanilla: VLLMServer, plugin: VLLMServer) -> None:
    """First requests and the first release pay one-off costs (imports, template compilation).
    The plugin side's calls run in a session, so an installed hook discovers the engine (its
    capability probe) now, not during the replay: a release due before the probe has answered
    would go out as a POST."""
    call = Call("warm-up", [{"role": "user", "content": "hello"}], [])
    for server in (vanilla, plugin):
        with (
            openai.OpenAI(
                base_url=server.base_url, api_key=server.api_key, max_retries=0
            ) as client,
            jiuwen_hooks.session("warm-up") if server is plugin else contextlib.nullcontext(),
        ):
            for _ in range(2):
                stream_call(client, call, Side())
    body = {"model": SERVED_NAME, "cache_salt": "warm-up", "messages": call.window,
            "messages_released_index": 0}  # fmt: skip
    plugin.release(body).raise_for_status()


def replay(
    calls: list[Call],
    vanilla: VLLMServer,
    plugin: VLLMServer,
    progress: Callable[[int], None],
    **hook_options: Any,
) -> dict[str, Any]:
    """Replay ``calls`` on both servers, interleaved; the hook is installed for the plugin side
    only (its calls run in a session; the vanilla side's calls have none, so the hook leaves
    them alone)."""
    if jiuwen_hooks.installed() is not None:
        raise RuntimeError(
            "replay() installs its own hook with the benchmark's options; "
            "call jiuwen_hooks.uninstall() first"
        )
    hook = jiuwen_hooks.install(**hook_options)
    try:
        warm_up(vanilla, plugin)
        hook.flush()  # the capability probe has answered
        sides = {"vanilla": Side(), "plugin": Side()}
        before = {"vanilla": prefix_counters(vanilla), "plugin": prefix_counters(plugin)}
        with (
            openai.OpenAI(
                base_url=vanilla.base_url, api_key=vanilla.api_key, max_retries=0
            ) as plain,
            openai.OpenAI(
                base_url=plugin.base_url, api_key=plugin.api_key, max_retries=0
            ) as hooked,
        ):
            for index, call in enumerate(calls):

                def plugin_side(call: Call = call) -> None:
                    with jiuwen_hooks.session(call.session):
                        stream_call(hooked, call, sides["plugin"])

                def vanilla_side(call: Call = call) -> None:
                    stream_call(plain, call, sides["vanilla"])  # no session: the hook stays out

                order = (vanilla_side, plugin_side) if index % 2 else (plugin_side, vanilla_side)
                for run_side in order:
                    run_side()
                progress(index)
        hook.flush()  # background releases still in flight
        hook_stats = hook.stats()
    finally:
        jiuwen_hooks.uninstall()
    out: dict[str, Any] = {}
    for name, server in (("vanilla", vanilla), ("plugin", plugin)):
        hits, queries = prefix_counters(server)
        out[name] = sides[name].summary(hits - before[name][0], queries - before[name][1])
    out["plugin"]["releases_post"] = hook_stats.get("releases.ok", 0)
    out["plugin"]["releases_in_request"] = hook_stats.get("releases.in_request", 0)
    (engine,) = plugin.affinity_stats()["engines"]
    out["plugin"]["block_released"] = engine.get("blocks_moved", 0) + engine.get(
        "blocks_pending", 0
    )
    out["plugin"]["released_blocks_reused"] = engine["released_reused"]
    out["ttft_ratio"] = {
        q: round(out["plugin"][f"ttft_ms_{q}"] / out["vanilla"][f"ttft_ms_{q}"], 3)
        for q in ("p50", "p90")
    }
    out["ttft_paired"] = paired_ratios(sides["vanilla"].ttft, sides["plugin"].ttft)
    return out


def paired_ratios(vanilla: list[float], plugin: list[float]) -> dict[str, float]:
    """Per-call TTFT ratios plugin / vanilla (the same call on both servers, back to back):
    their median and the 10th-90th percentile spread, and the share of calls faster with the
    plugin. Robust to the slow drift of a shared machine, which moves both sides of a pair."""
    ratios = [p / v for v, p in zip(vanilla, plugin, strict=True) if v > 0]
    return {
        "median": round(statistics.median(ratios), 3),
        "p10": round(percentile(ratios, 10), 3),
        "p90": round(percentile(ratios, 90), 3),
        "faster_share": round(sum(r < 1 for r in ratios) / len(ratios), 3),
    }


def start_pair(
    num_blocks: int, max_model_len: int, cores: tuple[str, str] = SIDE_CORES, model: Any = None
) -> tuple[VLLMServer, VLLMServer]:
    servers = tuple(
        VLLMServer(
            model=model,
            plugin=plugin,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            api_key=API_KEY,
            cpu_cores=core,
        )
        for plugin, core in ((False, cores[0]), (True, cores[1]))
    )
    for server in servers:
        server.start(wait=False)
    try:
        for server in servers:
            server.wait_healthy()
    except Exception:
        for server in servers:
            server.stop()
        raise
    return servers  # type: ignore[return-value]


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Model: {result.get('model', 'tiny')}; plugin-side releases: "
        f"{result.get('release', 'in_request')}.",
        "",
        "| pool | blocks | side | hit rate | TTFT p50 | TTFT p90 | TTFT p99 | computed tokens "
        "| time | TTFT p50 / p90 ratio | paired per-call ratio: median [p10, p90] |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in result["runs"]:
        for side in ("vanilla", "plugin"):
            s = run[side]
            ratio, pair = run.get("ttft_ratio", {}), run.get("ttft_paired", {})
            ratios = f"{ratio.get('p50')}x / {ratio.get('p90')}x" if side == "plugin" else ""
            paired = (
                f"{pair.get('median')}x [{pair.get('p10')}, {pair.get('p90')}]"
                if side == "plugin" and pair
                else ""
            )
            lines.append(
                f"| {run['fraction']}x | {run['num_blocks']} | {side} | {s['hit_rate']:.3f} | "
                f"{s['ttft_ms_p50']} ms | {s['ttft_ms_p90']} ms | {s['ttft_ms_p99']} ms | "
                f"{s['computed_tokens']:,} | {s['end_to_end_s']} s | {ratios} | {paired} |"
            )
    lines += [
        "",
        "| pool | infinite | LRU (sim) | LRU + release (sim) | Belady (sim) | gap closed | "
        "sim LRU - real vanilla |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in result["runs"]:
        sim = run["simulated"]
        closed = run["gap_closed"]
        lines.append(
            f"| {run['fraction']}x | "
            + " | ".join(f"{sim[p]['hit_rate']:.3f}" for p in POLICIES)
            + f" | {'n/a' if closed is None else f'{closed:.0%}'} | {run['sim_vs_real_lru']:+.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    x = [r["fraction"] for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(x, [r["vanilla"]["hit_rate"] for r in runs], "o-", label="vanilla vLLM (real)")
    left.plot(x, [r["plugin"]["hit_rate"] for r in runs], "o-", label="plugin + hook (real)")
    styles = {"infinite": ":", "lru": "--", "lru_release": "--", "belady": "-."}
    for policy in POLICIES:
        left.plot(
            x, [r["simulated"][policy]["hit_rate"] for r in runs], styles[policy],
            label=f"{policy} (sim)", alpha=0.7,
        )  # fmt: skip
    left.set_xlabel("KV pool / working set")
    left.set_ylabel("prefix-cache token hit rate")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    for side in ("vanilla", "plugin"):
        right.plot(x, [r[side]["ttft_ms_p90"] for r in runs], "o-", label=f"{side} p90")
        right.plot(x, [r[side]["ttft_ms_p50"] for r in runs], "x--", label=f"{side} p50")
    right.set_xlabel("KV pool / working set")
    right.set_ylabel("TTFT (ms)")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.suptitle(f"{result['trace']['calls']} calls, {result['trace']['sessions']} sessions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", default="0.25,0.5,0.75,1.0", help="fractions of working set")
    parser.add_argument("--sessions", type=int, default=TraceConfig.sessions)
    parser.add_argument("--bursts", type=int, default=TraceConfig.bursts_per_session)
    parser.add_argument("--steps", type=int, default=TraceConfig.steps_per_burst)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny trace, one pool (CI)")
    parser.add_argument(
        "--cores", default=",".join(SIDE_CORES), help="worker cores: vanilla,plugin (default 1,0)"
    )
    parser.add_argument(
        "--dispatch", choices=("inline", "background"), default="inline", help="hook dispatch mode"
    )
    parser.add_argument(
        "--release",
        choices=("in_request", "post"),
        default="in_request",
        help="plugin side: releases on the chat request (default) or as POST /release_kv_cache",
    )
    parser.add_argument(
        "--model", choices=("tiny", "heavy"), default="tiny", help="model size (see tiny_model)"
    )
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.quick:
        args.pools, args.sessions, args.bursts, args.steps = "0.5", 3, 2, 3
    return args


@dataclasses.dataclass(frozen=True)
class Tokenised:
    """The trace as vLLM's renderer tokenises it, and the sizes the pools are cut from."""

    requests: list[Request]
    working_set: int
    longest: int


def tokenised(calls: list[Call], model: Any) -> Tokenised:
    say("starting a server to tokenise the trace with vLLM's renderer ...")
    with VLLMServer(model=model, plugin=False, num_blocks=512, api_key=API_KEY) as server:
        tokens = tokenize(server, calls)
    requests = [Request(c.session, t) for c, t in zip(calls, tokens, strict=True)]
    found = Tokenised(requests, working_set(requests, BLOCK_SIZE), max(len(t) for t in tokens))
    say(f"working set {found.working_set} blocks; longest prompt {found.longest} tokens")
    return found


def run_pool(
    fraction: float, calls: list[Call], trace: Tokenised, model: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """One pool size: both servers, the replay, and the simulator on the same pool."""
    capacity = max(
        math.ceil(fraction * trace.working_set),
        -(-(trace.longest + MAX_TOKENS) // BLOCK_SIZE) + 1,
    )
    max_model_len = min(capacity * BLOCK_SIZE, 32768)
    say(f"pool {fraction}x: {capacity} usable blocks; starting vanilla and plugin servers ...")
    vanilla, plugin = start_pair(capacity + 1, max_model_len, tuple(args.cores.split(",")), model)
    try:

        def progress(i: int) -> None:
            if (i + 1) % 20 == 0 or i + 1 == len(calls):
                say(f"  pool {fraction}x: {i + 1}/{len(calls)} calls replayed on both servers")

        run = replay(
            calls,
            vanilla,
            plugin,
            progress,
            dispatch=args.dispatch,
            in_request=args.release == "in_request",
        )
    finally:
        vanilla.stop()
        plugin.stop()
    sim = {p: simulate(trace.requests, capacity, p, BLOCK_SIZE, MAX_TOKENS) for p in POLICIES}
    run.update(
        fraction=fraction,
        num_blocks=capacity + 1,
        simulated={p: {"hit_rate": round(v["hit_rate"], 4)} for p, v in sim.items()},
        gap_closed=gap_closed(sim),
        sim_vs_real_lru=round(sim["lru"]["hit_rate"] - run["vanilla"]["hit_rate"], 4),
    )
    say(
        f"pool {fraction}x: hit rate vanilla {run['vanilla']['hit_rate']} vs plugin "
        f"{run['plugin']['hit_rate']}; TTFT p50 {run['vanilla']['ttft_ms_p50']} vs "
        f"{run['plugin']['ttft_ms_p50']} ms, p90 {run['vanilla']['ttft_ms_p90']} vs "
        f"{run['plugin']['ttft_ms_p90']} ms; paired per-call ratio {run['ttft_paired']}"
    )
    return run


def output_stem(args: argparse.Namespace) -> str:
    """The result files' name: the settings that differ from the defaults are in it."""
    stem = "agent_benchmark_quick" if args.quick else "agent_benchmark"
    if args.cores != ",".join(SIDE_CORES):
        stem += "_cores_" + args.cores.replace(",", "_")
    for value, default in ((args.dispatch, "inline"), (args.release, "in_request")):
        if value != default:
            stem += "_" + value
    if args.model != "tiny":
        stem += "_" + args.model
    return stem


def trace_of(args: argparse.Namespace) -> tuple[TraceConfig, list[Call]]:
    """The trace the command line asks for (``--sessions``, ``--bursts``, ``--steps``,
    ``--seed``), announced on stderr."""
    config = TraceConfig(
        sessions=args.sessions, bursts_per_session=args.bursts, steps_per_burst=args.steps,
        seed=args.seed,
    )  # fmt: skip
    calls = generate(config)
    say(f"trace: {json.dumps(describe(calls))}")
    return config, calls


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config, calls = trace_of(args)
    say(f"building the {args.model} model ...")
    model = build_model(size=args.model)
    trace = tokenised(calls, model)
    result: dict[str, Any] = {
        "trace": {
            **describe(calls),
            "config": dataclasses.asdict(config),
            "working_set_blocks": trace.working_set,
            "longest_prompt_tokens": trace.longest,
        },
        "dispatch": args.dispatch,
        "release": args.release,
        "model": args.model,
        "runs": [run_pool(float(f), calls, trace, model, args) for f in args.pools.split(",")],
    }
    write_outputs(
        args.out, output_stem(args), result, markdown(result), plot, server_cores=args.cores
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
