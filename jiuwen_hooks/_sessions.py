"""Pure core: the per-session table of last-sent windows, bounded in size and idle time.

The table answers one question per model call or compressor run: "given what this session sent
last, what must be released now?". The diff and the snapshot update happen under one lock, so
concurrent callers never release the same range twice or lose a release.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._diff import Release, ReleasePolicy, Window, diff_windows, head_length


@dataclass(frozen=True, slots=True)
class ReleasePlan:
    """A release to dispatch: the previous window as sent and where its cache went stale."""

    session_id: str
    old: Window
    release: Release
    target: Any  # opaque to the core: where and how to send (see _release.EngineTarget)


@dataclass(slots=True, eq=False)
class CompressorJob:
    """A compressor's release, dispatched off the agent's path. Whoever comes first owns it: the
    background sender (``claim``) or the session's next model call, which then releases the range
    itself (the job is ``superseded``). ``done`` is set when the sender has finished."""

    reason: str = "compressor"  # the compressor's label, kept by a call that takes it over
    claimed: bool = False
    superseded: bool = False
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True, slots=True)
class Decision:
    """Result of one observation: a plan to send, a reason it was skipped, or neither.

    ``covered``: a compressor already released this range, so nothing is POSTed, but an engine
    that takes in-request hints may still get it (idempotent there; it closes the race with a
    compressor release still on the wire). ``wait_for``: that compressor release is being sent
    right now; the model call waits for it so it lands before the call allocates.
    """

    plan: ReleasePlan | None = None
    skipped: str | None = None
    covered: ReleasePlan | None = None
    wait_for: CompressorJob | None = None
    job: CompressorJob | None = None  # set by ``rewrite``: the job that carries ``plan``


NOTHING = Decision()


@dataclass(slots=True)
class _State:
    window: Window
    target: Any
    last_used: float
    #: A compressor already released the current window from this message index on.
    released_from: int | None = None
    #: The caller's own list object of the last call, to recognise it in a compressor.
    source: Any = field(default=None, repr=False)
    #: The compressor release of the current window, while it is not sent or being sent.
    job: CompressorJob | None = None


class SessionTable:
    """LRU-ordered map session id → last window sent, with a size limit and an idle TTL."""

    def __init__(
        self,
        *,
        max_sessions: int,
        idle_ttl: float,
        policy: ReleasePolicy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self._states: OrderedDict[str, _State] = OrderedDict()
        self._by_source: dict[int, str] = {}
        self._lock = threading.Lock()
        self._max = max_sessions
        self._ttl = idle_ttl
        self._policy = policy
        self._clock = clock
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._states)

    def observe(self, session_id: str, window: Window, target: Any, source: Any = None) -> Decision:
        """A model call is about to send ``window``: diff it against the last one and record it."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            state = self._states.get(session_id)
            if state is None:
                self._states[session_id] = _State(window, target, now, source=source)
                self._remember_source(session_id, None, source)
                self._evict_over_limit()
                return NOTHING
            self._states.move_to_end(session_id)
            old, released_from, job = state.window, state.released_from, state.job
            self._remember_source(session_id, state.source, source)
            state.window, state.target, state.last_used = window, target, now
            state.released_from, state.source, state.job = None, source, None
            release = diff_windows(old, window)
            if release is None:
                return NOTHING
            if (
                released_from is not None
                and release.tools_released_index is None
                and release.messages_released_index >= released_from
            ):
                if job is not None and not job.claimed:  # not sent yet: this call takes it over
                    job.superseded = True
                    return self._decide(session_id, old, release.relabel(job.reason), target)
                waiting = job if job is not None and not job.done.is_set() else None
                covered = ReleasePlan(session_id, old, release, target)
                return Decision(skipped="already_released", covered=covered, wait_for=waiting)
            return self._decide(session_id, old, release, target)

    def rewrite(
        self,
        session_id: str,
        output: Any,
        reason: str,
        canonicalise: Callable[[Window, Any], tuple[dict[str, Any], ...]] | None = None,
    ) -> Decision:
        """A compressor rewrote the session's history to ``output`` (not sent yet): release what
        the rewrite made stale, and remember it so the next model call does not release it again.
        ``canonicalise(old_window, output)`` gives the new window's messages in the old one's API
        (default: ``output`` is already canonical).
        """
        now = self._clock()
        with self._lock:
            self._expire(now)
            state = self._states.get(session_id)
            if state is None:
                return Decision(skipped="unknown_session")
            self._states.move_to_end(session_id)
            state.last_used = now
            old = state.window
            messages = canonicalise(old, output) if canonicalise else tuple(output)
            release = diff_windows(old, Window(messages, old.tools, old.api))
            if release is None:
                return NOTHING
            if (
                state.released_from is not None
                and release.messages_released_index >= state.released_from
            ):
                return Decision(skipped="already_released")
            decision = self._decide(session_id, old, release.relabel(reason), state.target)
            if decision.plan is None:
                return decision
            state.released_from = release.messages_released_index
            state.job = CompressorJob(reason)
            return Decision(plan=decision.plan, job=state.job)

    def end(self, session_id: str) -> ReleasePlan | None:
        """The agent ended the session: forget it, and release its cache after its instructions
        (the system prompt and tools, which the agent's next sessions send again: releasing
        them cost more prompt tokens than vanilla on the Claude Code trace); the engine also
        keeps the blocks another session still holds. ``None`` when the session is unknown
        (never seen, expired or evicted: nothing to release)."""
        with self._lock:
            state = self._states.pop(session_id, None)
            if state is None:
                return None
            self._remember_source(session_id, state.source, None)
        release = Release(head_length(state.window), None, "end_session")
        return ReleasePlan(session_id, state.window, release, state.target)

    def claim(self, job: CompressorJob) -> bool:
        """The background sender is about to send ``job``: False if a model call took it over."""
        with self._lock:
            if job.superseded:
                return False
            job.claimed = True
            return True

    def session_of(self, source: Any) -> str | None:
        """The session whose last model call passed exactly this list object, if any."""
        with self._lock:
            session_id = self._by_source.get(id(source))
            state = self._states.get(session_id) if session_id is not None else None
            return session_id if state is not None and state.source is source else None

    def _decide(self, session_id: str, old: Window, release: Release, target: Any) -> Decision:
        skipped = self._policy.skip_reason(release, len(old.messages))
        if skipped is not None:
            return Decision(skipped=skipped)
        return Decision(plan=ReleasePlan(session_id, old, release, target))

    def _remember_source(self, session_id: str, previous: Any, source: Any) -> None:
        if previous is not None and self._by_source.get(id(previous)) == session_id:
            del self._by_source[id(previous)]
        if source is not None:
            self._by_source[id(source)] = session_id

    def _forget(self, session_id: str, state: _State) -> None:
        self._remember_source(session_id, state.source, None)
        self.evicted += 1

    def _expire(self, now: float) -> None:
        while self._states:
            session_id, state = next(iter(self._states.items()))
            if now - state.last_used <= self._ttl:
                return
            del self._states[session_id]
            self._forget(session_id, state)

    def _evict_over_limit(self) -> None:
        while len(self._states) > self._max:
            session_id, state = self._states.popitem(last=False)
            self._forget(session_id, state)
