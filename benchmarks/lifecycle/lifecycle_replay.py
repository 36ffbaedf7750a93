"""Lifecycle on real vLLM: the timed agent trace replayed on real servers, vanilla vs release vs
release + lifecycle, on the same pool, with the simulator's figure beside each.

Each scenario gets a fresh server with the same pool (``--pools``, fractions of the trace's
working set) and replays the same calls in the trace's time order:

- ``vanilla``: vLLM without the plugin, no hook (simulator policy ``lru``);
- ``release``: the plugin with ``VLLM_AFFINITY_LIFECYCLE=false``, the hook releasing in the
  request (``lru_release``);
- ``lifecycle``: the plugin as shipped (lifecycle on); the hook also ends each session after
  its last call (``jiuwen_hooks.end_session``) (``lifecycle``).

How each call ends comes from the trace (``Call.finish``): the tiny model cannot make real tool
calls, so every call tells the server with ``X-KV-Next-Use`` what an agent would know: 2 s
(the tool median) after a tool call, 30 s (the think-time median) when it waits on its user.
Every side sends the same headers; only the plugin with lifecycle on acts on them.

``--speed 0`` (default) sends one call at a time in time order, so the simulator sees exactly
the server's order; after a burst's last call every scenario pauses alike, long enough for the
lifecycle's signals to land (without it only the lifecycle scenario would wait there, and the
scenarios' TTFT would not compare: see the README).

``--speed N`` replays the trace's clock N times faster, sessions running concurrently (each
session's calls in order); the simulator then gets the order in which the calls were actually
sent, and the blocks in use by overlapping calls make the two differ.

    python -m benchmarks.lifecycle.lifecycle_replay                  # ~6 minutes
    python -m benchmarks.lifecycle.lifecycle_replay --speed 20

    python -m benchmarks.lifecycle.lifecycle_replay --trace ordered  # the agent benchmark's trace
    python -m benchmarks.lifecycle.lifecycle_replay --quick          # CI's (~3 minutes)

Output: ``<out>/lifecycle_replay[_quick][_ordered][_speed<N>].json`` and ``.md`` (default
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import math
import sys
import threading
import time
from contextlib import nullcontext
from typing import Any

import openai

import jiuwen_hooks
from benchmarks.agents.agent_bench import (
    API_KEY,
    MAX_TOKENS,
    Side,
    prefix_counters,
    say,
    stream_call,
    tokenize,
)
from benchmarks.agents.agent_trace import (
    Call,
    Timing,
    TraceConfig,
    describe,
    generate,
    generate_timed,
)
from jiuwen_kv_protocol.headers import NEXT_USE_HEADER
from jiuwen_replay.output import named, write_outputs
from jiuwen_replay.simulator import Request, simulate, working_set
from vllm_affinity.testing import BLOCK_SIZE, VLLMServer


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    plugin: bool
    lifecycle: bool
    policy: str  # the simulator's


#: The pause after a session's last call of a burst, the same in every scenario.
SETTLE_SECONDS = 0.25

SCENARIOS = (
    Scenario("vanilla", plugin=False, lifecycle=False, policy="lru"),
    Scenario("release", plugin=True, lifecycle=False, policy="lru_release"),
    Scenario("lifecycle", plugin=True, lifecycle=True, policy="lifecycle"),
)


def next_use(call: Call, timing: Timing) -> dict[str, str]:
    """What an agent would tell the server about the session's next call."""
    seconds = timing.tool_median if call.finish == "tool_calls" else timing.think_median
    return {NEXT_USE_HEADER: f"{seconds:g}"}


class Replayer:
    """One scenario's replay on one server; ``sent`` is the order the calls went out in."""

    def __init__(self, server: VLLMServer, scenario: Scenario, timing: Timing) -> None:
        self.server, self.scenario, self.timing = server, scenario, timing
        self.side = Side()
        self.sent: list[int] = []
        #: (call index, TTFT ms, prompt tokens computed), one call at a time only.
        self.per_call: list[tuple[int, float, int]] = []
        self._lock = threading.Lock()
        self._client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)

    def close(self) -> None:
        self._client.close()

    def one(self, index: int, call: Call, wait_for_signals: bool) -> None:
        with self._lock:
            self.sent.append(index)
        headers = next_use(call, self.timing)
        lifecycle = self.scenario.lifecycle
        idles = self._idles() if wait_for_signals and lifecycle and call.finish == "stop" else None
        side = self.side
        prompt, cached, timed = side.prompt_tokens, side.cached_tokens, len(side.ttft)
        with jiuwen_hooks.session(call.session) if self.scenario.plugin else nullcontext():
            stream_call(self._client, call, side, headers)
        if wait_for_signals:  # one call at a time: the side's totals moved by this call alone
            computed = side.prompt_tokens - prompt - (side.cached_tokens - cached)
            self.per_call.append((index, round(side.ttft[timed] * 1e3, 2), computed))
        settled = time.monotonic() + SETTLE_SECONDS
        if lifecycle and call.finish == "end":
            jiuwen_hooks.end_session(call.session)
        if not wait_for_signals or call.finish == "tool_calls":
            return
        # A session's burst is over. Every scenario pauses alike here (a model worker that sat
        # idle starts its next call slower), long enough for the lifecycle's signals to land.
        if lifecycle and call.finish == "end":
            jiuwen_hooks.installed().flush()  # type: ignore[union-attr]
        while idles is not None and self._idles() <= idles and time.monotonic() < settled + 10:
            time.sleep(0.02)
        time.sleep(max(0.0, settled - time.monotonic()))

    def _idles(self) -> int:
        return self.server.engine_stats().get("idles", 0)


def replay(
    server: VLLMServer, scenario: Scenario, calls: list[Call], timing: Timing, speed: float
) -> tuple[dict[str, Any], list[int]]:
    """The calls on ``server``: one at a time in time order (``speed`` 0) or on the trace's
    clock sped up ``speed`` times. Returns the summary and the order the calls were sent in."""
    hook = jiuwen_hooks.install() if scenario.plugin else None
    replayer = Replayer(server, scenario, timing)
    try:
        warm_up = Call("warm-up", [{"role": "user", "content": "hello"}], [])
        for _ in range(2):  # one-off costs (imports, template compilation; the hook's probe)
            replayer.one(-1, warm_up, wait_for_signals=False)
        if hook is not None:
            hook.flush()
        replayer.sent.clear()
        replayer.per_call.clear()
        replayer.side = Side()
        before = prefix_counters(server)
        started = time.perf_counter()
        if speed <= 0:
            for index, call in enumerate(calls):
                replayer.one(index, call, wait_for_signals=True)
                if (index + 1) % 40 == 0:
                    say(f"  {scenario.name}: {index + 1}/{len(calls)} calls")
        else:
            _concurrent(replayer, calls, speed)
        if hook is not None:
            hook.flush()
        hits, queries = prefix_counters(server)
        summary = replayer.side.summary(hits - before[0], queries - before[1])
        summary["wall_s"] = round(time.perf_counter() - started, 1)
        summary["calls"] = replayer.per_call
    finally:
        replayer.close()
        if hook is not None:
            jiuwen_hooks.uninstall()
    if scenario.plugin:
        (engine,) = server.affinity_stats()["engines"]
        summary["blocks_idled"] = engine.get("blocks_idled", 0)
        summary["released_reused"] = engine["released_reused"]
        summary["block_released"] = engine.get("blocks_moved", 0) + engine.get("blocks_pending", 0)
    return summary, replayer.sent


def _concurrent(replayer: Replayer, calls: list[Call], speed: float) -> None:
    """Each call at its time on the sped-up clock, after its session's previous call."""
    previous: dict[str, concurrent.futures.Future[None]] = {}
    start = time.monotonic()
    sessions = len({c.session for c in calls})

    def after(prior: concurrent.futures.Future[None] | None, index: int, call: Call) -> None:
        if prior is not None:
            prior.result()
        delay = start + call.at / speed - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        replayer.one(index, call, wait_for_signals=False)

    with concurrent.futures.ThreadPoolExecutor(max_workers=sessions * 2) as pool:
        for index, call in enumerate(calls):
            previous[call.session] = pool.submit(after, previous.get(call.session), index, call)
        for future in previous.values():
            future.result()


def run_pool(
    fraction: float, calls: list[Call], tokens: list[tuple[int, ...]], args: argparse.Namespace
) -> dict[str, Any]:
    hints = [float(next_use(c, Timing())[NEXT_USE_HEADER]) for c in calls]  # as sent
    requests = [
        Request(c.session, t, c.finish, c.at, hint)
        for c, t, hint in zip(calls, tokens, hints, strict=True)
    ]
    floor = -(-(max(len(t) for t in tokens) + MAX_TOKENS) // BLOCK_SIZE) + 1
    capacity = max(math.ceil(fraction * working_set(requests, BLOCK_SIZE)), floor)
    row: dict[str, Any] = {"pool": fraction, "blocks": capacity, "scenarios": {}}
    for scenario in scenarios(args.scenarios):
        say(f"pool {fraction}x ({capacity} blocks): {scenario.name} ...")
        env = {"VLLM_AFFINITY_LIFECYCLE": "true" if scenario.lifecycle else "false"}
        with VLLMServer(
            plugin=scenario.plugin, num_blocks=capacity + 1, api_key=API_KEY, env=env,
            max_model_len=min(capacity * BLOCK_SIZE, 32768), cpu_cores=args.cores,
        ) as server:  # fmt: skip
            summary, sent = replay(server, scenario, calls, Timing(), args.speed)
        in_order = [requests[i] for i in sent]
        simulated = simulate(in_order, capacity, scenario.policy, BLOCK_SIZE, MAX_TOKENS)
        summary["simulated_hit_rate"] = round(simulated["hit_rate"], 4)
        summary["sim_minus_real"] = round(simulated["hit_rate"] - summary["hit_rate"], 4)
        summary["sent_in_trace_order"] = sent == sorted(sent)
        row["scenarios"][scenario.name] = summary
        say(
            f"  {scenario.name}: hit rate {summary['hit_rate']} (simulator "
            f"{summary['simulated_hit_rate']}), TTFT p50 {summary['ttft_ms_p50']} ms, "
            f"p90 {summary['ttft_ms_p90']} ms"
        )
    return row


def scenarios(names: str) -> list[Scenario]:
    """The scenarios named (comma-separated), in the order they run in."""
    return named(SCENARIOS, names)


def markdown(result: dict[str, Any]) -> str:
    trace = result["trace"]
    lines = [
        f"{trace['kind'].capitalize()} trace: {trace['calls']} calls, "
        f"{trace['sessions']} sessions, speed {result['speed'] or 'one call at a time'}.",
        "",
        "| pool | scenario | hit rate | simulator | TTFT p50 / p90 (ms) | computed tokens |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for row in result["runs"]:
        for name, s in row["scenarios"].items():
            lines.append(
                f"| {row['pool']}x | {name} | {s['hit_rate']:.3f} | {s['simulated_hit_rate']:.3f}"
                f" | {s['ttft_ms_p50']:.0f} / {s['ttft_ms_p90']:.0f} | {s['computed_tokens']:,} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", default="0.25,0.5")
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument(
        "--quick", action="store_true",
        help="CI's run: 4 sessions of 2 bursts of 3 calls, pool 0.5x",
    )  # fmt: skip
    parser.add_argument("--speed", type=float, default=0.0)
    parser.add_argument(
        "--trace", choices=("timed", "ordered"), default="timed",
        help="ordered: the agent benchmark's trace (no clock: --speed does not apply)",
    )  # fmt: skip
    parser.add_argument("--cores", default="0", help="the model worker's cores")
    parser.add_argument(
        "--scenarios", default=",".join(s.name for s in SCENARIOS),
        help="which scenarios, in the order they run (one after another: TTFT drifts)",
    )  # fmt: skip
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    config = TraceConfig(sessions=args.sessions)
    if args.quick:
        config = TraceConfig(sessions=4, bursts_per_session=2, steps_per_burst=3)
        args.pools = "0.5"
    calls = generate_timed(config) if args.trace == "timed" else generate(config)
    if args.trace == "ordered" and args.speed:
        parser.error("--speed needs the timed trace")
    say(f"trace: {describe(calls)}")
    say("tokenising the trace with vLLM's renderer ...")
    with VLLMServer(plugin=False, num_blocks=512, api_key=API_KEY) as server:
        tokens = tokenize(server, calls)
    result: dict[str, Any] = {
        "trace": {"kind": args.trace, **describe(calls)},
        "timing": dataclasses.asdict(Timing()),
        "speed": args.speed,
        "runs": [run_pool(float(f), calls, tokens, args) for f in args.pools.split(",")],
    }
    stem = "lifecycle_replay" + ("_quick" if args.quick else "")
    stem += "_ordered" if args.trace == "ordered" else ""
    stem += f"_speed{args.speed:g}" if args.speed else ""
    write_outputs(args.out, stem, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
