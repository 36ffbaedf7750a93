"""Pure core: whether an idle signal is worth acting on (no vLLM import).

An idle session's blocks are reused before every live session's (the IDLE segment). That pays
when the session stays away long enough that LRU would have reused its blocks anyway: they are
then taken first, and the live sessions' blocks stay. It costs when the session comes back
before LRU would have reached them: an agent driven by a script, whose "user" answers an
``end_turn`` in seconds, lost its whole context to an idle that LRU would never have evicted
(+7.7% prompt tokens computed on the first four sessions of the Claude Code trace, 0.35x pool).

How far LRU would have reached is measured, not guessed, on the pool's own clock: cached-block
evictions. When a session goes idle, the blocks ahead of it in LRU order are the cached blocks
in the queue (``cached``); it would have lost its blocks once that many were evicted. So for each
idle the guard notes the eviction count and ``cached``, and when the session calls again it
learns the ratio ``evicted while away / cached``: at least 1, the session stayed away past LRU's
reach. A session's idle is acted on when its last absence's ratio (or, for a session with none
yet, the last one of any session) is at least ``threshold``; with no history at all it is not:
an idle is acted on only once an absence has been seen to outlast LRU's reach. (Smoothing over
several absences, thresholds from 0.25 to 1.5, trusting the unknown and a prior learned only
under pressure were tried in the simulator; see docs/decisions.md.) The clock counts evictions, not
seconds, so it reads the same on a busy GPU, on CPU and in a replay that sends calls one at a
time. Bounded: at most ``max_sessions`` sessions, least recently seen first out.

An idle that comes with the agent's own word (``X-KV-Next-Use``: seconds until the session's
next call) is judged by that word first. The guard learns how many of LRU's reaches pass per
hinted second (``core/hinted_rate.py``), so a hint says how far past LRU's reach this absence
will last. The
last absence alone was a poor bet under load: with eight copies of the Claude Code trace on one
pool, 80 of the 117 idles it acted on came back before LRU would have evicted them, and the
plugin computed more than vanilla in 2 of the 20 cells of that grid, while a hint's absence in
reaches was ≥ 1 for 106 of the 141 longest hinted absences and for 2 of the 1,267 others.
The idle is acted on when the hint says at least ``HINT_SURE`` reaches, or at least
``HINT_PLAUSIBLE`` and the session's history agrees (the simulator's grids,
``docs/decisions.md``: never worse than LRU in any cell, where acting from one reach on was
worse in three). A hint of an hour or more (``lifecycle.TASK_OVER_S``) is acted on with no
evidence at all: it is the agent's word that its task is over, as it ends a subagent's; on a
replay's clock sped up 16 times the only idles were sessions' last calls, which never come
back, and waiting for evidence kept them all live.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .hinted_rate import HintedRate
from .lifecycle import TASK_OVER_S

#: A hint that says at least this many of LRU's reaches is acted on whatever the history.
HINT_SURE = 2.0
#: A hint that says at least this many is acted on where the session's history agrees.
HINT_PLAUSIBLE = 0.5


@dataclass(slots=True)
class _Away:
    evictions: int  # the pool's eviction count when the session went idle
    cached: int  # cached blocks in the queue then: LRU's reach
    next_use: float | None  # the agent's hint, seconds


@dataclass(slots=True)
class IdleGuard:
    """Learns per session how far past LRU's reach its idles lasted."""

    max_sessions: int = 100_000
    #: Idles are acted on while the expected ratio is at least this.
    threshold: float = 1.0
    _away: OrderedDict[str, _Away] = field(default_factory=OrderedDict)
    _ratio: OrderedDict[str, float] = field(default_factory=OrderedDict)
    _prior: float | None = None
    _reaches: HintedRate = field(default_factory=HintedRate)  # LRU's reaches per hinted second

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")

    def worth_idling(self, session: str, next_use: float | None = None) -> bool:
        """Whether to act on ``session``'s idle signal now (``next_use``: its hint, seconds)."""
        if next_use is not None and next_use >= TASK_OVER_S:
            return True  # "not back within the hour": the agent's word that its task is over
        ratio = self._ratio.get(session, self._prior)
        by_history = ratio is not None and ratio >= self.threshold
        reaches = None if next_use is None or next_use <= 0 else self._reaches.ticks(next_use)
        if reaches is None:
            return by_history
        sure, plausible = HINT_SURE * self.threshold, HINT_PLAUSIBLE * self.threshold
        return reaches >= sure or (reaches >= plausible and by_history)

    def went_idle(
        self, session: str, evictions: int, cached: int, next_use: float | None = None
    ) -> None:
        """``session`` signalled idle (acted on or not) when the pool had evicted ``evictions``
        cached blocks so far and held ``cached`` in its queue; ``next_use``: its hint."""
        self._away[session] = _Away(evictions, cached, next_use)
        self._away.move_to_end(session)
        while len(self._away) > self.max_sessions:
            self._away.popitem(last=False)

    def came_back(self, session: str, evictions: int) -> None:
        """``session`` called again: learn how far past LRU's reach its absence lasted."""
        away = self._away.pop(session, None)
        if away is None:
            return
        ratio = (evictions - away.evictions) / max(1, away.cached)
        self._ratio[session] = self._prior = ratio
        if away.next_use is not None:
            self._reaches.learn(ratio, away.next_use)
        self._ratio.move_to_end(session)
        while len(self._ratio) > self.max_sessions:
            self._ratio.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ratio)
