"""The end-to-end tests' second shared server (the plugin's pytest plugin gives the first two)."""

from __future__ import annotations

from vllm_affinity.pytest_plugin import shared_server
from vllm_affinity.testing import VLLMServer


def _keyless_diverging_server() -> VLLMServer:
    return VLLMServer(
        plugin=True,
        num_blocks=96,
        env={"VLLM_AFFINITY_RELEASE_ON_DIVERGENCE": "true"},
        cpu_cores="1",
    )


#: A plugin server with no API key (the openJiuwen 0.1.16 client sends none) that releases a
#: session's rewritten history on divergence (``VLLM_AFFINITY_RELEASE_ON_DIVERGENCE``).
keyless_diverging_server = shared_server("keyless_diverging_server", _keyless_diverging_server)
