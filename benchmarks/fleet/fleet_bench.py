"""Two plugin replicas behind a real router (nginx): route by session, with and without release,
against round-robin.

Each scenario starts a fresh fleet (one vLLM replica with the plugin per worker core, nginx in
front) and replays the same agent trace (``agent_trace.py``) through the router, call by call:

- ``session+release``: nginx hashes ``X-Session-ID`` (consistent); the hook is installed, so each
  rewritten window carries its release on the chat request, which lands where the session is;
- ``session``: the same routing, no hook (each call sets ``X-Session-ID`` itself), no release;
- ``round_robin``: nginx round-robin, no release: a session's calls alternate between replicas;
- ``round_robin+release``: round-robin with the hook: a release reaches the replica of the new
  call, which often does not hold the session's blocks (``unknown_session``, nothing released);
- ``agent_headers``: no hook; each session is named as a coding agent names it (Claude Code's
  header, the Codex CLI's thread, a gateway's affinity header: ``AGENT_STYLES``), which the
  printed configuration hashes like ``X-Session-ID``; the plugin tells the compactions from
  the windows and releases them itself;
- ``agent_headers+round_robin``: the same calls round-robin (what a router that hashes only
  ``X-Session-ID`` did with them); ``agent_headers+one_server``: one replica with the whole
  fleet's KV, behind the same nginx (no prefix cached twice).

Measured per scenario: fleet token hit rate (``/metrics`` deltas summed over replicas), TTFT
p50/p90, prompt tokens computed, and per replica what the router's access log and the plugin's
``/affinity/stats`` say (sessions served, releases sent and acted on). The simulator replays each
replica's share of the trace (as the router's log routed it) under LRU or LRU + release.

    python -m benchmarks.fleet.fleet_bench                 # the full run (~10 min on 2 cores)
    python -m benchmarks.fleet.fleet_bench --quick         # the pipeline check CI runs

Output: ``<out>/fleet_benchmark.json``, ``.md`` and ``.png`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import openai

import jiuwen_hooks
from benchmarks.agents.agent_bench import (
    API_KEY,
    MAX_TOKENS,
    Side,
    say,
    stream_call,
    tokenize,
    trace_of,
)
from benchmarks.agents.agent_trace import Call, TraceConfig, describe
from jiuwen_kv_protocol.headers import (
    CLAUDE_CODE_SESSION_HEADER,
    CODEX_THREAD_HEADER,
    GENERIC_SESSION_HEADERS,
    SESSION_HEADER,
)
from jiuwen_replay.output import write_outputs
from jiuwen_replay.simulator import Request, simulate, working_set
from vllm_affinity.nginx import Policy
from vllm_affinity.testing import BLOCK_SIZE, NginxRouter, VLLMServer, free_port
from vllm_affinity.testing.tiny_model import build as build_model


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    #: How requests reach an engine: nginx's policy over replicas, or, for ``dp``, one server
    #: with ``--data-parallel-size`` engine cores, sessions pinned (``dp_session_affinity``) or
    #: left to vLLM's balancer.
    policy: Policy | Literal["dp_pinned", "dp_balancer"]
    release: bool
    #: No hook: each call names its session as a coding agent does (``AGENT_STYLES``), not by
    #: ``X-Session-ID``; the plugin tells the trace's compactions from the windows.
    agent_headers: bool = False
    #: One replica with the whole fleet's KV blocks, behind the same nginx (the bound a fleet
    #: can reach: no prefix cached twice).
    one_server: bool = False


SCENARIOS = (
    Scenario("session+release", "session", True),
    Scenario("session", "session", False),
    Scenario("round_robin", "round_robin", False),
    Scenario("round_robin+release", "round_robin", True),
    Scenario("dp_pinned+release", "dp_pinned", True),
    Scenario("dp_balancer+release", "dp_balancer", True),
    Scenario("agent_headers", "session", False, agent_headers=True),
    Scenario("agent_headers+round_robin", "round_robin", False, agent_headers=True),
    Scenario("agent_headers+one_server", "session", False, agent_headers=True, one_server=True),
)

#: How coding agents name a session (``AGENT_STYLES[crc32(session) % 3]``): Claude Code's
#: header, the Codex CLI's thread and root, a gateway's (and opencode's) affinity header.
AGENT_STYLES = (
    (CLAUDE_CODE_SESSION_HEADER,),
    (CODEX_THREAD_HEADER, GENERIC_SESSION_HEADERS[0]),
    (GENERIC_SESSION_HEADERS[1],),
)


def session_headers(session: str, agent_style: bool) -> dict[str, str]:
    """The headers a call of ``session`` names it by (with no hook)."""
    if not agent_style:
        return {SESSION_HEADER: session}
    return dict.fromkeys(AGENT_STYLES[zlib.crc32(session.encode()) % len(AGENT_STYLES)], session)


class Fleet:
    """``replicas`` plugin servers, one worker core each, behind one nginx router."""

    def __init__(
        self,
        replicas: int,
        num_blocks: int,
        max_model_len: int,
        policy: Policy,
        model: Any = None,
        ports: list[int] | None = None,
    ):
        """``ports``: the same ports for fleets started one after the other, so that nginx
        (which hashes onto ``host:port``) places every session on the same replica in each."""
        cores = os.cpu_count() or 1
        ports = ports or [free_port() for _ in range(replicas)]
        self.replicas = [
            VLLMServer(
                port=ports[i],
                model=model,
                num_blocks=num_blocks,
                max_model_len=max_model_len,
                api_key=API_KEY,
                cpu_cores=str(i % cores),
            )
            for i in range(replicas)
        ]
        self.router = NginxRouter([f"127.0.0.1:{r.port}" for r in self.replicas], policy=policy)

    def start(self) -> Fleet:
        try:
            for replica in self.replicas:
                replica.start(wait=False)
            for replica in self.replicas:
                replica.wait_healthy()
            self.router.start()
        except Exception:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.router.stop()
        for replica in self.replicas:
            replica.stop()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        return self.router.base_url

    def report(self, sessions: set[str]) -> dict[str, Any]:
        return replica_report(self, sessions)

    def replica(self, upstream: str) -> VLLMServer:
        return next(r for r in self.replicas if upstream.endswith(f":{r.port}"))

    def alive(self) -> list[VLLMServer]:
        return [r for r in self.replicas if r.running]

    def prefix_counters(self) -> tuple[float, float]:
        hits = queries = 0.0
        for replica in self.alive():
            hits += replica.metric("vllm:prefix_cache_hits_total")
            queries += replica.metric("vllm:prefix_cache_queries_total")
        return hits, queries


class DataParallelServer:
    """One plugin server with ``engines`` data-parallel engine cores (vLLM's own fan-out: one
    API server, one engine-core process per rank), with the same interface as ``Fleet``."""

    def __init__(
        self, engines: int, num_blocks: int, max_model_len: int, pinned: bool, model: Any = None
    ):
        self.server = VLLMServer(
            model=model,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            api_key=API_KEY,
            extra_args=("--data-parallel-size", str(engines)),
            env={"VLLM_AFFINITY_DP_SESSION_AFFINITY": "true" if pinned else "false"},
        )
        self.replicas = [self.server]
        self.router = None

    def __enter__(self) -> DataParallelServer:
        self.server.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.stop()

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def alive(self) -> list[VLLMServer]:
        return [self.server]

    def prefix_counters(self) -> tuple[float, float]:
        return (
            self.server.metric("vllm:prefix_cache_hits_total"),
            self.server.metric("vllm:prefix_cache_queries_total"),
        )

    def report(self, sessions: set[str]) -> dict[str, Any]:
        """Per engine core: what the plugin counted (no router log here)."""
        return {
            f"engine {rank}": {
                "sessions": stats["sessions"],
                "releases_in_request": stats.get("releases_in_request", 0),
                "releases_ok": stats.get("releases_ok", 0),
                "releases_unknown_session": stats.get("releases_unknown_session", 0),
                "block_released": stats.get("block_released_in_request", 0),
                "released_reused": stats["released_reused"],
            }
            for rank, stats in enumerate(self.server.affinity_stats()["engines"])
        }


def warm_up(fleet: Fleet | DataParallelServer, release: bool) -> None:
    """First requests pay one-off costs on each replica; with the hook, a call in a session
    through the router lets it discover the engine (its capability probe) before the replay."""
    call = Call("warm-up", [{"role": "user", "content": "hello"}], [])
    for replica in fleet.replicas:
        with openai.OpenAI(base_url=replica.base_url, api_key=API_KEY, max_retries=0) as client:
            for _ in range(2):
                stream_call(client, call, Side())
    if release:
        with (
            openai.OpenAI(base_url=fleet.base_url, api_key=API_KEY) as client,
            jiuwen_hooks.session("warm-up"),
        ):
            stream_call(client, call, Side())


def replay(
    fleet: Fleet | DataParallelServer,
    calls: list[Call],
    release: bool,
    progress: Callable[[int], None] = lambda i: None,
    before_call: Callable[[int, Call], None] = lambda i, c: None,
    agent_headers: bool = False,
) -> dict[str, Any]:
    """Every call through the router in trace order; ``before_call`` runs before each (a test
    kills a replica there). Retries are on (the openai client's default), as in an agent: a
    call that fails on a dying replica is sent again and the router picks a live one."""
    hook = jiuwen_hooks.install() if release else None
    try:
        warm_up(fleet, release)
        if hook is not None:
            hook.flush()
        side, before = Side(), fleet.prefix_counters()
        with openai.OpenAI(base_url=fleet.base_url, api_key=API_KEY) as client:
            for index, call in enumerate(calls):
                before_call(index, call)
                with jiuwen_hooks.session(call.session) if release else contextlib.nullcontext():
                    headers = None if release else session_headers(call.session, agent_headers)
                    stream_call(client, call, side, headers)
                progress(index)
        hook_stats = hook.stats() if hook is not None else {}
        if hook is not None:
            hook.flush()
    finally:
        if hook is not None:
            jiuwen_hooks.uninstall()
    hits, queries = fleet.prefix_counters()
    out = side.summary(hits - before[0], queries - before[1])
    out["releases_in_request"] = hook_stats.get("releases.in_request", 0)
    out["releases_post"] = hook_stats.get("releases.ok", 0)
    out["replicas"] = fleet.report({c.session for c in calls})
    return out


def replica_report(fleet: Fleet, sessions: set[str]) -> dict[str, Any]:
    """Per replica: what the router sent it (its access log) beside what the plugin counted."""
    report: dict[str, Any] = {}
    routed = [r for r in fleet.router.routed() if r.session in sessions]
    for replica in fleet.alive():
        mine = [r for r in routed if fleet.replica(r.upstream) is replica]
        stats = replica.engine_stats()
        report[str(replica.port)] = {
            "sessions_routed": sorted({r.session for r in mine}),
            "calls_routed": len(mine),
            "releases_routed": sum(r.release for r in mine),
            "releases_in_request": stats.get("releases_in_request", 0),
            "releases_ok": stats.get("releases_ok", 0),
            "releases_unknown_session": stats.get("releases_unknown_session", 0),
            "block_released": stats.get("block_released_in_request", 0)
            + stats.get("block_released_post", 0),
            "released_reused": stats["released_reused"],
        }
    return report


def simulated(fleet: Fleet, calls: list[Call], tokens: list[tuple[int, ...]], release: bool,
              capacity: int) -> float:  # fmt: skip
    """The simulator's fleet hit rate, each replica replaying the calls the router gave it."""
    chat = [r for r in fleet.router.routed() if r.uri.endswith("/chat/completions")]
    chat = [r for r in chat if r.session != "warm-up"]
    if len(chat) != len(calls):
        raise RuntimeError(f"the router logged {len(chat)} trace calls, not {len(calls)}")
    hits = queries = 0.0
    for upstream in {r.upstream for r in chat}:
        mine = [
            Request(call.session, tok)
            for call, tok, routed in zip(calls, tokens, chat, strict=True)
            if routed.upstream == upstream
        ]
        result = simulate(mine, capacity, "lru_release" if release else "lru", BLOCK_SIZE,
                          MAX_TOKENS)  # fmt: skip
        hits += result["hit_tokens"]
        queries += result["query_tokens"]
    return hits / queries if queries else 0.0


def run_scenario(scenario: Scenario, calls: list[Call], tokens: list[tuple[int, ...]] | None,
                 args: argparse.Namespace, sizes: dict[str, int]) -> dict[str, Any]:  # fmt: skip
    replicas = 1 if scenario.one_server else args.replicas
    say(f"{scenario.name}: starting {replicas} replica(s) ({scenario.policy}) ...")
    blocks, length = sizes["num_blocks"], sizes["max_model_len"]
    if scenario.one_server:  # the fleet's usable blocks in one pool
        blocks = (blocks - 1) * args.replicas + 1
    fleet: Fleet | DataParallelServer
    if scenario.policy in ("dp_pinned", "dp_balancer"):
        pinned = scenario.policy == "dp_pinned"
        fleet = DataParallelServer(args.replicas, blocks, length, pinned, args.model_path)
    else:
        policy: Policy = scenario.policy  # type: ignore[assignment]
        ports = args.ports[:replicas]
        fleet = Fleet(replicas, blocks, length, policy, args.model_path, ports)
    with fleet as f:

        def progress(i: int) -> None:
            if (i + 1) % 25 == 0 or i + 1 == len(calls):
                say(f"  {scenario.name}: {i + 1}/{len(calls)} calls")

        started = time.perf_counter()
        run = replay(f, calls, scenario.release, progress, agent_headers=scenario.agent_headers)
        run["wall_s"] = round(time.perf_counter() - started, 1)
        # round-robin with release: each replica's releases compare with what it saw last,
        # which the simulator does not model
        releases_modelled = scenario.policy == "session" or not (
            scenario.release or scenario.agent_headers
        )
        if tokens is not None and isinstance(f, Fleet) and releases_modelled:
            release = scenario.release or scenario.agent_headers  # the plugin's rule releases
            sim = simulated(f, calls, tokens, release, blocks - 1)
            run["simulated_hit_rate"] = round(sim, 4)
    say(
        f"{scenario.name}: hit rate {run['hit_rate']}, TTFT p50 {run['ttft_ms_p50']} ms, "
        f"p90 {run['ttft_ms_p90']} ms, computed {run['computed_tokens']:,} tokens"
    )
    return run


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Model: {result['model']}. {result['replicas']} replicas behind nginx (dp: one server "
        f"with {result['replicas']} data-parallel engine cores), {result['num_blocks']} KV "
        f"blocks each ({result['pool']}x of the trace's working set over all of them).",
        "",
        "| routing | hit rate (real) | hit rate (sim) | TTFT p50 | TTFT p90 | computed tokens "
        "| releases acted on / unknown session |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, run in result["scenarios"].items():
        reps = run["replicas"].values()
        ok = sum(r["releases_ok"] for r in reps)
        unknown = sum(r["releases_unknown_session"] for r in reps)
        sim = run.get("simulated_hit_rate")
        lines.append(
            f"| {name} | {run['hit_rate']:.3f} | {'n/a' if sim is None else f'{sim:.3f}'} | "
            f"{run['ttft_ms_p50']} ms | {run['ttft_ms_p90']} ms | {run['computed_tokens']:,} | "
            f"{ok} / {unknown} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["scenarios"])
    runs = [result["scenarios"][n] for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(names, [r["hit_rate"] for r in runs], color="tab:blue")
    left.set_ylabel("fleet prefix-cache token hit rate")
    x = range(len(names))
    right.bar([i - 0.2 for i in x], [r["ttft_ms_p50"] for r in runs], 0.4, label="p50")
    right.bar([i + 0.2 for i in x], [r["ttft_ms_p90"] for r in runs], 0.4, label="p90")
    right.set_xticks(list(x), names)
    right.set_ylabel("TTFT (ms)")
    right.legend()
    for axis in (left, right):
        axis.tick_params(axis="x", labelrotation=15, labelsize=8)
        axis.grid(alpha=0.3, axis="y")
    fig.suptitle(
        f"{result['trace']['calls']} calls, {result['trace']['sessions']} sessions, "
        f"{result['replicas']} replicas / engines, model {result['model']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--pool", type=float, default=0.5, help="fleet KV / working set")
    parser.add_argument("--sessions", type=int, default=TraceConfig.sessions)
    parser.add_argument("--bursts", type=int, default=TraceConfig.bursts_per_session)
    parser.add_argument("--steps", type=int, default=TraceConfig.steps_per_burst)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scenarios", default=",".join(s.name for s in SCENARIOS), help="comma-separated"
    )
    parser.add_argument(
        "--model", choices=("tiny", "heavy"), default="tiny", help="model size (see tiny_model)"
    )
    parser.add_argument("--quick", action="store_true", help="small trace, two scenarios (CI)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.quick:
        # A trace where release gains on every split of its 6 sessions over 2 replicas (the
        # simulator: at least 0.37 points), since nginx's split depends on the free ports.
        args.sessions, args.bursts, args.steps, args.seed = 6, 3, 3, 1
        args.scenarios = "session+release,session"
    known = {s.name: s for s in SCENARIOS}
    unknown = [n for n in args.scenarios.split(",") if n not in known]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {sorted(known)}")
    args.chosen = [known[n] for n in args.scenarios.split(",")]
    return args


def pool_sizes(tokens: list[tuple[int, ...]], sessions: list[str], args: argparse.Namespace
               ) -> dict[str, int]:  # fmt: skip
    """Each replica's pool: its share of ``--pool`` of the working set, at least the longest
    prompt (a replica must be able to run every call)."""
    requests = [Request(s, t) for s, t in zip(sessions, tokens, strict=True)]
    longest = max(len(t) for t in tokens)
    usable = max(
        math.ceil(args.pool * working_set(requests, BLOCK_SIZE) / args.replicas),
        -(-(longest + MAX_TOKENS) // BLOCK_SIZE) + 1,
    )
    return {
        "working_set": working_set(requests, BLOCK_SIZE),
        "num_blocks": usable + 1,
        "max_model_len": min(usable * BLOCK_SIZE, 32768),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config, calls = trace_of(args)
    say("tokenising the trace with vLLM's renderer ...")
    args.model_path = build_model(size=args.model)
    args.ports = [free_port() for _ in range(args.replicas)]  # one placement for all scenarios
    with VLLMServer(model=args.model_path, plugin=False, num_blocks=512, api_key=API_KEY) as server:
        tokens = tokenize(server, calls)
    sizes = pool_sizes(tokens, [c.session for c in calls], args)
    say(f"working set {sizes['working_set']} blocks; {sizes['num_blocks']} blocks per replica")
    result: dict[str, Any] = {
        "trace": {**describe(calls), "config": dataclasses.asdict(config)},
        "replicas": args.replicas,
        "model": args.model,
        "pool": args.pool,
        **sizes,
        "scenarios": {s.name: run_scenario(s, calls, tokens, args, sizes) for s in args.chosen},
    }
    stem = "fleet_benchmark_quick" if args.quick else "fleet_benchmark"
    stem += "" if args.model == "tiny" else f"_{args.model}"
    write_outputs(args.out, stem, result, markdown(result), plot, replica_cores="one each, 0..n-1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
