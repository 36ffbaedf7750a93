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

Bounded: at most ``max_sessions`` sessions, least recently called first out.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from .hinted_rate import HintedRate


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
        self._last[session] = self.now
        self.now += 1
        while len(self._last) > self.max_sessions:
            old, _ = self._last.popitem(last=False)
            self._gap.pop(old, None)
            self._hinted.pop(old, None)

    def due(self, session: str) -> float:
        """When ``session`` is expected to call again (``-inf`` when it is not known: nothing
        says it is back late)."""
        last = self._last.get(session)
        if last is None:
            return float("-inf")
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
