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
an overdue session due again after its last absence, or never overdue; the median of its last
absences (56% of the LRU → Belady gap closed at 0.1x on the Claude Code trace, against 65%).
On a strict cycle of sessions this is Belady's choice.

A break is not a rhythm: an absence over ``BREAK`` times the longest of the session's four
before it (a user back from lunch; on a test server, the same trace replayed under the same
names) predicts that bound, not another break. Without it a session back from a break was
evicted first while its tool loop resumed: a real replay after two others computed 1,600
prompt tokens against vanilla's 1,536; with it, 1,536, and the simulator's gap is unchanged.

The picker swaps LRU's victim for the chosen session's block when that session is due later or
as late (``swap_for``): among sessions due together the one that called last goes, where LRU
would take the one that called first. Two sessions that are both gone are left in LRU's order.

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
#: The absences remembered per session, the last one included.
ABSENCES = 5
#: An absence longer than this many times the longest of the session's earlier ones is a
#: break, not its rhythm: its next absence is taken as that bound.
BREAK = 4


def _next_absence(gaps: tuple[int, ...]) -> int:
    """The session's last absence, unless it was a break (``BREAK``)."""
    *earlier, last = gaps
    return min(last, BREAK * max(earlier)) if earlier else last


def swap_for(chosen_due: float, spared_due: float) -> bool:
    """Whether to evict the chosen session's block instead of LRU's victim, whose session is
    due ``spared_due``: when the chosen one is due later, or as late (among sessions due back
    together, the one that called last goes first: LRU would take the one that called first,
    on a cycle the next to call); never between two sessions that are both gone (``inf``),
    where LRU's order is as good as any."""
    return chosen_due > spared_due or (chosen_due == spared_due != float("inf"))


@dataclass(slots=True)
class ReturnPredictor:
    """Per session: its last call and its last absence, on the engine's request clock."""

    max_sessions: int = 100_000
    now: int = 0
    _last: OrderedDict[str, int] = field(default_factory=OrderedDict)  # oldest call first
    _gaps: dict[str, tuple[int, ...]] = field(default_factory=dict)  # its last absences
    _prior: int = 1
    _hinted: dict[str, float] = field(default_factory=dict)  # the last call's hint, seconds
    _requests: HintedRate = field(default_factory=HintedRate)  # requests per hinted second
    _hinted_run: dict[str, int] = field(default_factory=dict)  # hinted calls in a row (0 too)
    _silent: set[str] = field(default_factory=set)  # fell silent after SILENT_AFTER hints
    #: Dues and the candidates' order worked out since the last call or forget (the picker
    #: asks once per pop, and several pops may come between two calls).
    _dues: dict[str, float] = field(default_factory=dict)
    _order: tuple[int, list[str]] | None = None

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")

    def __len__(self) -> int:
        return len(self._last)

    def called(self, session: str, next_use: float | None = None) -> None:
        """A request of ``session`` reached the engine (``next_use``: its hint, seconds): the
        clock ticks and its absence is learned."""
        self._changed()
        last = self._last.pop(session, None)
        hinted = self._hinted.pop(session, None)
        if last is not None:
            gap = self._prior = self.now - last
            self._gaps[session] = (*self._gaps.get(session, ())[1 - ABSENCES :], gap)
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
        self._changed()
        self._last.pop(session, None)
        self._gaps.pop(session, None)
        self._hinted.pop(session, None)
        self._hinted_run.pop(session, None)
        self._silent.discard(session)

    def _changed(self) -> None:
        self._dues.clear()
        self._order = None

    def hinted(self, session: str) -> bool:
        """Whether ``session``'s last call said when it is back (a hint of more than 0 s)."""
        return session in self._hinted

    def due(self, session: str) -> float:
        """When ``session`` is expected to call again (``inf`` when it fell silent or is not
        known: not at all, so its blocks stay in LRU's order, ``swap_for``)."""
        known = self._dues.get(session)
        if known is not None:
            return known
        due = self._dues[session] = self._due(session)
        return due

    def _due(self, session: str) -> float:
        last = self._last.get(session)
        if last is None or session in self._silent:
            return float("inf")
        hinted = self._hinted.get(session)
        ticks = None if hinted is None else self._requests.ticks(hinted)
        if ticks is None:
            gaps = self._gaps.get(session)
            ticks = self._prior if not gaps else _next_absence(gaps)
        due = last + ticks
        return due if due >= self.now else self.now + (self.now - last)

    def back_last_first(self, limit: int = 64) -> list[str]:
        """Candidates to evict from, the one due back last first: the ``limit`` sessions that
        called last (a tool loop's just-finished call is due back last among its peers) and
        the ``limit`` that called least recently (the most overdue); bounded work per pick,
        whatever the number of sessions."""
        if self._order is not None and self._order[0] == limit:
            return self._order[1]
        recent = list(itertools.islice(reversed(self._last), limit))
        oldest = itertools.islice(self._last, min(limit, max(0, len(self._last) - limit)))
        order = sorted([*recent, *oldest], key=self.due, reverse=True)
        self._order = (limit, order)
        return order
