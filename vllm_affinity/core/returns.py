"""Pure core: which session is back last, learned online on the engine's request clock.

At tight pools an agent fleet's sessions call in turn, and LRU evicts the session that calls
next: its blocks are the oldest (issue 36: at 0.1x of the working set, tool loops and sessions
back from their user are most of what Belady keeps and LRU loses; ``docs/decisions.md``). Where
LRU is about to evict a block that one session alone holds, the engine evicts instead from the
session predicted back *last* (``PoolAffinity.pick``, which the free-block queue asks before it
pops live blocks; the simulator's ``lifecycle+return-unguarded``).

The prediction: the clock counts the requests the engine has seen. A session is expected back
its last absence after its last call; one that is overdue, as long again as it has been away
(the longer a session stays away, the longer it is likely to stay away). A session with no
absence yet takes the last absence of any session. Other forms were worse in the simulator:
an overdue session due again after its last absence, or never overdue. On a strict cycle of
sessions this is Belady's choice.

A call that carried the agent's hint (``X-KV-Next-Use``: seconds until its session's next
call) is due when the hint says, on the same clock: the predictor learns how many requests pass
per hinted second (``core/hinted_rate.py``), and a hinted session that breaks its word is
overdue like any other. On the Claude Code trace one call at a time, a model's finish reasons
and their hints (what the hook sends), that took the share of the LRU → Belady gap closed at
0.1x from 40% to 64% in the simulator; from the call order alone, no rule tried passed 56%
(``docs/decisions.md``).

A session that hinted each of its last ``SILENT_AFTER`` calls or more and then calls without a
hint has nothing more to say: an agent that knows its schedule sends none on a session's last
call. It is taken as not coming back (due back last of all) until it calls again. Without this
rule a session's unhinted last call lingered as a live one while sessions that had said they
would be away long were evicted before it: worse than LRU on the Claude Code trace with gap
hints and no ends (736 prompt tokens more at 0.35x); with it, in none of the 92 cells of the
simulator's never-worse grids.

Bounded: at most ``max_sessions`` sessions, least recently called first out.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from .hinted_rate import HintedRate

#: How many hinted calls in a row make a session's unhinted call read as its last.
SILENT_AFTER = 3


@dataclass(slots=True)
class ReturnPredictor:
    """Per session: its last call and its last absence, on the engine's request clock."""

    max_sessions: int = 100_000
    now: int = 0
    _last: OrderedDict[str, int] = field(default_factory=OrderedDict)  # oldest call first
    _gap: dict[str, int] = field(default_factory=dict)
    _prior: int = 1
    _hinted: dict[str, float] = field(default_factory=dict)  # the last call's hint, seconds
    _requests: HintedRate = field(default_factory=HintedRate)  # requests per hinted second
    _hinted_run: dict[str, int] = field(default_factory=dict)  # hinted calls in a row (0 too)
    _silent: set[str] = field(default_factory=set)  # fell silent after SILENT_AFTER hints

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")

    def __len__(self) -> int:
        return len(self._last)

    def called(self, session: str, next_use: float | None = None) -> None:
        """A request of ``session`` reached the engine (``next_use``: its hint, seconds): the
        clock ticks and its absence is learned."""
        last = self._last.pop(session, None)
        hinted = self._hinted.pop(session, None)
        if last is not None:
            self._gap[session] = self._prior = self.now - last
            if hinted is not None:
                self._requests.learn(self.now - last, hinted)
        if next_use is not None and next_use > 0:
            self._hinted[session] = next_use
        self._silent.discard(session)
        run = self._hinted_run.pop(session, 0)
        if next_use is not None:
            self._hinted_run[session] = run + 1
        elif run >= SILENT_AFTER:
            self._silent.add(session)
        self._last[session] = self.now
        self.now += 1
        while len(self._last) > self.max_sessions:
            self.forget(next(iter(self._last)))

    def forget(self, session: str) -> None:
        """``session`` is over (a subagent's end): what it leaves cached is its family's now
        (the start its siblings share), not a session's that could be due back."""
        self._last.pop(session, None)
        self._gap.pop(session, None)
        self._hinted.pop(session, None)
        self._hinted_run.pop(session, None)
        self._silent.discard(session)

    def due(self, session: str) -> float:
        """When ``session`` is expected to call again (``-inf`` when it is not known: nothing
        says it is back late; ``inf`` when it fell silent: not at all)."""
        last = self._last.get(session)
        if last is None:
            return float("-inf")
        if session in self._silent:
            return float("inf")
        hinted = self._hinted.get(session)
        ticks = None if hinted is None else self._requests.ticks(hinted)
        due = last + (ticks if ticks is not None else self._gap.get(session, self._prior))
        return due if due >= self.now else self.now + (self.now - last)

    def back_last_first(self, limit: int = 64) -> list[str]:
        """Candidates to evict from, the one due back last first: the ``limit`` sessions that
        called last (a tool loop's just-finished call is due back last among its peers) and
        the ``limit`` that called least recently (the most overdue); bounded work per pick,
        whatever the number of sessions."""
        recent = list(itertools.islice(reversed(self._last), limit))
        oldest = itertools.islice(self._last, min(limit, max(0, len(self._last) - limit)))
        return sorted([*recent, *oldest], key=self.due, reverse=True)
