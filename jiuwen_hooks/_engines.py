"""Pure core: what the hook knows about each engine root (no I/O; the clock is injected).

    unknown      nothing learned yet: a due release goes as ``POST /release_kv_cache``
    in_request   the vllm_affinity plugin: releases ride on the chat request (``X-KV-Release``)
    post         answers the POST but advertises no in-request path (a third-party
                 implementation of the openJiuwen 0.1.16 POST contract): POSTs forever
    unsupported  answered the POST with 404/405: nothing is sent until the state expires

Each engine is probed (``GET /affinity/capabilities``) at first contact and again every ``ttl``
(a deployment may add or drop the plugin); every release answer teaches its state too. A state
stays in force until a new answer replaces it; ``unsupported`` lifts after its cool-down. A probe
that learned nothing (timed out on a busy server, 5xx) is retried soon, backing off from
``retry`` seconds up to ``ttl``: one slow answer must not send every release by POST for minutes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class EngineState(StrEnum):
    UNKNOWN = "unknown"
    IN_REQUEST = "in_request"
    POST = "post"
    UNSUPPORTED = "unsupported"


@dataclass(slots=True)
class _Entry:
    state: EngineState = EngineState.UNKNOWN
    #: Until when an ``unsupported`` state holds (the cool-down).
    expires: float = 0.0
    #: When the engine may be probed next (``inf`` while a probe is in flight).
    next_probe: float = 0.0
    #: Until when releases are not sent after a timeout or a failed connection.
    unreachable_until: float = 0.0
    #: Probes in a row that learned nothing (the retry backs off with them).
    failed_probes: int = 0


def state_from_capabilities(capabilities: Any) -> EngineState:
    """What a ``/release_kv_cache`` 200 answer or ``GET /affinity/capabilities`` says."""
    if isinstance(capabilities, dict) and capabilities.get("in_request_release") is True:
        return EngineState.IN_REQUEST
    return EngineState.POST


class EngineDirectory:
    """Engine root → learned state; thread-safe. The probe of each root is rate-limited to one
    per ``ttl`` (a failed one is retried after ``retry``, doubling); an ``unsupported`` state holds
    for ``unsupported_ttl``."""

    def __init__(
        self,
        ttl: float,
        unsupported_ttl: float,
        clock: Callable[[], float],
        retry: float = 1.0,
    ) -> None:
        self._ttl = ttl
        self._unsupported_ttl = unsupported_ttl
        self._retry = retry
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def state(self, root: str) -> EngineState:
        with self._lock:
            entry = self._entries.get(root)
            return entry.state if entry is not None else EngineState.UNKNOWN

    def learn(self, root: str, state: EngineState) -> EngineState:
        """Record what a release answer said; returns the previous state."""
        with self._lock:
            entry = self._entries.setdefault(root, _Entry())
            previous, entry.state = entry.state, state
            if state is EngineState.UNSUPPORTED:
                entry.expires = self._clock() + self._unsupported_ttl
            return previous

    def claim_probe(self, root: str) -> bool:
        """True when ``root`` is due for a probe (never probed, or ``ttl`` since the last one):
        the caller probes it and reports with ``probe_answered``."""
        now = self._clock()
        with self._lock:
            entry = self._entries.setdefault(root, _Entry())
            if now < entry.next_probe:
                return False
            entry.next_probe = float("inf")
            return True

    def probe_answered(
        self, root: str, state: EngineState | None, route_missing: bool = False
    ) -> None:
        """The probe's verdict: the capabilities it read (``state``), or that the route is
        missing (no plugin there: an in-request state is withdrawn, while a POST-only or
        unsupported state, learned from the POST itself, stays). Anything else (network error,
        timeout, 401, 5xx) changes no state and is retried after the back-off."""
        with self._lock:
            entry = self._entries.setdefault(root, _Entry())
            learned = state is not None or route_missing
            entry.failed_probes = 0 if learned else entry.failed_probes + 1
            wait = self._ttl
            if not learned:
                wait = min(self._ttl, self._retry * 2 ** min(entry.failed_probes - 1, 30))
            entry.next_probe = self._clock() + wait
            if state is not None:
                entry.state = state
            elif route_missing and entry.state is EngineState.IN_REQUEST:
                entry.state = EngineState.UNKNOWN

    def unreachable(self, root: str, seconds: float) -> None:
        """A release timed out or could not connect: send none for ``seconds``, so the agent is
        delayed by the timeout at most once per cool-down."""
        with self._lock:
            self._entries.setdefault(root, _Entry()).unreachable_until = self._clock() + seconds

    def cooling_down(self, root: str) -> str | None:
        """Why nothing is sent to ``root`` now: ``"unsupported"`` (answered 404/405) or
        ``"unreachable"`` (timed out or refused), within their cool-downs; else ``None``."""
        now = self._clock()
        with self._lock:
            entry = self._entries.get(root)
            if entry is None:
                return None
            if entry.state is EngineState.UNSUPPORTED and now < entry.expires:
                return "unsupported"
            if now < entry.unreachable_until:
                return "unreachable"
            return None

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return {root: str(entry.state) for root, entry in self._entries.items()}
