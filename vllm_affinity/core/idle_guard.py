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
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Away:
    evictions: int  # the pool's eviction count when the session went idle
    cached: int  # cached blocks in the queue then: LRU's reach


@dataclass(slots=True)
class IdleGuard:
    """Learns per session how far past LRU's reach its idles lasted."""

    max_sessions: int = 100_000
    #: Idles are acted on while the expected ratio is at least this.
    threshold: float = 1.0
    _away: OrderedDict[str, _Away] = field(default_factory=OrderedDict)
    _ratio: OrderedDict[str, float] = field(default_factory=OrderedDict)
    _prior: float | None = None

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")

    def worth_idling(self, session: str) -> bool:
        """Whether to act on ``session``'s idle signal now."""
        ratio = self._ratio.get(session, self._prior)
        return ratio is not None and ratio >= self.threshold

    def went_idle(self, session: str, evictions: int, cached: int) -> None:
        """``session`` signalled idle (acted on or not) when the pool had evicted ``evictions``
        cached blocks so far and held ``cached`` in its queue."""
        self._away[session] = _Away(evictions, cached)
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
        self._ratio.move_to_end(session)
        while len(self._ratio) > self.max_sessions:
            self._ratio.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ratio)
