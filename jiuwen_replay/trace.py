"""The one trace model every format is read into: who sends which blocks of prompt when.

A request's prompt is a sequence of *block ids*: two requests whose ids agree up to position k
share the first k blocks of prompt, exactly (equal id, equal content). That is all prefix caching
and the release see, so it is all a replay needs: prompts are made from the ids
(``prompts.py``), the simulator hashes the rendered tokens, and nothing of the original text is
kept or needed.

Pure: no I/O here (the readers are in ``formats.py``).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

Transition = Literal["first", "append", "same", "rewrite"]


@dataclass(frozen=True)
class TraceRequest:
    """One model call of a trace."""

    #: The session (one agent's context: a lead, or a subagent of its own).
    session: str
    #: Seconds from the start of the trace.
    at: float
    #: Block ids of the prompt, one per ``Trace.block_tokens`` tokens.
    blocks: tuple[int, ...]
    #: Tokens the call generated in the trace.
    output_tokens: int
    #: The session this one works for (a subagent's lead), when the trace says so.
    parent: str | None = None
    #: Prompt tokens as recorded (the blocks may round them up to a whole block).
    input_tokens: int | None = None
    #: How many leading blocks are the actor's instructions (its system prompt), where the
    #: trace says (0: not known): a replay with ``system_prompts`` sends them as one.
    instructions: int = 0


@dataclass(frozen=True)
class Trace:
    """Requests in time order, with the block size their ids stand for."""

    format: str
    block_tokens: int
    requests: tuple[TraceRequest, ...]
    source: str = ""
    #: What a reader inferred or dropped (rows skipped, sessions inferred, ...).
    notes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")
        if any(b.at < a.at for a, b in zip(self.requests, self.requests[1:], strict=False)):
            raise ValueError("trace requests must be in time order")

    def sessions(self) -> list[str]:
        return list(dict.fromkeys(r.session for r in self.requests))

    def describe(self) -> dict[str, Any]:
        """Counts a reader of the results wants before any figure."""
        kinds = Counter(transitions(self.requests))
        parents = {r.session: r.parent for r in self.requests}
        tokens = [len(r.blocks) * self.block_tokens for r in self.requests]
        return {
            "format": self.format,
            "source": self.source,
            "requests": len(self.requests),
            "sessions": len(parents),
            "subagents": sum(p is not None for p in parents.values()),
            "block_tokens": self.block_tokens,
            "prompt_tokens_mean": round(sum(tokens) / len(tokens)) if tokens else 0,
            "prompt_tokens_max": max(tokens, default=0),
            "duration_s": round(self.requests[-1].at - self.requests[0].at, 1)
            if self.requests
            else 0.0,
            "transitions": dict(sorted(kinds.items())),
            **({"notes": self.notes} if self.notes else {}),
        }

    def tagged(self, tag: str) -> Trace:
        """The same requests, each session (and parent) named ``<session>#<tag>``: one run's
        sessions, which a server that saw an earlier run of the trace does not take for that
        run's sessions come back after a break (their content differs too: the run's nonce)."""
        requests = tuple(
            replace(
                r,
                session=f"{r.session}#{tag}",
                parent=None if r.parent is None else f"{r.parent}#{tag}",
            )
            for r in self.requests
        )
        return Trace(self.format, self.block_tokens, requests, self.source, self.notes)

    def head(self, limit: int) -> Trace:
        """The first ``limit`` requests (a shorter run of the same trace)."""
        notes = {**self.notes, "first_calls_of": len(self.requests)}  # notes: the whole file
        return Trace(self.format, self.block_tokens, self.requests[:limit], self.source, notes)

    def first_sessions(self, count: int) -> Trace:
        """The requests of the first ``count`` top-level sessions (in order of their first
        request) and of their subagents: a smaller run of whole agent sessions."""
        if count < 1:
            raise ValueError(f"sessions must be at least 1, got {count}")
        roots: list[str] = []
        for r in self.requests:
            root = r.parent or r.session
            if root not in roots:
                roots.append(root)
        kept = set(roots[:count])
        requests = tuple(r for r in self.requests if (r.parent or r.session) in kept)
        notes = {**self.notes, "first_sessions": count, "sessions_of": len(roots)}
        return Trace(self.format, self.block_tokens, requests, self.source, notes)

    def copies(self, count: int, stagger_s: float = 0.0) -> Trace:
        """``count`` copies of every session, each copy with content of its own (no block
        shared across copies: tenants) and started ``stagger_s`` seconds after the previous
        copy, merged in time order: many sessions in flight over one pool, as on a busy
        server."""
        if count < 1:
            raise ValueError(f"copies must be at least 1, got {count}")
        if count == 1:
            return self
        copied = []
        for k in range(count):
            ids: dict[int, int] = {}
            for r in self.requests:
                blocks = tuple(ids.setdefault(b, len(ids) * count + k) for b in r.blocks)
                parent = f"{r.parent}~{k}" if r.parent is not None else None
                copied.append(TraceRequest(f"{r.session}~{k}", r.at + k * stagger_s, blocks,
                                           r.output_tokens, parent, r.input_tokens,
                                           r.instructions))  # fmt: skip
        copied.sort(key=lambda r: r.at)
        notes = {**self.notes, "copies": count, "stagger_s": stagger_s}
        return Trace(self.format, self.block_tokens, tuple(copied), self.source, notes)


def transitions(requests: Iterable[TraceRequest]) -> list[Transition]:
    """How each request's prompt relates to its session's previous one."""
    previous: dict[str, tuple[int, ...]] = {}
    out: list[Transition] = []
    for request in requests:
        before = previous.get(request.session)
        previous[request.session] = request.blocks
        if before is None:
            out.append("first")
        elif request.blocks == before:
            out.append("same")
        elif request.blocks[: len(before)] == before:
            out.append("append")
        else:
            out.append("rewrite")
    return out


def next_call_gaps(requests: Sequence[TraceRequest]) -> list[float | None]:
    """Seconds from each request's start to its session's next request (None: its last)."""
    gaps: list[float | None] = [None] * len(requests)
    last: dict[str, int] = {}
    for index, request in enumerate(requests):
        if request.session in last:
            before = last[request.session]
            gaps[before] = max(0.0, request.at - requests[before].at)
        last[request.session] = index
    return gaps


#: How a replay tells the plugin what each call's end means for its session (``X-KV-Next-Use``):
#: ``none``: nothing (a replayed call ends at its token budget, which says nothing either);
#: ``gap``: the seconds until the session's next call in the trace (an agent that knows its
#: schedule); ``finish``: what a real model's finish reason would tell (see ``next_use_hints``).
SIGNALS = ("none", "gap", "finish")
#: A hint that the session is done for a long while (its turn or its task ended).
LONG_IDLE_S = 3600.0


def next_use_hints(
    requests: Sequence[TraceRequest], signal: str, idle_after: float, speed: float = 1.0
) -> list[float | None]:
    """The ``X-KV-Next-Use`` seconds each call carries (None: no header).

    ``finish`` mirrors the finish reasons a real agent's calls end with: a call followed by its
    subagents' calls before its session's next one asked for a tool (the subagent: ``tool_use``
    → live, 0); a session's last call ended its task (``end_turn`` → idle); a call whose session
    comes back only after ``idle_after`` seconds of the trace's clock waited on its user
    (``end_turn`` → idle), unless it is a subagent: it has no user, and a model ends a
    subagent's turn only with its task (a long gap there is a slow tool); any other call ran a
    tool (live)."""
    if signal not in SIGNALS:
        raise ValueError(f"unknown signal {signal!r}; expected one of {SIGNALS}")
    scale = max(speed, 1.0)
    gaps = next_call_gaps(requests)
    if signal == "none":
        return [None] * len(requests)
    if signal == "gap":
        return [None if g is None else g / scale for g in gaps]
    children: dict[str, list[int]] = {}
    following: dict[int, int] = {}
    last: dict[str, int] = {}
    for index, request in enumerate(requests):
        if request.parent is not None:
            children.setdefault(request.parent, []).append(index)
        if request.session in last:
            following[last[request.session]] = index
        last[request.session] = index
    hints: list[float | None] = []
    for index, request in enumerate(requests):
        after = following.get(index)
        if after is None:
            hints.append(LONG_IDLE_S)
            continue
        calls = children.get(request.session, [])
        waits_on_children = bisect.bisect_right(calls, index) < bisect.bisect_left(calls, after)
        gap = (requests[after].at - request.at) / scale
        user_turn = request.parent is None and not waits_on_children
        hints.append(gap if gap >= idle_after and user_turn else 0.0)
    return hints
