"""A candidate for the engine (pure; measured in the simulator only, not wired into the
plugin): which session is back last, learned online, and whether that beats LRU here.

At tight pools the sessions of an agent fleet call in turn, and LRU evicts the session that
calls next: its blocks are the oldest (issue 36: at 0.1x of the working set, tool loops and
sessions back from their user are most of what Belady keeps and LRU loses). The candidate: where
LRU is about to evict a block that one session alone holds, evict instead from the session
predicted back *last* (the simulator's ``lifecycle+return``; in the engine it would be a picker
the free-block queue calls before it pops a live block).

**The prediction.** The clock counts the requests the engine has seen. A session is expected
back its last absence after its last call; one that is overdue, as long again as it has been
away (the longer a session stays away, the longer it is likely to stay). A session with no
absence yet takes the last absence of any session. Other forms were worse in the simulator:
the overdue session due again after its last absence, or never overdue at all.

**The guard: never worse than LRU.** Every choice (acted on or not) is noted as a bet: the
chosen session ``x`` is back after the session LRU would have evicted, ``y``. The bet is won
when ``y`` calls first and lost when ``x`` does. The picker acts only while the last ``window``
settled bets hold more wins than losses; bets are noted (and settled) when it does not act too,
so it starts acting, and stops, on evidence alone. (On the Claude Code trace the bets come out
about even, and the guard gives back most of the gain: ``docs/decisions.md``.)

Bounded: at most ``max_sessions`` sessions and ``max_bets`` unsettled bets (oldest first out).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class ReturnPredictor:
    """Per session: its last call and its last absence, on the engine's request clock."""

    max_sessions: int = 100_000
    max_bets: int = 4096
    #: Settled bets the guard looks at.
    window: int = 32
    now: int = 0
    _last: OrderedDict[str, int] = field(default_factory=OrderedDict)  # oldest call first
    _gap: dict[str, int] = field(default_factory=dict)
    _prior: int | None = None
    _bets: OrderedDict[tuple[str, str], None] = field(default_factory=OrderedDict)
    _bets_of: dict[str, set[tuple[str, str]]] = field(default_factory=dict)
    _settled: deque[bool] = field(default_factory=deque)
    won: int = 0
    lost: int = 0

    def __post_init__(self) -> None:
        if self.max_sessions < 1 or self.max_bets < 1 or self.window < 1:
            raise ValueError("max_sessions, max_bets and window must be at least 1")

    def __len__(self) -> int:
        return len(self._last)

    # -- the clock and the sessions -------------------------------------------------------
    def called(self, session: str) -> None:
        """A request of ``session`` reached the engine: the clock ticks, its absence is learned
        and the bets it is in are settled."""
        last = self._last.pop(session, None)
        if last is not None:
            self._gap[session] = self._prior = self.now - last
        self._last[session] = self.now
        self.now += 1
        for bet in self._bets_of.pop(session, ()):
            if bet not in self._bets:
                continue
            del self._bets[bet]
            chosen, spared = bet
            self._settle(won=session == spared)
            self._unlink(bet, chosen if session == spared else spared)
        while len(self._last) > self.max_sessions:
            old, _ = self._last.popitem(last=False)
            self._gap.pop(old, None)

    def due(self, session: str) -> float:
        """When ``session`` is expected to call again (``inf`` when it never called)."""
        last = self._last.get(session)
        if last is None:
            return float("inf")
        gap = self._gap.get(session, self._prior if self._prior is not None else 1)
        due = last + gap
        return due if due >= self.now else self.now + (self.now - last)

    def latest_first(self) -> Iterable[str]:
        """Sessions from the most recent call back (the likeliest to be due last)."""
        return reversed(self._last)

    def back_last(self, candidates: Iterable[str], usable: Callable[[str], bool]) -> str | None:
        """The candidate due last among those ``usable`` says have something to give."""
        best, best_due = None, float("-inf")
        for session in candidates:
            due = self.due(session)
            if due > best_due and usable(session):
                best, best_due = session, due
        return best

    # -- the guard --------------------------------------------------------------------------
    def trusted(self) -> bool:
        """Whether choosing by prediction has beaten LRU's choice in the recent bets."""
        won = sum(self._settled)
        return won > len(self._settled) - won

    def bet(self, chosen: str, spared: str) -> None:
        """Note that ``chosen`` is predicted back after ``spared`` (LRU's victim)."""
        if chosen == spared:
            return
        key = (chosen, spared)
        if key in self._bets:
            return
        self._bets[key] = None
        self._bets_of.setdefault(chosen, set()).add(key)
        self._bets_of.setdefault(spared, set()).add(key)
        while len(self._bets) > self.max_bets:
            old, _ = self._bets.popitem(last=False)
            for name in old:
                self._unlink(old, name)

    def _unlink(self, bet: tuple[str, str], session: str) -> None:
        peers = self._bets_of.get(session)
        if peers is not None:
            peers.discard(bet)
            if not peers:
                del self._bets_of[session]

    def _settle(self, won: bool) -> None:
        self._settled.append(won)
        if won:
            self.won += 1
        else:
            self.lost += 1
        while len(self._settled) > self.window:
            self._settled.popleft()
