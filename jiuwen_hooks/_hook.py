"""The installed hook: glue between the pure core (session table, diff, engine directory) and the
adapters (openai patches, compressor wrappers, release client, telemetry). One per ``install()``.

Where a release found at a model call goes:
- the engine advertised in-request releases → an ``X-KV-Release`` header on that very chat
  request (no HTTP of its own);
- otherwise → ``POST /release_kv_cache`` before the chat request (or on a background thread with
  ``dispatch="background"``); its answer teaches the engine's state.
Compressor releases (between model calls) are POSTed on a background thread, which survives the
short-lived event loops of ``asyncio.run``; the next model call takes over one not sent yet, and
waits for one on the wire.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from jiuwen_kv_protocol.headers import engine_root
from jiuwen_kv_protocol.hint import ReleaseHint

from . import _state
from ._background import BackgroundRunner
from ._compressor import compressor_wrapper, parse_dotted
from ._context import (
    ModelCall,
    current_next_use,
    current_parent,
    current_session,
    hashed_with_salt,
    resolve_session,
    salted_body,
    session_headers,
)
from ._diff import Release, ReleasePolicy, Window
from ._engines import EngineDirectory, EngineState
from ._options import Options
from ._patch import Patches, resolve
from ._release import EngineTarget, ReleaseClient, release_attributes
from ._sdk import SDKS, async_request_wrapper, caller_list_wrapper, request_wrapper
from ._sessions import CompressorJob, ReleasePlan, SessionTable
from ._telemetry import Outcome, RateLimitedWarnings, Telemetry, log_triggered
from ._windows import SERVER_HISTORY, rewritten_messages, window_of


@dataclass(frozen=True, slots=True)
class PreparedCall:
    """What a tracked model request sends instead of the caller's headers / extra body (``None``:
    unchanged), and what must happen before it goes out."""

    headers: dict[str, Any] | None = None
    extra_body: dict[str, Any] | None = None
    plan: ReleasePlan | None = None  # a release to POST first
    wait_for: CompressorJob | None = None  # a compressor release on the wire


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _never_raises(what: str) -> Callable[[_Method], _Method]:
    """Method decorator, sync or async: an internal error is counted and logged (rate-limited)
    and the method returns ``None``. A release must never break the agent."""

    def decorate(method: _Method) -> _Method:
        if inspect.iscoroutinefunction(method):

            @functools.wraps(method)
            async def guarded_async(self: Hook, *args: Any, **kwargs: Any) -> Any:
                try:
                    return await method(self, *args, **kwargs)
                except Exception:
                    self._internal_error(what)
                    return None

            return cast(_Method, guarded_async)

        @functools.wraps(method)
        def guarded(self: Hook, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception:
                self._internal_error(what)
                return None

        return cast(_Method, guarded)

    return decorate


class Hook:
    """Handle returned by ``install()``: ``stats()``, ``engines()``, ``flush()``,
    ``uninstall()``."""

    def __init__(self, options: Options, version: str) -> None:
        self.options = options
        self.telemetry = Telemetry(version, options.tracer_provider, options.meter_provider)
        self.table = SessionTable(
            max_sessions=options.max_sessions,
            idle_ttl=options.session_ttl,
            policy=ReleasePolicy(options.min_released_messages, options.ignore_trailing_messages),
        )
        self.directory = EngineDirectory(
            options.capability_ttl, options.unsupported_cooldown, time.monotonic
        )
        self.client = ReleaseClient(options, self.telemetry, self.directory)
        self.warnings = RateLimitedWarnings(options.warning_interval)
        self.background = BackgroundRunner()
        self._patches = Patches()
        #: True while this hook is installed; wrappers an accessor cached pass through otherwise.
        self.active = False

    # -- model calls --------------------------------------------------------------------------
    @_never_raises("call passed through")
    def before_call(self, describe: Callable[[], ModelCall | None]) -> PreparedCall | None:
        """Resolve the session, diff the window, add the headers. ``None``: pass through
        untouched. Never raises: an internal error is logged and the call goes out unchanged."""
        call = describe()
        return self._before_call(call) if call is not None else None

    def _internal_error(self, what: str) -> None:
        self.telemetry.count("internal_errors")
        self.warnings.warn("internal", f"jiuwen_hooks: internal error; {what}", exc_info=True)

    def _before_call(self, call: ModelCall) -> PreparedCall | None:
        session_id = resolve_session(
            call, self.options.session_resolver, self.options.session_from_user_id
        )
        if session_id is None:
            return None
        window = window_of(call.api, call.body)
        if not isinstance(window, Window):
            if window == SERVER_HISTORY:
                self.telemetry.count(f"calls.untracked.{SERVER_HISTORY}")
            return None
        extra_body = None
        if self.options.session_body:
            extra_body = salted_body(call.extra_body, session_id, self.options.cache_sharing)
        target = self._target(call, extra_body if extra_body is not None else call.extra_body)
        decision = self.table.observe(session_id, window, target, call.caller_list)
        self.telemetry.count("calls.tracked")
        if decision.skipped is not None:
            self.telemetry.record_skip(decision.skipped)
        plan, hint, trace_headers = decision.plan, None, None
        if plan is not None:
            self._log_triggered(plan)
        state = self._engine_state(target)  # first contact starts the probe
        due = plan or decision.covered  # a covered release is idempotent in the engine
        if due is not None and state is EngineState.IN_REQUEST:
            hint = release_header(due.release)
            trace_headers = self._record_in_request(due)
            plan = None
        # the plugin's lifecycle hints, where the agent gave them (``next_use()``, ``parent=``)
        plugin = state is EngineState.IN_REQUEST
        next_use = current_next_use() if plugin else None
        parent = current_parent(session_id) if plugin else None
        headers = None
        if self.options.inject_session or hint is not None or next_use is not None or parent:
            headers = session_headers(  # a hint needs its session
                call.headers,
                session_id,
                release=hint,
                trace=trace_headers,
                next_use=next_use,
                parent=parent,
            )
        return PreparedCall(headers, extra_body, plan, decision.wait_for)

    def _target(self, call: ModelCall, extra_body: Any) -> EngineTarget:
        root = engine_root(call.base_url)
        return EngineTarget(
            self.options.release_url or root + self.options.release_path,
            call.api_key,
            str(call.body.get("model")),
            root=root,
            salted=hashed_with_salt(extra_body),
        )

    @staticmethod
    def _log_triggered(plan: ReleasePlan) -> None:
        release = plan.release
        log_triggered(
            plan.session_id, release.messages_released_index, release.tools_released_index
        )

    def _engine_state(self, target: EngineTarget) -> EngineState:
        """The engine's learned state; first contact (or an expired state) starts a probe on the
        background thread, so the fast path is known by the time a release is due."""
        if not self.options.in_request:
            return EngineState.UNKNOWN
        if self.directory.claim_probe(target.root):
            self._submit(self.client.probe, target.root, target.api_key)
        return self.directory.state(target.root)

    def _record_in_request(self, plan: ReleasePlan) -> dict[str, str]:
        attributes = release_attributes(plan)
        attributes["jiuwen.release.mode"] = "in_request"
        attributes["jiuwen.engine.state"] = str(EngineState.IN_REQUEST)
        return self.telemetry.record_in_request(attributes, plan.release.reason)

    def settle(self, prepared: PreparedCall) -> None:
        """Before a synchronous model call: wait for a compressor release on the wire, POST."""
        if prepared.wait_for is not None:
            self._wait(prepared.wait_for)
        if prepared.plan is not None:
            self.dispatch(prepared.plan)

    async def asettle(self, prepared: PreparedCall) -> None:
        if prepared.wait_for is not None and not prepared.wait_for.done.is_set():
            await asyncio.get_running_loop().run_in_executor(None, self._wait, prepared.wait_for)
        if prepared.plan is not None:
            await self.adispatch(prepared.plan)

    def _wait(self, job: CompressorJob) -> None:
        if not job.done.wait(self.options.timeout):
            self.telemetry.count("compressor.wait_timeouts")

    # -- compressors --------------------------------------------------------------------------
    @_never_raises("compressor output not diffed")
    def after_compress(self, label: str, messages_in: Any, result: Any) -> None:
        """A compressor returned: diff its output against the last window sent and send the
        release off the agent's path. Never raises."""
        output = result if isinstance(result, list | tuple) else messages_in
        if output is None:
            return
        session_id = current_session() or self.table.session_of(messages_in)
        if session_id is None:
            self.telemetry.count("compressor.untracked")
            return
        self.telemetry.count("compressor.runs")
        decision = self.table.rewrite(session_id, output, f"compressor:{label}", rewritten_messages)
        if decision.skipped is not None:
            self.telemetry.record_skip(decision.skipped)
        if decision.plan is not None and decision.job is not None:
            self._log_triggered(decision.plan)
            self._submit(self._send_compressor_release, decision.plan, decision.job)

    def _send_compressor_release(self, plan: ReleasePlan, job: CompressorJob) -> None:
        try:
            if self.table.claim(job):
                self._guarded(plan)
            else:
                self.telemetry.record_release(Outcome("superseded"), plan.release.reason, None)
        finally:
            job.done.set()

    # -- session ends -------------------------------------------------------------------------
    @_never_raises("session end not released")
    def end_session(self, session_id: str) -> None:
        """The agent says the session is over: its whole cache is released (POSTed on the
        background thread: no model call follows to carry it) and the session forgotten."""
        plan = self.table.end(session_id)
        if plan is None:
            self.telemetry.count("end_session.unknown")
            return
        self.telemetry.count("end_session.released")
        self._log_triggered(plan)
        self._submit(self._guarded, plan)

    # -- dispatch -----------------------------------------------------------------------------
    def dispatch(self, plan: ReleasePlan) -> Outcome | None:
        """POST from synchronous code: inline (default) or on the background thread."""
        if self.options.dispatch == "inline":
            return self._guarded(plan)
        self._submit(self._guarded, plan)
        return None

    async def adispatch(self, plan: ReleasePlan) -> Outcome | None:
        """POST from async code: awaited inline (default) or on the background thread (which,
        unlike a task, survives the end of a short-lived event loop)."""
        if self.options.dispatch == "inline":
            return await self._aguarded(plan)
        self._submit(self._guarded, plan)
        return None

    def flush(self, timeout: float | None = 10.0) -> None:
        """Wait for the releases and probes running on the background thread."""
        self.background.flush(timeout)

    async def aflush(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.flush)

    # ReleaseClient already catches transport errors; these are the backstop.
    @_never_raises("release not sent")
    def _guarded(self, plan: ReleasePlan) -> Outcome | None:
        return self.client.send(plan)

    @_never_raises("release not sent")
    async def _aguarded(self, plan: ReleasePlan) -> Outcome | None:
        return await self.client.asend(plan)

    def _submit(self, fn: Any, *args: Any) -> None:
        """Run ``fn`` on the background thread. After ``close()`` nothing is started: a release
        is counted as dropped, never silently lost."""
        if not self.background.submit(fn, *args):
            self._drop(args)

    def _drop(self, args: tuple[Any, ...]) -> None:
        plan = next((a for a in args if isinstance(a, ReleasePlan)), None)
        if plan is None:
            return  # a probe: nothing lost
        self.telemetry.record_release(Outcome("dropped"), plan.release.reason, None)
        self.warnings.warn(
            "dropped", "jiuwen_hooks: release dropped: the hook is uninstalled or closing"
        )

    # -- lifecycle ----------------------------------------------------------------------------
    def install(self) -> Hook:
        """Patch the openai client (and the compressors named in the options) and become the
        process's hook. Raises, with nothing patched, on a compressor that cannot be found."""
        with _state.lock:
            if _state.installed() is not None:
                raise RuntimeError("jiuwen_hooks: another hook is installed; uninstall it first")
            try:
                self._patch()
            except BaseException:
                self._patches.remove_all()
                self.close()
                raise
            self.active = True
            _state.set_installed(self)
        return self

    def _patch(self) -> None:
        for sdk in SDKS:
            if importlib.util.find_spec(sdk.name) is None:
                continue  # not installed: nothing of it to track
            self._patches.wrap(sdk.client_module, sdk.sync_request, request_wrapper(self))
            self._patches.wrap(sdk.client_module, sdk.async_request, async_request_wrapper(self))
            for module, method, argument in sdk.caller_methods:
                self._patches.wrap(module, method, caller_list_wrapper(self, argument))
        for dotted in self.options.compressors:
            module, attribute = parse_dotted(dotted)
            found = resolve(module, attribute)
            if found is None:
                raise ValueError(f"jiuwen_hooks: compressor {dotted!r} not found")
            is_async = inspect.iscoroutinefunction(found[2])
            self._patches.wrap(module, attribute, compressor_wrapper(attribute, is_async))

    def uninstall(self) -> None:
        """Remove every patch this hook made, flush background releases, close HTTP clients.
        Wrappers that an SDK accessor cached while installed pass straight through from now on."""
        with _state.lock:
            if _state.installed() is self:
                _state.set_installed(None)
            was_active, self.active = self.active, False
            self._patches.remove_all()
        if was_active:
            self.close()

    def stats(self) -> dict[str, Any]:
        """Counters (``releases.ok``, ``releases.in_request``, ``skipped.<reason>``, ...) and
        ``engines``: what each engine root advertised (``unknown``, ``in_request``, ``post``,
        ``unsupported``)."""
        counts: dict[str, Any] = dict(self.telemetry.snapshot())
        counts["sessions.tracked"] = len(self.table)
        counts["sessions.evicted"] = self.table.evicted
        counts["engines"] = self.directory.snapshot()
        return counts

    def engines(self) -> dict[str, str]:
        """Engine root → learned state."""
        return self.directory.snapshot()

    def probe(self, root: str, api_key: str | None = None) -> str:
        """Learn an engine's state now, on this thread, and return it: a benchmark's warm-up,
        so that its first release takes the path every later one takes (an agent's first
        contact probes on the background thread instead)."""
        return str(self.client.probe(root, api_key))

    def close(self) -> None:
        """Let running background work finish (bounded), then close the HTTP clients."""
        self.background.close()
        self.client.close()


def release_header(release: Release) -> str:
    """The ``X-KV-Release`` value for ``release``, in the plugin's own wire format."""
    return ReleaseHint(release.messages_released_index, release.tools_released_index).header_value()
