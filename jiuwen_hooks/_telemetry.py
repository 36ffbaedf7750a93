"""Telemetry adapter: OTel spans and metrics, in-process counters and rate-limited warnings.

Uses only the OpenTelemetry *API*: with no SDK configured every call is a no-op. The in-process
counters behind ``jiuwen_hooks.stats()`` do not depend on OTel at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import metrics, propagate, trace

from jiuwen_kv_protocol.headers import RELEASE_SPAN

logger = logging.getLogger("jiuwen_hooks")

INSTRUMENTATION_NAME = "jiuwen_hooks"


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one release request ended. ``outcome`` is a short label used in metrics and stats:
    ``ok``, ``http_<status>``, ``invalid_response``, ``timeout``, ``connect_error``,
    ``connection_reset``, ``error``, ``unsupported`` / ``unreachable`` (skipped during the
    cool-down after a 404/405, or after a timeout or failed connection),
    ``in_request`` (carried on the chat request itself: no HTTP of its own), ``superseded`` (a
    compressor's release the next model call took over) or ``dropped`` (the hook was closing)."""

    outcome: str
    block_released: int | None = None
    status_code: int | None = None
    error_type: str | None = None
    #: What a 200 answer advertised (``EngineState``), or ``None``.
    engine_state: Any = None

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def log_triggered(session_id: str, messages_index: int, tools_index: int | None) -> None:
    """The documented INFO lines (docs/client.md, "Log lines"), one set per release decided."""
    logger.info(
        "KV cache release triggered for session %s (msg_idx=%d, tool_idx=%s)",
        session_id,
        messages_index,
        tools_index,
    )
    if tools_index is not None:
        logger.info("[RELEASE REASON] Tool modified at index %d", tools_index)
    else:
        logger.info("[RELEASE REASON] Message modified at index %d", messages_index)


class RateLimitedWarnings:
    """One log warning per key per interval; the number suppressed meanwhile is reported."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()
        self._lock = threading.Lock()

    def warn(self, key: str, message: str, *args: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval:
                self._suppressed[key] += 1
                return
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            message += " (%d similar warnings suppressed)"
            args = (*args, suppressed)
        logger.warning(message, *args, exc_info=exc_info)


class Telemetry:
    """Spans, OTel instruments and the counters behind ``stats()``, for one installed hook."""

    def __init__(
        self, version: str, tracer_provider: Any = None, meter_provider: Any = None
    ) -> None:
        self.tracer = trace.get_tracer(
            INSTRUMENTATION_NAME, version, tracer_provider=tracer_provider
        )
        meter = metrics.get_meter(INSTRUMENTATION_NAME, version, meter_provider=meter_provider)
        self._requests = meter.create_counter(
            "jiuwen.kv_release.requests",
            unit="{request}",
            description="Release requests by outcome",
        )
        self._blocks = meter.create_counter(
            "jiuwen.kv_release.blocks", unit="{block}", description="KV blocks the engine released"
        )
        self._skipped = meter.create_counter(
            "jiuwen.kv_release.skipped",
            unit="{release}",
            description="Releases not sent, by reason",
        )
        self._duration = meter.create_histogram(
            "jiuwen.kv_release.duration", unit="s", description="Duration of release requests"
        )
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    @contextmanager
    def release_span(self, attributes: dict[str, Any]) -> Iterator[trace.Span]:
        with self.tracer.start_as_current_span(
            RELEASE_SPAN, kind=trace.SpanKind.CLIENT, attributes=attributes, record_exception=False
        ) as span:
            yield span

    def record_in_request(self, attributes: dict[str, Any], reason: str) -> dict[str, str]:
        """A release carried on the chat request: a span of its own, counted. Returns the W3C
        trace-context headers that join the server's span to it."""
        carrier: dict[str, str] = {}
        with self.tracer.start_as_current_span(
            RELEASE_SPAN, kind=trace.SpanKind.CLIENT, attributes=attributes
        ):
            propagate.inject(carrier)
        self.record_release(Outcome("in_request"), reason, None)
        return carrier

    def record_release(self, outcome: Outcome, reason: str, duration: float | None) -> None:
        attrs = {"outcome": outcome.outcome, "reason": _reason_family(reason)}
        self._requests.add(1, attrs)
        if duration is not None:
            self._duration.record(duration, attrs)
        blocks = outcome.block_released or 0
        if blocks:
            self._blocks.add(blocks, {"reason": attrs["reason"]})
        with self._lock:
            self._counts[f"releases.{outcome.outcome}"] += 1
            self._counts["releases.total"] += 1
            self._counts["block_released"] += blocks

    def record_skip(self, reason: str) -> None:
        self._skipped.add(1, {"reason": reason})
        with self._lock:
            self._counts[f"skipped.{reason}"] += 1

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def _reason_family(reason: str) -> str:
    """`compressor:<name>` keeps its name in spans, not in metric labels (bounded cardinality)."""
    return "compressor" if reason.startswith("compressor:") else reason
