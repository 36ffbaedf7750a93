"""The end-to-end tests' own shared servers (the plugin's pytest plugin gives the first plugin
server and the vanilla one): all of them start together when the first test needs one."""

from __future__ import annotations

import atexit
import functools
from collections.abc import Iterator

import pytest

from examples.otel_collector import OtlpCollector
from vllm_affinity.testing import VLLMServer
from vllm_affinity.testing.pytest_plugin import shared_server


@functools.cache
def _the_collector() -> OtlpCollector:
    """The session's collector, started as soon as its ports are chosen (when the server that
    exports to it is built): a port left free until a later test asked for the collector was
    once taken by another process in between, and the client's spans went to it and timed out."""
    collector = OtlpCollector()
    if collector.binary() is not None:  # else ``otlp_collector`` says what to install
        collector.start()
        atexit.register(collector.stop)
    return collector


@pytest.fixture(scope="session")
def otlp_collector() -> Iterator[OtlpCollector]:
    """A real OpenTelemetry collector process (rotel) that ``second_plugin_server`` exports
    its spans to."""
    collector = _the_collector()
    if not collector.running:
        collector.start()
    yield collector
    collector.stop()


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
