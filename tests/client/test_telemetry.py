"""Span and metric contents, and W3C trace context on the release request."""

from __future__ import annotations

from callers import Caller, system_and_user
from opentelemetry.trace import SpanKind, StatusCode

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine, TelemetryCapture


def test_release_span_attributes_and_trace_context(
    call: Caller,
    jiuwen_engine: LocalEngine,
    jiuwen_hook: jiuwen_hooks.Hook,
    jiuwen_telemetry: TelemetryCapture,
) -> None:
    window = system_and_user(4)
    call(window, session="conv-1")
    tracer = jiuwen_telemetry.tracer_provider.get_tracer("agent")
    with tracer.start_as_current_span("agent.turn") as parent:
        call(window[:2], session="conv-1")
    (span,) = jiuwen_telemetry.spans("kv_cache.release")
    assert span.kind is SpanKind.CLIENT
    assert span.parent is not None and span.parent.span_id == parent.get_span_context().span_id
    attrs = dict(span.attributes)
    assert attrs["gen_ai.conversation.id"] == "conv-1"
    assert attrs["gen_ai.request.model"] == "m"
    assert attrs["jiuwen.release.messages_released_index"] == 2
    assert attrs["jiuwen.release.block_released"] == 3  # LocalEngine: released messages
    assert attrs["jiuwen.release.reason"] == "truncate"
    assert attrs["http.response.status_code"] == 200
    assert attrs["server.address"] == "127.0.0.1"
    assert "error.type" not in attrs
    traceparent = jiuwen_engine.releases[0].headers["traceparent"]
    assert traceparent.split("-")[1] == format(span.context.trace_id, "032x")
    assert traceparent.split("-")[2] == format(span.context.span_id, "016x")


def test_failed_release_span_has_error_type(
    call: Caller,
    jiuwen_engine: LocalEngine,
    jiuwen_hook: jiuwen_hooks.Hook,
    jiuwen_telemetry: TelemetryCapture,
) -> None:
    jiuwen_engine.answer_releases(503)
    window = system_and_user(2)
    call(window)
    call(window[:1])
    (span,) = jiuwen_telemetry.spans("kv_cache.release")
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["error.type"] == "503"
    assert span.attributes["http.response.status_code"] == 503
    assert "jiuwen.release.block_released" not in span.attributes


def test_metrics(
    call: Caller,
    jiuwen_engine: LocalEngine,
    jiuwen_hook: jiuwen_hooks.Hook,
    jiuwen_telemetry: TelemetryCapture,
) -> None:
    window = system_and_user(5)
    call(window)
    call(window[:4])  # releases 2 messages → LocalEngine answers 2 blocks
    call(window[:3])  # 1 more
    jiuwen_engine.answer_releases(500)
    call(window[:2])
    m = jiuwen_telemetry
    assert m.metric_sum("jiuwen.kv_release.requests", outcome="ok", reason="truncate") == 2
    assert m.metric_sum("jiuwen.kv_release.requests", outcome="http_500") == 1
    assert m.metric_sum("jiuwen.kv_release.blocks") == 3
    (histogram,) = m.metric_points("jiuwen.kv_release.duration")[:1]
    assert sum(p.count for p in m.metric_points("jiuwen.kv_release.duration")) == 3
    assert histogram.sum > 0
    assert jiuwen_hooks.stats()["block_released"] == 3


def test_skips_are_counted(
    call: Caller, jiuwen_engine: LocalEngine, jiuwen_telemetry: TelemetryCapture
) -> None:
    jiuwen_hooks.uninstall()
    jiuwen_hooks.install(
        min_released_messages=3,
        ignore_trailing_messages=1,
        meter_provider=jiuwen_telemetry.meter_provider,
        tracer_provider=jiuwen_telemetry.tracer_provider,
    )
    try:
        window = system_and_user(6)
        call(window)
        call([*window[:-1], {"role": "user", "content": "clock: 12:01"}])  # volatile tail
        call(window[:5])  # frees 2 < 3 messages
        call(window[:2])  # frees 3: sent
        stats = jiuwen_hooks.stats()
    finally:
        jiuwen_hooks.uninstall()
    assert stats["skipped.volatile_tail"] == 1
    assert stats["skipped.below_min_gain"] == 1
    assert stats["releases.ok"] == 1
    assert jiuwen_telemetry.metric_sum("jiuwen.kv_release.skipped", reason="below_min_gain") == 1
    assert len(jiuwen_engine.releases) == 1


def test_no_release_no_span(
    call: Caller, jiuwen_hook: jiuwen_hooks.Hook, jiuwen_telemetry: TelemetryCapture
) -> None:
    window = system_and_user()
    call(window)
    call([*window, {"role": "user", "content": "more"}])
    assert jiuwen_telemetry.spans() == []
