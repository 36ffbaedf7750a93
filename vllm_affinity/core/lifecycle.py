"""Pure core: what a finished call says about its session's next one (no vLLM import).

A session whose call ended in a tool call is back in seconds; one whose call ended with the
model's answer (``finish_reason`` ``stop``) waits for its user, often for minutes. The second
session's blocks are the better ones to reuse first, after released ones and before those of
every live session: the queue's IDLE segment (``queue.py``). Measured in the simulator first
(``benchmarks/lifecycle/lifecycle_sim.py``, policy ``lifecycle``).

An agent that knows better says so per call with ``X-KV-Next-Use: <seconds>``, the time it
expects until the session's next call once this one ends; it overrides ``finish_reason``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from jiuwen_kv_protocol.headers import NEXT_USE_HEADER as HEADER

#: ``finish_reason`` values that end a session's burst: the model answered its user.
_ANSWERED = frozenset({"stop"})


class NextUseError(ValueError):
    """A malformed ``X-KV-Next-Use`` value; the message says what is wrong."""


def parse_next_use(value: str) -> float:
    """Seconds until the session's next call, from the header's value."""
    try:
        seconds = float(value.strip())
    except ValueError:
        raise NextUseError(f"{HEADER} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise NextUseError(f"{HEADER} must be a finite, non-negative number, got {value!r}")
    return seconds


#: An ``X-KV-Next-Use`` this long (seconds) says the session is done, as a model's answer does:
#: from a subagent, it ends its task (its blocks are released); a shorter one only idles it (a
#: slow tool, not the end of the task).
TASK_OVER_S = 3600.0


def ends_task(next_use: float | None) -> bool:
    """Whether an idle signal, from a subagent, ends its task: its model answered (no hint), or
    its hint says it is not back within ``TASK_OVER_S``."""
    return next_use is None or next_use >= TASK_OVER_S


def goes_idle(
    finish_reasons: Iterable[str | None], next_use: float | None, idle_after: float
) -> bool:
    """Whether a session whose call just finished should be treated as idle.

    ``next_use`` (the agent's hint) decides when given: idle when the next call is at least
    ``idle_after`` seconds away. Otherwise the call's choices decide: idle when every one was
    answered (``stop``); a tool call, a cut-off (``length``), an abort or an unknown reason
    leave the session as it is.
    """
    if next_use is not None:
        return next_use >= idle_after
    reasons = list(finish_reasons)
    return bool(reasons) and all(reason in _ANSWERED for reason in reasons)
