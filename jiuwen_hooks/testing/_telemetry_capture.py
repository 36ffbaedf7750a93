"""``TelemetryCapture``: in-memory OTel providers for assertions on the hook's spans and metrics."""

from __future__ import annotations

from typing import Any


class TelemetryCapture:
    """In-memory OTel tracer and meter providers for assertions on spans and metrics."""

    def __init__(self) -> None:
        try:
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import InMemoryMetricReader
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
                InMemorySpanExporter,
            )
        except ImportError as exc:  # pragma: no cover - depends on the user's environment
            raise RuntimeError(
                "TelemetryCapture needs the OpenTelemetry SDK: "
                "pip install 'jiuwen-kv-affinity[otel]'"
            ) from exc
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.metric_reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.metric_reader])

    def spans(self, name: str | None = None) -> list[Any]:
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]

    def metric_points(self, name: str) -> list[Any]:
        """All data points of metric ``name`` collected so far (cumulative)."""
        data = self.metric_reader.get_metrics_data()
        points: list[Any] = []
        for resource_metrics in data.resource_metrics if data else ():
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.name == name:
                        points.extend(metric.data.data_points)
        return points

    def metric_sum(self, name: str, **attributes: Any) -> float:
        """Sum of a counter's points whose attributes include ``attributes``."""
        return sum(
            p.value
            for p in self.metric_points(name)
            if all(p.attributes.get(k) == v for k, v in attributes.items())
        )

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
