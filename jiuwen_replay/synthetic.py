"""A small agent trace made here: for a quick run, the tests, and a sample of the project format.

Leads share one system prompt and their subagents another (each request says how many leading
blocks are its instructions); each call appends a tool result (a
few blocks) to its session's prompt, and a session compacts (keeps its system prompt, then one
summary block) once its prompt passes ``compact_after`` blocks. Calls of a session are
``tool_gap`` seconds apart; after each burst of ``burst`` calls it waits ``think_gap`` seconds
(its user). Every few lead calls a subagent runs its own short task, then ends.
``FULL_SIZE`` is the same shape at coding agents' real size.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from .trace import Trace, TraceRequest


@dataclass(frozen=True)
class SyntheticConfig:
    sessions: int = 4
    calls_per_session: int = 12
    burst: int = 4
    system_blocks: int = 4
    tool_blocks: tuple[int, int] = (1, 3)
    compact_after: int = 16
    subagent_every: int = 6
    subagent_calls: int = 3
    tool_gap: float = 1.0
    think_gap: float = 20.0
    block_tokens: int = 128
    output_tokens: int = 64
    seed: int = 0


#: Coding agents at full size, as vLLM's agent study and Claude Code's own prompts put them: 43
#: calls a session (the study's median), ~20k tokens of instructions (Claude Code keeps 15-30k),
#: ~2.9k tokens of tool result a call, so a window reaches ~140k tokens and compacts past 128k;
#: 8 calls a subagent brief, every 10 lead calls; 128-token blocks.
FULL_SIZE = SyntheticConfig(
    sessions=16, calls_per_session=43, burst=6, system_blocks=160, tool_blocks=(6, 40),
    compact_after=1000, subagent_every=10, subagent_calls=8, tool_gap=2.0, think_gap=30.0,
    output_tokens=400,
)  # fmt: skip


def generate(config: SyntheticConfig = SyntheticConfig()) -> Trace:
    rng = random.Random(config.seed)
    ids = itertools.count()
    lead_system = tuple(next(ids) for _ in range(config.system_blocks))
    sub_system = tuple(next(ids) for _ in range(config.system_blocks // 2 or 1))
    requests: list[TraceRequest] = []

    def grow(blocks: tuple[int, ...], system: tuple[int, ...]) -> tuple[int, ...]:
        if len(blocks) > config.compact_after:
            return (*system, next(ids))
        return blocks + tuple(next(ids) for _ in range(rng.randint(*config.tool_blocks)))

    for s in range(config.sessions):
        lead = f"lead{s}"
        at = s * config.tool_gap / config.sessions + rng.uniform(0, config.tool_gap)
        blocks = (*lead_system, next(ids))
        subagents = 0
        for call in range(config.calls_per_session):
            requests.append(
                TraceRequest(
                    lead, round(at, 3), blocks, config.output_tokens,
                    instructions=len(lead_system),
                )
            )  # fmt: skip
            if call and call % config.subagent_every == 0:
                name = f"{lead}/sub{subagents}"
                subagents += 1
                sub_at, sub_blocks = at + 0.2, (*sub_system, next(ids))
                for _ in range(config.subagent_calls):
                    requests.append(
                        TraceRequest(
                            name,
                            round(sub_at, 3),
                            sub_blocks,
                            config.output_tokens,
                            parent=lead,
                            instructions=len(sub_system),
                        )
                    )
                    sub_at += config.tool_gap
                    sub_blocks = grow(sub_blocks, sub_system)
                at = sub_at
            last_of_burst = (call + 1) % config.burst == 0
            at += config.think_gap if last_of_burst else config.tool_gap
            blocks = grow(blocks, lead_system)
    requests.sort(key=lambda r: r.at)
    return Trace("project", config.block_tokens, tuple(requests), "synthetic")
