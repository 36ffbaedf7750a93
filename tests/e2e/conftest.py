"""The end-to-end tests' second shared plugin server and its collector (the plugin's pytest
plugin gives the first plugin server and the vanilla one)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from examples.otel_collector import OtlpCollector
from vllm_affinity.testing import VLLMServer


@pytest.fixture(scope="session")
def otlp_collector() -> Iterator[OtlpCollector]:
    """A real OpenTelemetry collector process (rotel) that ``second_plugin_server`` exports
    its spans to."""
    with OtlpCollector() as collector:
        yield collector


@pytest.fixture(scope="session")
def second_plugin_server(otlp_collector: OtlpCollector) -> Iterator[VLLMServer]:
    """A plugin server for what the first one is not set up for: no API key (the openJiuwen
    0.1.16 client sends none), a session's rewritten history released on divergence
    (``VLLM_AFFINITY_RELEASE_ON_DIVERGENCE``), and traces exported to ``otlp_collector``."""
    with VLLMServer(
        plugin=True,
        num_blocks=96,
        env={
            "VLLM_AFFINITY_RELEASE_ON_DIVERGENCE": "true",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        },
        extra_args=("--otlp-traces-endpoint", otlp_collector.grpc_endpoint),
        cpu_cores="1",
        eager=True,
    ) as server:
        yield server
