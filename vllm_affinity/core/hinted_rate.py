"""Pure core: how much of a clock passes per second an agent announced (no vLLM import).

An agent's ``X-KV-Next-Use`` is in seconds; the engine's clocks are not (the idle guard counts
LRU's reaches, the return predictor requests). Both learn the exchange rate the same way: per
hinted absence, the clock's ticks over the hinted seconds, and the median of the last
``HINTED_ABSENCES`` of them, any session's (a rate of the pool and its load, not of a session,
so it is known after a few absences and follows the load).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

#: How many hinted absences the rate is learned over.
HINTED_ABSENCES = 16


@dataclass(slots=True)
class HintedRate:
    """Clock ticks per hinted second, the median of the last hinted absences."""

    _per_second: deque[float] = field(default_factory=lambda: deque(maxlen=HINTED_ABSENCES))
    #: The median, kept: read for every candidate of every pick in the engine.
    rate: float | None = None

    def learn(self, ticks: float, hinted: float) -> None:
        """An absence announced as ``hinted`` seconds lasted ``ticks`` of the clock."""
        if hinted > 0:
            self._per_second.append(ticks / hinted)
            self.rate = statistics.median(self._per_second)

    def ticks(self, hinted: float) -> float | None:
        """How many ticks ``hinted`` seconds are expected to last (``None``: nothing learned)."""
        return None if self.rate is None else hinted * self.rate
