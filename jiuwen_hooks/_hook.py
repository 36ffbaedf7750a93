"""The installed hook: glue between the pure core (session table, diff) and the adapters (openai
patches, compressor wrappers, release client, telemetry). One instance per ``install()``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from . import _state
from ._context import current_session, resolve_session, with_session
from ._diff import ReleasePolicy, Window, canonical_tools, canonical_window
from ._options import Options
from ._patch import Patches
from ._release import EngineTarget, ReleaseClient, engine_root
from ._sessions import Decision, ReleasePlan, SessionTable
from ._telemetry import Outcome, RateLimitedWarnings, Telemetry


def _sequence(value: Any) -> list[Any] | tuple[Any, ...] | None:
    """Lists and tuples as they are; other iterables materialised once (the SDK must still get
    them); sentinels such as openai's ``omit``/``NOT_GIVEN`` and ``None`` → ``None``."""
    if isinstance(value, list | tuple):
        return value
    if value is None or isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        return None
    return list(value)


class Hook:
    """Handle returned by ``install()``: ``stats()``, ``flush()``, ``uninstall()``."""

    def __init__(self, options: Options, version: str) -> None:
        self.options = options
        self.telemetry = Telemetry(version, options.tracer_provider, options.meter_provider)
        self.table = SessionTable(
            max_sessions=options.max_sessions,
            idle_ttl=options.session_ttl,
            policy=ReleasePolicy(options.min_released_messages, options.ignore_trailing_messages),
        )
        self.client = ReleaseClient(options, self.telemetry)
        self.warnings = RateLimitedWarnings(options.warning_interval)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: set[concurrent.futures.Future[Any] | asyncio.Task[Any]] = set()
        self._lock = threading.Lock()
        self.patches: Patches | None = None  # set by install()

    # -- model calls --------------------------------------------------------------------------
    def before_call(
        self, completions: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[str, Any], ReleasePlan | None] | None:
        """Resolve the session, diff the window, inject the salt. ``None``: pass through untouched.
        Never raises: an internal error is logged and the call goes out unchanged."""
        try:
            return self._before_call(completions, kwargs)
        except Exception:
            self.telemetry.count("internal_errors")
            self.warnings.warn(
                "internal", "jiuwen_hooks: internal error; call passed through", exc_info=True
            )
            return None

    def _before_call(
        self, completions: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[str, Any], ReleasePlan | None] | None:
        session_id = resolve_session(kwargs, self.options.session_resolver)
        if session_id is None:
            return None
        raw_messages, raw_tools = kwargs.get("messages"), kwargs.get("tools")
        messages = _sequence(raw_messages)
        if messages is None:
            return None
        tools = _sequence(raw_tools)
        if messages is not raw_messages:
            kwargs = {**kwargs, "messages": messages}
        if tools is not None and tools is not raw_tools:
            kwargs = {**kwargs, "tools": tools}
        window = Window(canonical_window(messages), canonical_tools(tools))
        target = self._target(completions, kwargs.get("model"))
        source = messages if isinstance(messages, list) else None
        decision = self.table.observe(session_id, window, target, source)
        self.telemetry.count("calls.tracked")
        plan = self._plan(decision)
        if self.options.inject_session:
            kwargs = with_session(kwargs, session_id, self.options.cache_sharing)
        return kwargs, plan

    def _target(self, completions: Any, model: Any) -> EngineTarget:
        client = getattr(completions, "_client", None)
        url = self.options.release_url
        if url is None:
            base_url = str(getattr(client, "base_url", "") or "")
            url = engine_root(base_url) + self.options.release_path
        api_key = getattr(client, "api_key", None)
        return EngineTarget(url, api_key if isinstance(api_key, str) else None, str(model))

    def _plan(self, decision: Decision) -> ReleasePlan | None:
        if decision.skipped is not None:
            self.telemetry.record_skip(decision.skipped)
        return decision.plan

    # -- compressors --------------------------------------------------------------------------
    def after_compress(self, label: str, messages_in: Any, result: Any) -> ReleasePlan | None:
        """A compressor returned: diff its output against the last window sent. Never raises."""
        try:
            output = result if isinstance(result, list | tuple) else messages_in
            if output is None:
                return None
            session_id = current_session() or self.table.session_of(messages_in)
            if session_id is None:
                self.telemetry.count("compressor.untracked")
                return None
            self.telemetry.count("compressor.runs")
            decision = self.table.rewrite(
                session_id, canonical_window(output), f"compressor:{label}"
            )
            return self._plan(decision)
        except Exception:
            self.telemetry.count("internal_errors")
            self.warnings.warn(
                "internal", "jiuwen_hooks: internal error in compressor hook", exc_info=True
            )
            return None

    # -- dispatch -----------------------------------------------------------------------------
    def dispatch(self, plan: ReleasePlan) -> Outcome | None:
        """Send from synchronous code: inline (default) or on a background thread."""
        if self.options.dispatch == "inline":
            return self._guarded(plan)
        ctx = contextvars.copy_context()
        future = self._background().submit(ctx.run, self._guarded, plan)
        self._track(future)
        return None

    async def adispatch(self, plan: ReleasePlan) -> Outcome | None:
        """Send from async code: awaited inline (default) or as a background task."""
        if self.options.dispatch == "inline":
            return await self._aguarded(plan)
        task = asyncio.get_running_loop().create_task(self._aguarded(plan))
        self._track(task)
        return None

    def flush(self, timeout: float | None = 10.0) -> None:
        """Wait for background releases started from threads (async tasks: ``await aflush()``)."""
        with self._lock:
            futures = [f for f in self._pending if isinstance(f, concurrent.futures.Future)]
        concurrent.futures.wait(futures, timeout=timeout)

    async def aflush(self) -> None:
        with self._lock:
            tasks = [t for t in self._pending if isinstance(t, asyncio.Task)]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.flush()

    def _guarded(self, plan: ReleasePlan) -> Outcome | None:
        try:
            return self.client.send(plan)
        except Exception:  # ReleaseClient already catches transport errors; this is a backstop
            self.telemetry.count("internal_errors")
            self.warnings.warn("internal", "jiuwen_hooks: internal error in release", exc_info=True)
            return None

    async def _aguarded(self, plan: ReleasePlan) -> Outcome | None:
        try:
            return await self.client.asend(plan)
        except Exception:
            self.telemetry.count("internal_errors")
            self.warnings.warn("internal", "jiuwen_hooks: internal error in release", exc_info=True)
            return None

    def _background(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=2, thread_name_prefix="jiuwen-release"
                )
            return self._executor

    def _track(self, job: concurrent.futures.Future[Any] | asyncio.Task[Any]) -> None:
        with self._lock:
            self._pending.add(job)

        def done(_: Any) -> None:
            with self._lock:
                self._pending.discard(job)

        job.add_done_callback(done)

    # -- lifecycle ----------------------------------------------------------------------------
    def uninstall(self) -> None:
        """Same as ``jiuwen_hooks.uninstall()`` when this hook is the installed one."""
        from ._install import uninstall

        if _state.installed() is self:
            uninstall()

    def stats(self) -> dict[str, int]:
        counts = self.telemetry.snapshot()
        counts["sessions.tracked"] = len(self.table)
        counts["sessions.evicted"] = self.table.evicted
        return counts

    def close(self) -> None:
        self.flush()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self.client.close()
