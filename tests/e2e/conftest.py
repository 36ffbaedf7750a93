"""The end-to-end tests' own shared servers (the plugin's pytest plugin gives the first plugin
server and the vanilla one): all of them start together when the first test needs one."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest

from examples.otel_collector import OtlpCollector
from vllm_affinity.pytest_plugin import shared_server
from vllm_affinity.testing import VLLMServer


@functools.cache
def _the_collector() -> OtlpCollector:
    """The session's collector: its ports are fixed when the server that exports to it is
    built; the process starts when a test asks for ``otlp_collector`` (the server's exporter
    drops what it sends before that)."""
    return OtlpCollector()


@pytest.fixture(scope="session")
def otlp_collector() -> Iterator[OtlpCollector]:
    """A real OpenTelemetry collector process (rotel) that ``second_plugin_server`` exports
    its spans to."""
    with _the_collector() as collector:
        yield collector


def _second_plugin_server() -> VLLMServer:
    return VLLMServer(
        plugin=True,
        num_blocks=96,
        env={
            "VLLM_AFFINITY_RELEASE_ON_DIVERGENCE": "true",
            "VLLM_AFFINITY_IDLE_GUARD": "false",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        },
        extra_args=("--otlp-traces-endpoint", _the_collector().grpc_endpoint),
        cpu_cores="1",
        eager=True,
        worker_in_engine=True,
    )


#: A plugin server for what the first one is not set up for: no API key (the openJiuwen 0.1.16
#: client sends none), a session's rewritten history released on divergence
#: (``VLLM_AFFINITY_RELEASE_ON_DIVERGENCE``), every idle signal acted on (the IDLE segment's
#: own tests: ``VLLM_AFFINITY_IDLE_GUARD=false``; the first server's idles depend on the
#: absences of every test before), and traces exported to ``otlp_collector``.
second_plugin_server = shared_server("second_plugin_server", _second_plugin_server)
