"""Traces in a real OTel collector process: the client's release span and the server's span
arrive in the same trace, the server's a child of the client's."""

from __future__ import annotations

import openai
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import jiuwen_hooks
from examples.otel_collector import CollectedSpan, OtlpCollector
from vllm_affinity.testing import SERVED_NAME, VLLMServer

pytestmark = pytest.mark.e2e


def test_client_and_server_release_spans_share_a_trace(
    second_plugin_server: VLLMServer, otlp_collector: OtlpCollector
) -> None:
    """Every path: a POSTed release (``in_request=False``), an in-request one, whose trace
    context rides on the chat request with the hint, and an openJiuwen ``agent_hint``
    management request carrying the caller's ``traceparent``. (The collector also holds the
    spans of other tests on this server: only this test's traces count.)"""
    server, collector = second_plugin_server, otlp_collector
    provider = TracerProvider(resource=Resource.create({"service.name": "agent"}))
    exporter = OTLPSpanExporter(endpoint=collector.http_endpoint + "/v1/traces")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    for in_request in (False, True):
        jiuwen_hooks.uninstall()
        hook = jiuwen_hooks.install(tracer_provider=provider, in_request=in_request)
        try:
            rewrite_once(server, hook, f"traced-{in_request}")
        finally:
            jiuwen_hooks.uninstall()
    evict_as_openjiuwen(server, provider)
    provider.shutdown()

    def ours(spans: list[CollectedSpan]) -> tuple[list[CollectedSpan], dict[str, CollectedSpan]]:
        releases = [s for s in spans if s.name == "kv_cache.release"]
        clients = [s for s in releases if s.kind == "SPAN_KIND_CLIENT"]
        traces = {s.trace_id for s in clients}
        servers = {
            s.trace_id: s for s in releases if s.kind == "SPAN_KIND_SERVER" and s.trace_id in traces
        }
        return clients, servers

    def every(spans: list[CollectedSpan]) -> bool:
        clients, servers = ours(spans)
        return len(clients) == len(servers) == 3

    clients, servers = ours(collector.wait_for(every, timeout=40))
    assert len(clients) == len(servers) == 3
    for client_span in clients:
        assert client_span.service == "agent"
        assert servers[client_span.trace_id].parent_id == client_span.span_id


def rewrite_once(server: VLLMServer, hook: jiuwen_hooks.Hook, session: str) -> None:
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0) as client:
        window = [
            {"role": "system", "content": "You are a weather bot. " * 20},
            {"role": "user", "content": "Paris? " * 40},
        ]
        with jiuwen_hooks.session(session):
            client.chat.completions.create(model=SERVED_NAME, messages=window, max_tokens=2)
            hook.flush()  # the capability probe
            client.chat.completions.create(model=SERVED_NAME, messages=window[:1], max_tokens=2)


def evict_as_openjiuwen(server: VLLMServer, provider: TracerProvider) -> None:
    """A management request under a client span of the caller's (openJiuwen's client sends
    what its OpenTelemetry set-up injects)."""
    from opentelemetry import propagate, trace

    tracer = provider.get_tracer("openjiuwen-like")
    with tracer.start_as_current_span("kv_cache.release", kind=trace.SpanKind.CLIENT):
        headers: dict[str, str] = {}
        propagate.inject(headers)
        with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0) as client:
            client.chat.completions.create(
                model=SERVED_NAME,
                messages=[],
                extra_headers=headers,
                extra_body={
                    "agent_hint": {
                        "session_id": "traced-openjiuwen",
                        "context_management": {
                            "manage_request": True,
                            "edits": [{"type": "evict", "target": "session"}],
                        },
                    }
                },
            )
