"""Real traces on this machine: vanilla vs release vs release + lifecycle, per pool size.

For each trace (``--traces format=path,...``; ``agentinfer`` alone takes the installed package's
trace), the prompts are rendered once by vLLM's own template to size the pools (fractions of
the trace's working set, ``--pools``); then for each pool every scenario gets a fresh server of
that size and replays the trace with ``jiuwen_replay`` (what ``jiuwen-bench replay``
runs), the simulator beside it:

- ``vanilla``: vLLM without the plugin, no hook (simulator: LRU);
- ``vanilla-hooked``: vLLM without the plugin, the hook installed (it finds no plugin;
  no release is applied): what installing the hook costs where the plugin is absent;
- ``vanilla-interval``: vLLM without the plugin, keeping a hybrid model's sliding-window and
  Mamba state every 480 tokens (``--prefix-cache-retention-interval``, vLLM's own alternative
  to the plugin's instructions' checkpoints; no effect on a one-group model);
- ``release``: the plugin with its lifecycle off, the hook releasing in the request (LRU +
  release);
- ``plugin-untold``: the plugin as shipped, no hook and no agent headers: nothing tells it a
  session, so it acts on nothing (simulator: LRU), and its TTFT beside vanilla's is what the
  plugin costs a client that does not use it;
- ``lifecycle``: the plugin as shipped, told what a real model's finish reasons would say
  (``X-KV-Next-Use``: a call whose subagents run next, or a tool call, keeps its session live; a
  finished turn or task makes it idle) (lifecycle);
- ``lifecycle-gap``: the same, told instead each session's time to its next call in the trace;
- ``no-predict``: ``lifecycle`` with the predicted-return picker off
  (``VLLM_AFFINITY_PREDICT_RETURN=false``; ``agent-headers-no-predict`` the same for
  ``agent-headers``): the idle guard and LRU's order alone;
- the subagent options of ``lifecycle`` one at a time (the hook names each subagent's parent):
  ``child-idle`` (a subagent's task end idles its blocks instead of releasing them),
  ``protect`` (a waiting parent's blocks in the PROTECTED segment, up to a quarter of the pool;
  off as shipped), ``no-parents`` (neither: the hook names no parent);
- ``agentinfer``: AgentInfer 0.2 instead of our plugin (``benchmarks/agents/peers.py``), no hook,
  the agents' own headers as in ``agent-headers`` (it reads Claude Code's), simulator: LRU;
- ``agent-headers``: the plugin as shipped and no hook; each call carries a coding agent's own
  session headers (Claude Code's on ``--api messages``, the Codex CLI's on chat), so the server
  alone tells compactions from the windows; a call the trace ends with an answer finishes
  ``stop`` (``runner.ANSWER_STOPS``), so the server reads it as from a real agent (lifecycle).

``--api messages`` replays through the ``anthropic`` SDK on ``/v1/messages``, as coding agents
call; the default ``chat`` through the ``openai`` SDK.

    python -m benchmarks.agents.trace_replay \
        --traces agentinfer,mooncake=/path/conversation_trace.jsonl
    python -m benchmarks.agents.trace_replay --traces agentinfer --api messages \
        --scenarios vanilla,lifecycle,child-idle,protect,no-parents --name coding_agents
    python -m benchmarks.agents.trace_replay --traces agentinfer,project --api messages \
        --pools 0.1,0.25,0.5 --scenarios vanilla,lifecycle,agent-headers --name agent_headers
    python -m benchmarks.agents.trace_replay --traces agentinfer --api messages --scale 0.015625 \
        --model .cache/tiny-gpt-oss --blocks 160,240 --max-model-len 2048 --system-prompts \
        --scenarios vanilla,vanilla-interval,agent-headers,lifecycle --name hybrid_replay_gpt_oss
    python -m benchmarks.agents.trace_replay --quick  # CI: the synthetic trace in all 4 formats

Output: ``<out>/trace_replay[_quick].json`` and ``.md`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.agents.agent_trace import TraceConfig, generate_timed
from benchmarks.agents.peers import AGENTINFER_ARGS, agentinfer_launcher
from jiuwen_replay.compare import paired_ttft, say, simulated, summarize, tokenize
from jiuwen_replay.formats import (
    FORMATS,
    WRITERS,
    agentinfer_trace_path,
    read_trace,
    write_agentx,
    write_project,
)
from jiuwen_replay.output import named, write_outputs
from jiuwen_replay.runner import CallRecord, ReplayOptions, Target, run, windows
from jiuwen_replay.simulator import Request, working_set
from jiuwen_replay.synthetic import SyntheticConfig, generate
from jiuwen_replay.trace import Trace, TraceRequest
from vllm_affinity.testing import BLOCK_SIZE, SERVED_NAME, VLLMServer

API_KEY = "bench"
MAX_OUTPUT = 4


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    plugin: bool
    lifecycle: bool
    next_use: str = "none"  # what the hook tells the plugin of each call's end
    parents: bool = True  # the hook names each subagent's parent
    env: tuple[tuple[str, str], ...] = ()  # more plugin settings
    #: No hook: each call carries a coding agent's own session headers (``--agent-headers``)
    agent_headers: bool = False
    #: Another system's server instead of ours (``benchmarks/agents/peers.py``)
    peer: str = ""
    #: The hook runs in the client (``None``: where the plugin serves; ``False`` on the plugin:
    #: a client that tells it nothing; ``True`` on vanilla: what installing it costs there)
    hooked: bool | None = None
    #: More vLLM arguments (``vanilla-interval``: vLLM's own retention interval)
    vllm_args: tuple[str, ...] = ()


def is_hooked(scenario: Scenario) -> bool:
    if scenario.agent_headers:
        return False
    return scenario.plugin if scenario.hooked is None else scenario.hooked


NO_PREDICT = ("VLLM_AFFINITY_PREDICT_RETURN", "false")
SCENARIOS = (
    Scenario("vanilla", plugin=False, lifecycle=False),
    Scenario("vanilla-hooked", plugin=False, lifecycle=False, hooked=True),
    # a hybrid model's upstream alternative to the plugin's checkpoints: vLLM keeps the
    # sliding-window and Mamba state every 480 tokens (a multiple of 32 and of 160)
    Scenario(
        "vanilla-interval", plugin=False, lifecycle=False,
        vllm_args=("--prefix-cache-retention-interval", "480"),
    ),
    Scenario("release", plugin=True, lifecycle=False, parents=False),
    Scenario("plugin-untold", plugin=True, lifecycle=True, hooked=False),
    Scenario("lifecycle", plugin=True, lifecycle=True, next_use="finish"),
    Scenario("lifecycle-gap", plugin=True, lifecycle=True, next_use="gap"),
    Scenario(
        "child-idle", plugin=True, lifecycle=True, next_use="finish",
        env=(("VLLM_AFFINITY_CHILD_END", "idle"),),
    ),
    Scenario(
        "protect", plugin=True, lifecycle=True, next_use="finish",
        env=(("VLLM_AFFINITY_PROTECT_SHARE", "0.25"),),
    ),
    Scenario(
        "no-predict", plugin=True, lifecycle=True, next_use="finish",
        env=(NO_PREDICT,),
    ),
    Scenario("no-parents", plugin=True, lifecycle=True, next_use="finish", parents=False),
    Scenario("agent-headers", plugin=True, lifecycle=True, next_use="finish", agent_headers=True),
    Scenario(
        "agent-headers-no-predict", plugin=True, lifecycle=True, next_use="finish",
        agent_headers=True, env=(NO_PREDICT,),
    ),
    # no answer stops for AgentInfer 0.2: vLLM 0.32 ends a stop-string answer by aborting the
    # request in the engine, and AgentInfer's scheduler dies on any abort there (it expects
    # finish_requests to return (id, count) pairs); its own lifecycle learns from timing
    Scenario(
        "agentinfer", plugin=False, lifecycle=False, next_use="none", agent_headers=True,
        peer="agentinfer",
    ),
)  # fmt: skip


def render(trace: Trace, options: ReplayOptions, model: str | None) -> list[tuple[int, ...]]:
    """Every prompt's tokens, as vLLM renders them (``/tokenize``)."""
    with VLLMServer(  # a hybrid model's groups share the pool: room for each
        model=model, plugin=False, num_blocks=4097, api_key=API_KEY, max_model_len=32768
    ) as server:
        tokens = tokenize(server.root_url, options, windows(trace, options, nonce=0))
    assert tokens is not None, "the server did not tokenize"
    return tokens


def run_scenario(
    trace: Trace,
    scenario: Scenario,
    blocks: int,
    options: ReplayOptions,
    tokens: list[tuple[int, ...]],
    cores: str,
    model: str | None = None,
    calls_out: Path | None = None,
    max_model_len: int | None = None,
) -> tuple[dict[str, Any], list[CallRecord]]:
    env = {
        "VLLM_AFFINITY_LIFECYCLE": "true" if scenario.lifecycle else "false",
        **dict(scenario.env),
    }
    options = dataclasses.replace(options, next_use=scenario.next_use, parents=scenario.parents)
    launcher, extra = (agentinfer_launcher(), AGENTINFER_ARGS) if scenario.peer else (None, ())
    with VLLMServer(
        model=model, plugin=scenario.plugin, num_blocks=blocks, api_key=API_KEY, env=env,
        max_model_len=max_model_len or min((blocks - 1) * BLOCK_SIZE, 32768), cpu_cores=cores,
        launcher=launcher, extra_args=(*extra, *scenario.vllm_args),
    ) as server:  # fmt: skip
        target = Target(
            scenario.name, server.base_url,
            hooked=is_hooked(scenario),
            agent_headers=scenario.agent_headers,
        )  # fmt: skip
        cpu = server.cpu_seconds_by_process()
        result = run(trace, target, options, nonce=1)
        if calls_out is not None:
            write_calls(calls_out, result.calls)
        summary = summarize(result)
        used = {k: v - cpu[k] for k, v in server.cpu_seconds_by_process().items()}
        summary["server_cpu_s"] = round(sum(used.values()), 1)
        summary["server_cpu_s_by_process"] = {k: round(v, 1) for k, v in used.items()}
        # a peer's policy is not ours: beside it, the simulator's LRU (vanilla's)
        modelled = {**summary, "agent_headers": False} if scenario.peer else summary
        check = simulated(trace, options, result, modelled, tokens)
    if check is not None:
        summary["simulator"] = check
    say(
        f"    {scenario.name}: hit rate {summary['hit_rate']} (simulator "
        f"{(check or {}).get('hit_rate')}), computed {summary['computed_tokens']}, "
        f"TTFT p50/p90 {summary['ttft_ms_p50']}/{summary['ttft_ms_p90']} ms "
        f"(server mean {(summary.get('server') or {}).get('ttft_ms_mean')} ms, "
        f"before the wire p90 {summary['pre_send_ms_p90']} ms)"
    )
    return summary, result.calls


def write_calls(path: Path, calls: list[CallRecord]) -> None:
    """One JSON line per call (its TTFT, prompt and cached tokens, times): for analyses the
    summary does not make."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for call in calls:
            out.write(json.dumps(dataclasses.asdict(call)) + "\n")


def run_name(scenario: Scenario, round_: int) -> str:
    """A run's key in the report: the scenario's name, ``#k`` from the second round on."""
    return scenario.name if round_ == 1 else f"{scenario.name}#{round_}"


def replay_trace(trace: Trace, args: argparse.Namespace) -> dict[str, Any]:
    options = ReplayOptions(
        model=SERVED_NAME, api_key=API_KEY, scale=args.scale, speed=args.speed,
        concurrency=args.concurrency, max_output_tokens=MAX_OUTPUT, progress=not args.quiet,
        api=args.api, end_sessions=args.end_sessions, system_prompts=args.system_prompts,
    )  # fmt: skip
    say(f"{trace.format}: {trace.describe()}")
    tokens = render(trace, options, args.model)
    requests = [Request(r.session, t) for r, t in zip(trace.requests, tokens, strict=True)]
    working = working_set(requests, BLOCK_SIZE)
    longest = max(-(-(len(t) + MAX_OUTPUT) // BLOCK_SIZE) for t in tokens)
    row: dict[str, Any] = {
        "trace": trace.describe(),
        "working_set_blocks": working,
        "pools": [],
    }
    for fraction in (float(f) for f in (args.blocks or args.pools).split(",")):
        if args.blocks:  # a hybrid model's pool: every group draws from it, at its block size
            blocks, fraction = int(fraction), round(fraction / working, 3)
        else:
            blocks = max(math.ceil(fraction * working), longest + 1) + 1
        say(f"  pool {fraction}x of {working} blocks: {blocks} blocks")
        pool = {"pool": fraction, "blocks": blocks, "scenarios": {}}
        first_vanilla: list[CallRecord] | None = None
        for round_ in range(1, args.rounds + 1):
            # ABBA: every other round runs the scenarios in reverse, so the machine's drift
            # over a run favours no side
            order = scenarios(args.scenarios)
            order = order if round_ % 2 else order[::-1]
            calls: dict[str, list[CallRecord]] = {}
            for scenario in order:
                name = run_name(scenario, round_)
                calls_out = (
                    Path(args.calls_dir) / f"{trace.format}_{fraction}_{name}.jsonl"
                    if args.calls_dir
                    else None
                )
                summary, calls[scenario.name] = run_scenario(
                    trace, scenario, blocks, options, tokens, args.cores, args.model, calls_out,
                    args.max_model_len,
                )  # fmt: skip
                pool["scenarios"][name] = summary
            # per call, against this round's vanilla; a later round's vanilla against the
            # first's: the measurement's floor
            base = calls.get("vanilla")
            for scenario in order:
                name = run_name(scenario, round_)
                against = first_vanilla if scenario.name == "vanilla" else base
                if against is not None:
                    paired = paired_ttft(against, calls[scenario.name])
                    pool["scenarios"][name]["ttft_paired_vs_vanilla"] = paired
            if first_vanilla is None:
                first_vanilla = base
        row["pools"].append(pool)
    return row


def agent_trace_blocks(block_tokens: int = 32) -> Trace:
    """The project's timed agent trace (``agent_trace.generate_timed``, which the lifecycle
    figures come from) as block ids: each message is cut into blocks of ``block_tokens`` (about
    four characters a token), so equal messages at equal places give equal ids."""
    requests = []
    for call in generate_timed(TraceConfig()):
        ids: list[int] = []
        for message in call.window:
            text = json.dumps(message, sort_keys=True)
            count = max(1, round(len(text) / (4 * block_tokens)))
            ids += [hash((text, i)) & (2**62 - 1) for i in range(count)]
        requests.append(TraceRequest(call.session, call.at, tuple(ids), MAX_OUTPUT))
    return Trace("project", block_tokens, tuple(requests), "agent_trace.generate_timed")


def traces(spec: str, args: argparse.Namespace, workdir: Path) -> list[Trace]:
    out = []
    for item in spec.split(","):
        fmt, _, path = item.partition("=")
        if fmt == "project" and not path:  # the project's own trace, through its file format
            path = str(workdir / "agent_trace.jsonl")
            write_project(agent_trace_blocks(), path)
        if fmt == "agentx" and not path:  # no public AgentX trace here: the synthetic one
            path = str(workdir / "synthetic.agentx.jsonl")
            write_agentx(generate(SyntheticConfig(sessions=8, calls_per_session=24)), path)
        if fmt == "synthetic":  # the project's own trace, written and read in every format
            trace = generate(SyntheticConfig(sessions=3, calls_per_session=8))
            for name in FORMATS:
                WRITERS[name](trace, workdir / f"synthetic.{name}.jsonl")
                out.append(read_trace(workdir / f"synthetic.{name}.jsonl", name))
            continue
        if fmt not in FORMATS:
            raise SystemExit(f"unknown format {fmt!r}; expected one of {FORMATS}")
        trace = read_trace(path or agentinfer_trace_path(), fmt)
        trace = trace.first_sessions(args.sessions) if args.sessions else trace
        trace = trace.head(args.limit) if args.limit else trace
        out.append(trace.copies(args.copies, args.stagger))
    return out


def scenarios(names: str) -> list[Scenario]:
    """The scenarios named (comma-separated), in the order they run in."""
    return named(SCENARIOS, names)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Scale {result['scale']:g}, speed {result['speed'] or 'one call at a time'}, "
        f"outputs capped at {MAX_OUTPUT} tokens, API {result.get('api', 'chat')}"
        + (
            ", the hook ends each session after its last call."
            if result.get("end_sessions")
            else "."
        ),
        "",
        "| trace | calls | pool | scenario | hit rate | simulator | infinite / Belady "
        "| computed tokens | vs vanilla | TTFT p50 / p90 / p99 (ms) | calls/s | releases |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["traces"]:
        t = row["trace"]
        for pool in row["pools"]:
            base = pool["scenarios"].get("vanilla", {}).get("computed_tokens") or 0
            for name, s in pool["scenarios"].items():
                sim = s.get("simulator") or {}
                rel = s.get("releases") or {}
                ratio = f"{s['computed_tokens'] / base:.3f}" if base else "-"
                lines.append(
                    f"| {t['format']} | {t['requests']} | {pool['pool']}x | {name} "
                    f"| {s['hit_rate']:.3f} | {sim.get('hit_rate', float('nan')):.3f} "
                    f"| {sim.get('infinite', float('nan')):.3f} / "
                    f"{sim.get('belady', float('nan')):.3f} "
                    f"| {s['computed_tokens']:,} | {ratio} "
                    f"| {s['ttft_ms_p50']:.0f} / {s['ttft_ms_p90']:.0f} / "
                    f"{s['ttft_ms_p99']:.0f} | {s.get('calls_per_s') or '-'} "
                    f"| {rel.get('total', '-')} |"
                )
    return "\n".join(lines) + "\n" + latency_markdown(result)


def latency_markdown(result: dict[str, Any]) -> str:
    """Where each run's TTFT went (``jiuwen_replay/latency.py``): the client's mean against
    vLLM's own (queue and prefill), the client's work before the wire, its event loop's lag."""
    lines = [
        "",
        "Where the TTFT goes (ms; the server's figures are vLLM's own histograms; per call vs "
        "vanilla: the client's TTFT less vanilla's, over the calls that computed the same "
        "tokens on both sides, against the same round's vanilla, a later vanilla against the "
        "first):",
        "",
        "| pool | scenario | client TTFT mean / p90 | server TTFT mean | queue mean "
        "| prefill mean | server TTFT > 0.1 / 0.25 s | before the wire p50 / p90 "
        "| client loop lag p99 / total (s) | client GC s (gen 2: s, count; longest ms) "
        "| CPU s: client / server (API / engine / worker) "
        "| per call vs vanilla: median / mean (calls) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["traces"]:
        for pool in row["pools"]:
            for name, s in pool["scenarios"].items():
                srv = s.get("server") or {}
                paired = s.get("ttft_paired_vs_vanilla") or {}
                lines.append(
                    f"| {pool['pool']}x | {name} | {_f(s.get('ttft_ms_mean'))} / "
                    f"{_f(s.get('ttft_ms_p90'))} | {_f(srv.get('ttft_ms_mean'))} "
                    f"| {_f(srv.get('queue_ms_mean'))} | {_f(srv.get('prefill_ms_mean'))} "
                    f"| {_pct(srv.get('ttft_over_0.1s'))} / {_pct(srv.get('ttft_over_0.25s'))} "
                    f"| {_f(s.get('pre_send_ms_p50'), '.1f')} / "
                    f"{_f(s.get('pre_send_ms_p90'), '.1f')} "
                    f"| {_f(s.get('loop_lag_ms_p99'), '.1f')} / "
                    f"{_f(s.get('loop_lag_s_total'), '.1f')} "
                    f"| {_gc(s.get('client_gc'))} "
                    f"| {_f(s.get('client_cpu_s'), '.1f')} / {_f(s.get('server_cpu_s'), '.1f')} "
                    f"({_by_process(s.get('server_cpu_s_by_process'))}) "
                    f"| {_f(paired.get('median_ms'), '+.1f')} / "
                    f"{_f(paired.get('mean_ms'), '+.1f')} ({paired.get('calls', '-')}) |"
                )
    return "\n".join(lines) + "\n"


def _gc(pauses: dict[str, Any] | None) -> str:
    if not pauses:
        return "-"
    return (
        f"{pauses['s']:.2f} ({pauses['gen2_s']:.2f}, {pauses['gen2_count']}; "
        f"{pauses['longest_ms']:.0f})"
    )


def _by_process(cpu: dict[str, float] | None) -> str:
    """The server's CPU seconds as API server / engine core / worker."""
    return "-" if not cpu else " / ".join(f"{cpu[k]:.1f}" for k in ("api", "engine", "worker"))


def _f(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="agentinfer", help="format=path,... ")
    parser.add_argument("--pools", default="0.25,0.5,1.0")
    parser.add_argument("--scale", type=float, default=1 / 16)
    parser.add_argument("--speed", type=float, default=0.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--limit", type=int, help="the first N calls of each trace")
    parser.add_argument(
        "--sessions", type=int, help="the first N top-level sessions (with their subagents)"
    )
    parser.add_argument(
        "--copies", type=int, default=1,
        help="N copies of every session, content of their own (tenants: Trace.copies)",
    )  # fmt: skip
    parser.add_argument("--stagger", type=float, default=0.0, help="trace seconds between copies")
    parser.add_argument("--cores", default="0", help="the model worker's cores")
    parser.add_argument(
        "--model", help="the model every server serves (default: the small local test model; "
        "on a GPU machine a real one: benchmarks/agents/compare_all.py)",
    )  # fmt: skip
    parser.add_argument(
        "--blocks", help="pool sizes in blocks instead of --pools (a hybrid model's: every "
        "group draws from one pool; the pool column then gives blocks / the working set)",
    )  # fmt: skip
    parser.add_argument(
        "--max-model-len", type=int, help="vLLM's (default: what the pool holds, at most 32k)"
    )
    parser.add_argument("--api", choices=("chat", "messages"), default="chat")
    parser.add_argument(
        "--system-prompts", action="store_true",
        help="each actor's instructions as a system prompt (the agentinfer trace says which)",
    )  # fmt: skip
    parser.add_argument(
        "--end-sessions", action="store_true",
        help="the hook ends each session after its last call (jiuwen_hooks.end_session)",
    )  # fmt: skip
    parser.add_argument(
        "--scenarios", default="vanilla,release,lifecycle,lifecycle-gap",
        help="which, in the order they run (reversed every other round); the others are "
        "compared with vanilla",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="run the scenarios this many times, alternating (TTFT beside the machine's noise)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="CI: synthetic, 4 formats, 0.5x")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--calls-dir", help="also write every call's record here (JSON lines)")
    parser.add_argument("--name", help="file stem (default trace_replay[_quick])")
    args = parser.parse_args(argv)
    if args.quick:
        args.traces, args.pools, args.scale = "synthetic", "0.5", 0.25
    with tempfile.TemporaryDirectory() as workdir:
        loaded = traces(args.traces, args, Path(workdir))
        result = {
            "scale": args.scale,
            "speed": args.speed,
            "api": args.api,
            "end_sessions": args.end_sessions,
            "traces": [replay_trace(t, args) for t in loaded],
        }
    stem = args.name or ("trace_replay_quick" if args.quick else "trace_replay")
    command = " ".join(
        ["python -m benchmarks.agents.trace_replay", *(argv if argv is not None else sys.argv[1:])]
    )
    write_outputs(args.out, stem, result, f"Command: `{command}`\n\n{markdown(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
