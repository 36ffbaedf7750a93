"""Shared fixtures: real openai clients pointed at the real loopback ``LocalEngine``."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import openai
import pytest

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine


@pytest.fixture
def client(jiuwen_engine: LocalEngine) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=jiuwen_engine.base_url, api_key="sk-test", max_retries=0) as c:
        yield c


@pytest.fixture
async def aclient(jiuwen_engine: LocalEngine) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=jiuwen_engine.base_url, api_key="sk-test", max_retries=0
    ) as c:
        yield c


@pytest.fixture(params=["sync", "async"])
def call(request: pytest.FixtureRequest, jiuwen_engine: LocalEngine) -> Iterator[object]:
    from callers import Caller

    caller = Caller(request.param, jiuwen_engine.base_url)
    yield caller
    caller.close()


@pytest.fixture(autouse=True)
def no_hook_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test that leaves the process-wide hook installed (and uninstalls it), so one
    test's hook never changes what the next one sees. Set up first, torn down last: fixtures
    that install and uninstall around a test are done by the time this looks."""
    yield
    if jiuwen_hooks.installed() is not None:
        jiuwen_hooks.uninstall()
        pytest.fail(f"{request.node.nodeid} left jiuwen_hooks installed", pytrace=False)


@pytest.fixture
def clean_hook() -> Iterator[None]:
    """No hook installed when the test starts, none left behind when it ends (failed or not)."""
    jiuwen_hooks.uninstall()
    yield
    jiuwen_hooks.uninstall()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``long`` (the soak, the two-replica fleets) run with ``JIUWEN_LONG=1``
    (``make test-long``) and are skipped otherwise, to keep ``make test`` under 20 minutes."""
    if os.environ.get("JIUWEN_LONG"):
        return
    skip = pytest.mark.skip(reason="long run: JIUWEN_LONG=1 (make test-long)")
    for item in items:
        if item.get_closest_marker("long"):
            item.add_marker(skip)
