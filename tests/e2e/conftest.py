"""The end-to-end tests' own shared servers (the plugin's pytest plugin gives the first plugin
server and the vanilla one): all of them start together when the first test needs one."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

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
    )


#: A plugin server for what the first one is not set up for: no API key (the openJiuwen 0.1.16
#: client sends none), a session's rewritten history released on divergence
#: (``VLLM_AFFINITY_RELEASE_ON_DIVERGENCE``), every idle signal acted on (the IDLE segment's
#: own tests: ``VLLM_AFFINITY_IDLE_GUARD=false``; the first server's idles depend on the
#: absences of every test before), and traces exported to ``otlp_collector``.
second_plugin_server = shared_server("second_plugin_server", _second_plugin_server)


def _hybrid_server(
    arch: str, plugin: bool = True, num_blocks: int = 1024, max_model_len: int = 4096
) -> Callable[[], VLLMServer]:
    """A server of one of the hybrid models (``build-model --arch``), every idle acted on. By
    default a pool big enough that nothing is evicted during a test (every group draws from it:
    Gemma 3's 32 tokens cost four blocks, one per group)."""

    def make() -> VLLMServer:
        from vllm_affinity.hybrid_model import build_hybrid

        return VLLMServer(
            model=build_hybrid(arch),
            plugin=plugin,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            env={"VLLM_AFFINITY_IDLE_GUARD": "false"},
            eager=True,
        )

    return make


#: Plugin servers of the three hybrid shapes (``tests/e2e/test_e2e_hybrid.py``).
gpt_oss_server = shared_server("gpt_oss_server", _hybrid_server("gpt-oss"))
gemma3_server = shared_server("gemma3_server", _hybrid_server("gemma3"))
qwen3_next_server = shared_server("qwen3_next_server", _hybrid_server("qwen3-next"))
#: A tight pool of the gpt-oss shape, with and without the plugin: the squeeze and the replay.
gpt_oss_squeeze_server = shared_server(
    "gpt_oss_squeeze_server", _hybrid_server("gpt-oss", num_blocks=160, max_model_len=2816)
)
gpt_oss_vanilla_server = shared_server(
    "gpt_oss_vanilla_server",
    _hybrid_server("gpt-oss", plugin=False, num_blocks=160, max_model_len=2816),
)
