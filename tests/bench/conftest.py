"""The benchmark pipeline tests' own shared server (see ``vllm_affinity.testing.pytest_plugin``)."""

from __future__ import annotations

from vllm_affinity.testing import VLLMServer
from vllm_affinity.testing.pytest_plugin import API_KEY, shared_server


def _empty_plugin_server() -> VLLMServer:
    return VLLMServer(
        plugin=True,
        num_blocks=64,
        max_model_len=1900,
        api_key=API_KEY,
        cpu_cores="0",
        eager=True,
        worker_in_engine=True,
        # the replays' baseline (no hook, no session named) is vanilla's LRU on this server
        env={"VLLM_AFFINITY_IMPLICIT_SESSIONS": "off"},
    )


#: A plugin server that only the simulator comparison uses: the simulator starts from an empty
#: pool, and on a server holding other runs' blocks the IDLE segment is reused before them (to
#: the plugin they are live LRU blocks).
empty_plugin_server = shared_server("empty_plugin_server", _empty_plugin_server)
