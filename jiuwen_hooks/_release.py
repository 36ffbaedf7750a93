"""HTTP adapter: sends ``POST /release_kv_cache`` and ``GET /affinity/capabilities`` (the
probe), and never raises.

Separate pooled sync and async httpx clients (one async client per event loop, since httpx
connection pools are bound to the loop that created them). Every outcome is turned into an
``Outcome``, counted, and — when it is a failure — logged as a rate-limited warning. What each
answer says about the engine (in-request capable, POST only, unsupported) goes into the
``EngineDirectory``; an engine that answers 404/405 is left alone for a cool-down, with a single
warning.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.trace import Status, StatusCode

from jiuwen_kv_protocol.headers import (
    CAPABILITIES_PATH,
    MODEL_ATTRIBUTE,
    SESSION_ATTRIBUTE,
    SESSION_HEADER,
)
from jiuwen_kv_protocol.models import ReleaseReceipt

from ._engines import EngineDirectory, EngineState, state_from_capabilities
from ._options import Options
from ._sessions import ReleasePlan
from ._telemetry import Outcome, RateLimitedWarnings, Telemetry, logger
from ._windows import messages_body, responses_body

#: Outcomes after which an engine root is left alone for ``failure_cooldown`` seconds.
_UNREACHABLE = frozenset({"timeout", "connect_error", "connection_reset"})

_SUPPRESS_KEYS = tuple(
    key
    for key in (
        getattr(otel_context, "_SUPPRESS_INSTRUMENTATION_KEY", None),
        getattr(otel_context, "_SUPPRESS_HTTP_INSTRUMENTATION_KEY", None),
    )
    if key is not None
)


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """Where a session's releases go: derived from the openai client that sent its window."""

    url: str
    api_key: str | None
    model: str
    #: The engine root (base URL without ``/v1``): the key of what the hook learns per engine.
    root: str = ""
    #: The chat requests carried a ``cache_salt`` that the engine hashes with (no sharing): the
    #: release must say so (``cache_sharing: false``) so the engine hashes the same way.
    salted: bool = False


def release_payload(plan: ReleasePlan) -> dict[str, Any]:
    old, release = plan.old, plan.release
    body: dict[str, Any] = {
        "model": plan.target.model,
        "cache_salt": plan.session_id,
        "cache_sharing": not plan.target.salted,
        "messages_released_index": release.messages_released_index,
    }
    if old.api == "responses":  # the index counts the instructions as the first item
        body.update(responses_body(old))
    elif old.api == "messages":  # Anthropic: likewise the system prompt
        body["api"] = "messages"
        body.update(messages_body(old))
    else:
        body["messages"] = list(old.messages)
    if old.tools is not None:
        body["tools"] = list(old.tools)
    if release.tools_released_index is not None:
        body["tools_released_index"] = release.tools_released_index
    return body


class ReleaseClient:
    """Sends releases for one installed hook; owns its httpx clients and the cool-down table."""

    def __init__(self, options: Options, telemetry: Telemetry, engines: EngineDirectory) -> None:
        self._options = options
        self._telemetry = telemetry
        self.engines = engines
        self._warnings = RateLimitedWarnings(options.warning_interval)
        self._timeout = httpx.Timeout(options.timeout)
        self._probe_timeout = httpx.Timeout(options.probe_timeout)
        self._sync: httpx.Client | None = None
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    # -- public -------------------------------------------------------------------------------
    def send(self, plan: ReleasePlan) -> Outcome:
        if (skipped := self._cooling_down(plan)) is not None:
            return skipped
        with self._attempt(plan) as attempt:  # only the I/O differs from asend()
            try:
                response = self._sync_client().post(
                    attempt.url, json=attempt.body, headers=attempt.headers
                )
                response.read()
                attempt.response = response
            except Exception as exc:
                attempt.error = exc
        return attempt.result()

    async def asend(self, plan: ReleasePlan) -> Outcome:
        if (skipped := self._cooling_down(plan)) is not None:
            return skipped
        with self._attempt(plan) as attempt:
            try:
                response = await self._async_client().post(
                    attempt.url, json=attempt.body, headers=attempt.headers
                )
                await response.aread()
                attempt.response = response
            except Exception as exc:
                attempt.error = exc
        return attempt.result()

    def probe(self, root: str, api_key: str | None) -> EngineState:
        """``GET {root}/affinity/capabilities`` (synchronous; run off the agent's path). A 200
        teaches the engine's state; anything else leaves it as it was."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        state: EngineState | None = None
        missing = False
        try:
            with _no_instrumentation():
                response = self._sync_client().get(
                    root + CAPABILITIES_PATH, headers=headers, timeout=self._probe_timeout
                )
            missing = response.status_code in (404, 405)
            if response.status_code == 200:
                state = state_from_capabilities(response.json())
        except Exception:  # network errors, non-JSON: nothing learned
            pass
        self.engines.probe_answered(root, state, missing)
        return self.engines.state(root)

    def close(self) -> None:
        with self._lock:
            sync, self._sync = self._sync, None
            clients = list(self._async.items())
            self._async = weakref.WeakKeyDictionary()
        if sync is not None:
            sync.close()
        for loop, client in clients:
            if not loop.is_closed() and not loop.is_running():
                loop.run_until_complete(client.aclose())
            # A client bound to a running or closed loop is left to the garbage collector.

    # -- internals ----------------------------------------------------------------------------
    def _sync_client(self) -> httpx.Client:
        with self._lock:
            if self._sync is None:
                self._sync = httpx.Client(timeout=self._timeout, trust_env=False)
            return self._sync

    def _async_client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._async.get(loop)
            if client is None:
                client = httpx.AsyncClient(timeout=self._timeout, trust_env=False)
                self._async[loop] = client
            return client

    def _cooling_down(self, plan: ReleasePlan) -> Outcome | None:
        reason = self.engines.cooling_down(plan.target.root)
        if reason is None:
            return None
        outcome = Outcome(reason)
        self._telemetry.record_release(outcome, plan.release.reason, None)
        return outcome

    @contextmanager
    def _attempt(self, plan: ReleasePlan) -> Iterator[_Attempt]:
        """Build the request (span around it, trace context in its headers, other
        instrumentation off), let the caller do the I/O, then classify what came back and
        record it: everything but the I/O, for both ``send`` and ``asend``."""
        attributes = span_attributes(plan)
        attributes["jiuwen.release.mode"] = "post"
        attributes["jiuwen.engine.state"] = str(self.engines.state(plan.target.root))
        with self._telemetry.release_span(attributes) as span:
            headers = {"Content-Type": "application/json", SESSION_HEADER: plan.session_id}
            if plan.target.api_key:
                headers["Authorization"] = f"Bearer {plan.target.api_key}"
            propagate.inject(headers)
            with _no_instrumentation():
                attempt = _Attempt(plan.target.url, headers, release_payload(plan))
                started = time.perf_counter()
                yield attempt
            attempt.outcome = classify(attempt.response, attempt.error)
            self._conclude(plan, attempt.outcome)
            set_span_outcome(span, attempt.outcome)
            duration = time.perf_counter() - started
            self._telemetry.record_release(attempt.outcome, plan.release.reason, duration)

    def _conclude(self, plan: ReleasePlan, outcome: Outcome) -> None:
        url, root = plan.target.url, plan.target.root
        if outcome.ok:
            self.engines.learn(root, outcome.engine_state or EngineState.POST)
        elif outcome.status_code in (404, 405):
            previous = self.engines.learn(root, EngineState.UNSUPPORTED)
            if previous is not EngineState.UNSUPPORTED:
                logger.warning(
                    "The current LLM endpoint %s does not support KV cache release (HTTP %d; is "
                    "the vllm_affinity plugin loaded?); KV cache release will not take effect. "
                    "Not retrying for %.0f s.",
                    url,
                    outcome.status_code,
                    self._options.unsupported_cooldown,
                )
        elif not outcome.ok:
            if outcome.outcome in _UNREACHABLE:
                self.engines.unreachable(root, self._options.failure_cooldown)
            detail = f"HTTP {outcome.status_code}" if outcome.status_code else outcome.error_type
            self._warnings.warn(
                f"{url}:{outcome.outcome}",
                "Failed to release inference-affinity KV cache: %s from %s; the agent goes on "
                "unaffected.",
                detail,
                url,
            )


@contextmanager
def _no_instrumentation() -> Iterator[None]:
    """Our own HTTP requests are not the agent's: HTTP instrumentations stay out of them."""
    ctx = otel_context.get_current()
    for key in _SUPPRESS_KEYS:
        ctx = otel_context.set_value(key, True, ctx)
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


@dataclass(slots=True)
class _Attempt:
    """One release request: what to send; then what came back, filled in by the I/O."""

    url: str
    headers: dict[str, str]
    body: dict[str, Any]
    response: httpx.Response | None = None
    error: BaseException | None = None
    outcome: Outcome | None = None

    def result(self) -> Outcome:
        assert self.outcome is not None, "read after the attempt's block ended"
        return self.outcome


def span_attributes(plan: ReleasePlan) -> dict[str, Any]:
    """Attributes of a POSTed release's span."""
    attrs = release_attributes(plan)
    attrs["url.full"] = plan.target.url
    return attrs


def release_attributes(plan: ReleasePlan) -> dict[str, Any]:
    """Attributes of any release's span (POSTed or carried on the chat request)."""
    release, target = plan.release, plan.target
    parts = urlsplit(target.url)
    attrs: dict[str, Any] = {
        SESSION_ATTRIBUTE: plan.session_id,
        MODEL_ATTRIBUTE: target.model,
        "jiuwen.release.reason": release.reason,
        "jiuwen.release.messages_released_index": release.messages_released_index,
        "jiuwen.release.messages_count": len(plan.old.messages),
        "server.address": parts.hostname or "",
        "server.port": parts.port or (443 if parts.scheme == "https" else 80),
    }
    if release.tools_released_index is not None:
        attrs["jiuwen.release.tools_released_index"] = release.tools_released_index
    return attrs


def set_span_outcome(span: Any, outcome: Outcome) -> None:
    if outcome.status_code is not None:
        span.set_attribute("http.response.status_code", outcome.status_code)
    if outcome.block_released is not None:
        span.set_attribute("jiuwen.release.block_released", outcome.block_released)
    if not outcome.ok:
        span.set_attribute("error.type", outcome.error_type or outcome.outcome)
        span.set_status(Status(StatusCode.ERROR, outcome.outcome))


def classify(response: httpx.Response | None, exc: BaseException | None) -> Outcome:
    """Map a response or a transport exception to an ``Outcome``."""
    if exc is not None:
        if isinstance(exc, httpx.TimeoutException):
            kind = "timeout"
        elif isinstance(exc, httpx.ConnectError):
            kind = "connect_error"
        elif isinstance(exc, httpx.ReadError | httpx.RemoteProtocolError | httpx.WriteError):
            kind = "connection_reset"
        else:
            kind = "error"
        return Outcome(kind, error_type=type(exc).__name__)
    assert response is not None
    status = response.status_code
    if status != 200:
        return Outcome(f"http_{status}", status_code=status, error_type=str(status))
    try:
        receipt = ReleaseReceipt.model_validate(response.json())
    except Exception:  # not JSON, not an object, no valid block_released
        return Outcome("invalid_response", status_code=status, error_type="invalid_response")
    engine_state = state_from_capabilities(receipt.capabilities)
    return Outcome(
        "ok", block_released=receipt.block_released, status_code=status, engine_state=engine_state
    )
