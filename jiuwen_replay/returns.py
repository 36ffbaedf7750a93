"""The guard tried for the predicted-return picker (``vllm_affinity/core/returns.py``), kept
for the simulator's ``lifecycle+return`` policy: it gave the gain back (``docs/decisions.md``).

Every choice (acted on or not) is noted as a bet: the chosen session ``x`` is back after the
session LRU would have evicted, ``y``. The bet is won when ``y`` calls first and lost when ``x``
does. The picker acts only while the last ``window`` settled bets hold more wins than losses;
bets are noted (and settled) when it does not act too, so it starts acting, and stops, on
evidence alone. On the Claude Code trace the bets are won about as often as they are lost,
although the choices gain. Bounded: at most ``max_bets`` unsettled bets (oldest first out).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class ReturnBets:
    """Bets of the predicted-return picker against LRU's choice."""

    max_bets: int = 4096
    #: Settled bets the guard looks at.
    window: int = 32
    _bets: OrderedDict[tuple[str, str], None] = field(default_factory=OrderedDict)
    #: Each session's open bets, in the order they were made (a dict, not a set: a set of
    #: strings iterates in an order Python's hash seed decides, and settling order matters).
    _bets_of: dict[str, dict[tuple[str, str], None]] = field(default_factory=dict)
    _settled: deque[bool] = field(default_factory=deque)
    won: int = 0
    lost: int = 0

    def __post_init__(self) -> None:
        if self.max_bets < 1 or self.window < 1:
            raise ValueError("max_bets and window must be at least 1")

    def called(self, session: str) -> None:
        """A request of ``session``: the bets it is in are settled."""
        for bet in self._bets_of.pop(session, ()):
            if bet not in self._bets:
                continue
            del self._bets[bet]
            chosen, spared = bet
            self._settle(won=session == spared)
            self._unlink(bet, chosen if session == spared else spared)

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
        self._bets_of.setdefault(chosen, {})[key] = None
        self._bets_of.setdefault(spared, {})[key] = None
        while len(self._bets) > self.max_bets:
            old, _ = self._bets.popitem(last=False)
            for name in old:
                self._unlink(old, name)

    def _unlink(self, bet: tuple[str, str], session: str) -> None:
        peers = self._bets_of.get(session)
        if peers is not None:
            peers.pop(bet, None)
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
