"""Multi-session agent traces: who sends which window when, including history rewrites.

Modelled on published coding-agent traces (see the README): agents work in *bursts* — a user
request starts a tool loop of several model calls in quick succession, then the session idles
while the user reads — many sessions are interleaved on one server, tool results dominate the
tokens, and compaction happens every few tool steps, mostly in the middle of a loop.

A trace is a list of ``Call`` (session, window, tools) in the order they reach the server. The
windows are plain OpenAI chat dicts; the assistant's tool calls are scripted, so a trace replays
identically against any server (the model's own text is never fed back).

Compaction policies (``TraceConfig.policies``, one per session, round-robin):

- ``micro``: old tool results → ``[Old tool result content cleared]`` (same message count);
- ``dialogue``: the finished middle of the window → one ``[DIALOGUE_MEMORY_BLOCK]`` message;
- ``truncate``: the oldest messages after the system prompt are dropped;
- ``full``: everything after the system prompt → one summary message.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

from vllm_affinity.testing import filler_text

POLICIES = ("micro", "dialogue", "truncate", "full")
PLACEHOLDER = "[Old tool result content cleared]"


@dataclass(frozen=True)
class TraceConfig:
    """Parameters of a trace. Token figures are for the project's small model (~2.4 tokens per
    word pair of filler)."""

    sessions: int = 10
    bursts_per_session: int = 3
    #: Tool-driven model calls per burst (published traces: 7.8 on average; fewer here so a
    #: 2-core CPU replays the benchmark in minutes).
    steps_per_burst: int = 4
    #: Filler word pairs of one tool result (tool results dominate the tokens).
    tool_result_pairs: int = 60
    user_pairs: int = 8
    system_pairs: int = 40
    #: Compact when the window holds more than this many tool results.
    compact_after_tools: int = 4
    #: How many bursts run interleaved at a time (the others idle). One: the hot session is
    #: mid-burst while the others idle, where a release pays off (see the README for 2).
    concurrent_bursts: int = 1
    policies: tuple[str, ...] = POLICIES
    seed: int = 0


@dataclass
class Call:
    session: str
    window: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    #: The policy that rewrote the window just before this call, if any.
    compaction: str | None = None
    #: How the call ends: ``tool_calls`` (a tool runs, the session returns soon), ``stop`` (the
    #: burst is over: the session waits for its user) or ``end`` (its last call: the agent ends
    #: the session, as with ``jiuwen_hooks.end_session``).
    finish: str = "tool_calls"
    #: Seconds from the start of a timed trace (``generate_timed``); 0 in an ordered trace.
    at: float = 0.0


@dataclass(frozen=True)
class Timing:
    """Seconds between a session's calls in a timed trace, drawn from log-normal distributions
    (median, and sigma of the log): agents' tool calls take seconds, a user's reply takes tens
    of seconds to minutes. The defaults are assumptions, not fitted to a published trace: a
    tool median of 2 s is the order of a file read, a search or a short test run (Continuum,
    2025, pins KV for such tool calls); a user median of 30 s with a heavy tail is the order of
    reading an answer and typing the next request. Change them to fit your agents."""

    #: A model call's own time (prefill plus a short answer).
    model_seconds: float = 1.0
    tool_median: float = 2.0
    tool_sigma: float = 1.0
    think_median: float = 30.0
    think_sigma: float = 1.0
    #: Sessions start uniformly within this many seconds.
    start_spread: float = 60.0


@dataclass
class _Session:
    name: str
    policy: str
    window: list[dict[str, Any]]
    rng: random.Random
    steps: int = 0
    bursts_left: int = 0
    summaries: int = field(default=0)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
        },
    }
    for name in ("read_file", "search", "run_tests")
]


def _compact(session: _Session, config: TraceConfig) -> str | None:
    window = session.window
    tool_indices = [i for i, m in enumerate(window) if m["role"] == "tool"]
    live = [i for i in tool_indices if window[i]["content"] != PLACEHOLDER]
    if len(live) <= config.compact_after_tools:
        return None
    policy = session.policy
    if policy == "micro":
        for i in live[:-2]:
            window[i] = {**window[i], "content": PLACEHOLDER}
    elif policy == "dialogue":
        start, end = 2, max(3, len(window) - 4)
        while end < len(window) and window[end]["role"] == "tool":
            end -= 1  # keep each kept tool result with the call it answers
        session.summaries += 1
        memory = {
            "role": "user",
            "content": f"[DIALOGUE_MEMORY_BLOCK {session.summaries}] "
            + filler_text(session.rng, 12),
        }
        window[start:end] = [memory]
    elif policy == "truncate":
        del window[1 : len(window) // 2]
        while len(window) > 1 and window[1]["role"] == "tool":
            del window[1]  # never start with an orphaned tool result
    else:  # full
        session.summaries += 1
        summary = {"role": "user", "content": "Summary so far: " + filler_text(session.rng, 20)}
        window[1:] = [summary]
    return policy


def _step(session: _Session, config: TraceConfig, first_of_burst: bool) -> Call:
    rng = session.rng
    if first_of_burst:
        session.window.append({"role": "user", "content": filler_text(rng, config.user_pairs)})
    compaction = _compact(session, config)
    call = Call(session.name, [dict(m) for m in session.window], TOOLS, compaction)
    session.steps += 1
    call_id = f"call_{session.name}_{session.steps}"
    tool = TOOLS[session.steps % len(TOOLS)]["function"]["name"]
    session.window.append(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": tool,
                        "arguments": json.dumps({"arg": str(session.steps)}),
                    },
                }
            ],
        }
    )
    session.window.append(
        {
            "role": "tool",
            "tool_call_id": call_id,
            "content": filler_text(rng, config.tool_result_pairs),
        }
    )
    return call


def _sessions(config: TraceConfig) -> list[_Session]:
    system = "You are a coding agent. " + filler_text(random.Random(-1), config.system_pairs)
    return [
        _Session(
            name=f"s{i}",
            policy=config.policies[i % len(config.policies)],
            window=[{"role": "system", "content": system}],
            rng=random.Random(config.seed * 1000 + i),
            bursts_left=config.bursts_per_session,
        )
        for i in range(config.sessions)
    ]


def generate(config: TraceConfig = TraceConfig()) -> list[Call]:
    """The calls of all sessions in arrival order (deterministic for a given config)."""
    rng = random.Random(config.seed)
    sessions = _sessions(config)
    calls: list[Call] = []
    active: list[tuple[_Session, int]] = []  # (session, steps left in its burst)
    while True:
        idle = [s for s in sessions if s.bursts_left and all(s is not a for a, _ in active)]
        while len(active) < config.concurrent_bursts and idle:
            chosen = idle.pop(rng.randrange(len(idle)))
            chosen.bursts_left -= 1
            active.append((chosen, config.steps_per_burst))
        if not active:
            return calls
        index = rng.randrange(len(active))
        session, left = active[index]
        calls.append(_step(session, config, first_of_burst=left == config.steps_per_burst))
        if left == 1:
            calls[-1].finish = "stop" if session.bursts_left else "end"
        if left > 1:
            active[index] = (session, left - 1)
        else:
            active.pop(index)


def generate_timed(config: TraceConfig = TraceConfig(), timing: Timing = Timing()) -> list[Call]:
    """The same sessions (the same windows and compactions as ``generate``), each on a clock
    of its own, merged in time order: a session's next call comes one model call plus one tool
    call after the previous one inside a burst, one model call plus the user's think time after
    a burst. ``concurrent_bursts`` plays no part: as many sessions are mid-burst as the clock
    says."""
    rng = random.Random(config.seed + 7919)
    calls: list[Call] = []
    for session in _sessions(config):
        clock = rng.uniform(0, timing.start_spread)
        while session.bursts_left:
            session.bursts_left -= 1
            for step in range(config.steps_per_burst):
                call = _step(session, config, first_of_burst=step == 0)
                call.at = round(clock, 3)
                last = step == config.steps_per_burst - 1
                call.finish = "tool_calls" if not last else "stop" if session.bursts_left else "end"
                median, sigma = (
                    (timing.think_median, timing.think_sigma)
                    if last
                    else (timing.tool_median, timing.tool_sigma)
                )
                clock += timing.model_seconds + rng.lognormvariate(math.log(median), sigma)
                calls.append(call)
    calls.sort(key=lambda c: c.at)
    return calls


def describe(calls: list[Call]) -> dict[str, Any]:
    compactions: dict[str, int] = {}
    for call in calls:
        if call.compaction:
            compactions[call.compaction] = compactions.get(call.compaction, 0) + 1
    out: dict[str, Any] = {
        "calls": len(calls),
        "sessions": len({c.session for c in calls}),
        "compactions": compactions,
        "finish": {f: sum(c.finish == f for c in calls) for f in ("tool_calls", "stop", "end")},
    }
    if calls and calls[-1].at:
        out["seconds"] = calls[-1].at
    return out


if __name__ == "__main__":
    trace = generate()
    print(json.dumps(describe(trace), indent=2))
