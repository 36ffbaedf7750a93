"""The hook's fast path and neutrality, through the real openai client against real loopback
servers: an engine that advertises in-request releases gets them on the chat request itself (no
POST); one that does not keeps getting POSTs; a strict OpenAI-style server never sees a field it
does not know."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from callers import Caller, system_and_user

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine, TelemetryCapture


@pytest.fixture
def plugin_engine() -> Iterator[LocalEngine]:
    with LocalEngine(in_request=True) as engine:
        yield engine


@pytest.fixture
def strict_engine() -> Iterator[LocalEngine]:
    with LocalEngine(strict=True) as engine:
        yield engine


@pytest.fixture(params=["sync", "async"])
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def plugin_call(plugin_engine: LocalEngine, mode: str) -> Iterator[Caller]:
    caller = Caller(mode, plugin_engine.base_url)
    yield caller
    caller.close()


@pytest.fixture
def strict_call(strict_engine: LocalEngine, mode: str) -> Iterator[Caller]:
    caller = Caller(mode, strict_engine.base_url)
    yield caller
    caller.close()


def learned(hook: jiuwen_hooks.Hook, engine: LocalEngine) -> str:
    hook.flush()  # the probe runs on the background thread
    return hook.engines()[engine.root_url]


def test_strict_server_never_fails_a_call(
    strict_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook, strict_call: Caller
) -> None:
    window = system_and_user(6)
    for n in (3, 5, 2, 4):  # append, truncate, append after a truncation
        strict_call(window[:n])
    window[1] = {"role": "user", "content": "rewritten"}
    strict_call(window, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    statuses = [c.body.keys() for c in strict_engine.chats]
    assert len(statuses) == 5  # every call succeeded
    assert all("cache_salt" not in keys and "cache_sharing" not in keys for keys in statuses)
    assert all(c.headers["x-session-id"] == "s" for c in strict_engine.chats)
    assert all(hint is None for hint in strict_engine.hints)  # not a plugin engine


def test_strict_server_rejects_what_the_old_default_sent(strict_engine: LocalEngine) -> None:
    """The strict server is strict: body fields are refused (what users met before)."""
    import openai

    client = openai.OpenAI(base_url=strict_engine.base_url, api_key="k", max_retries=0)
    with client, pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.chat.completions.create(
            model="m", messages=system_and_user(), extra_body={"cache_salt": "s"}
        )


def test_in_request_release_rides_on_the_chat_request(
    plugin_engine: LocalEngine,
    jiuwen_hook: jiuwen_hooks.Hook,
    jiuwen_telemetry: TelemetryCapture,
    plugin_call: Caller,
) -> None:
    window = system_and_user(4)
    plugin_call(window)
    assert learned(jiuwen_hook, plugin_engine) == "in_request"
    window[2] = {"role": "user", "content": "[Old tool result content cleared]"}
    plugin_call(window)
    plugin_call(window[:2], tools=[{"type": "function", "function": {"name": "f"}}])
    assert plugin_engine.releases == []  # no POST at all
    assert plugin_engine.hints == [
        None,
        "messages_released_index=2",
        "messages_released_index=2, tools_released_index=0",
    ]
    stats = jiuwen_hooks.stats()
    assert stats["releases.in_request"] == 2
    assert stats["engines"] == {plugin_engine.root_url: "in_request"}
    spans = jiuwen_telemetry.spans("kv_cache.release")
    assert [s.attributes["jiuwen.release.mode"] for s in spans] == ["in_request"] * 2
    assert spans[0].attributes["jiuwen.release.messages_released_index"] == 2
    assert jiuwen_telemetry.metric_sum("jiuwen.kv_release.requests", outcome="in_request") == 2


def test_first_release_goes_as_post_and_its_answer_teaches_the_engine(
    plugin_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook, plugin_call: Caller
) -> None:
    """A release due before the probe answered is POSTed; the 200 advertises the fast path."""
    gate = threading.Event()
    for _ in range(2):  # hold the background thread: the probe cannot run yet
        jiuwen_hook._submit(gate.wait, 5)
    try:
        window = system_and_user(4)
        plugin_call(window)
        plugin_call(window[:3])
        assert jiuwen_hook.engines()[plugin_engine.root_url] == "in_request"
        plugin_call(window[:2])
    finally:
        gate.set()
    assert [r.body["messages_released_index"] for r in plugin_engine.releases] == [3]
    assert plugin_engine.hints[-1] == "messages_released_index=2"


def test_post_only_engine_keeps_getting_posts(
    call: Caller, jiuwen_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook
) -> None:
    window = system_and_user(5)
    for n in (5, 4, 3, 2):
        call(window[:n])
    assert [r.body["messages_released_index"] for r in jiuwen_engine.releases] == [4, 3, 2]
    assert all(r.headers["x-session-id"] == "s" for r in jiuwen_engine.releases)
    assert jiuwen_engine.hints == [None] * 4
    assert learned(jiuwen_hook, jiuwen_engine) == "post"


@pytest.mark.parametrize("jiuwen_hook_options", [{"capability_ttl": 0}])
def test_engine_that_drops_the_plugin_goes_back_to_posts(
    plugin_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook, plugin_call: Caller
) -> None:
    window = system_and_user(4)
    plugin_call(window)
    assert learned(jiuwen_hook, plugin_engine) == "in_request"
    plugin_engine.advertise_in_request(False)
    plugin_call(window[:3])  # still in-request (state in force); re-probes: route gone
    assert learned(jiuwen_hook, plugin_engine) == "unknown"
    plugin_call(window[:2])
    assert plugin_engine.hints[1] == "messages_released_index=3"
    assert [r.body["messages_released_index"] for r in plugin_engine.releases] == [2]


@pytest.mark.parametrize("jiuwen_hook_options", [{"timeout": 0.2}])
def test_the_probe_waits_longer_than_a_release(
    plugin_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook, plugin_call: Caller
) -> None:
    """The probe runs off the agent's path: a server answering it later than a release may take
    (``timeout``) is still learned (``probe_timeout``, 5 s by default)."""
    plugin_engine.delay_capabilities(0.5)
    window = system_and_user(4)
    plugin_call(window)
    assert learned(jiuwen_hook, plugin_engine) == "in_request"
    plugin_call(window[:3])
    assert plugin_engine.hints[-1] == "messages_released_index=3"


@pytest.mark.parametrize("jiuwen_hook_options", [{"probe_timeout": 0.2}])
def test_a_probe_timed_out_at_first_contact_is_retried_soon(
    plugin_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook, plugin_call: Caller
) -> None:
    """A busy server answered the first probe late: the hook asks again a second later, so the
    session's releases ride on its requests from then on, not by POST for ``capability_ttl``."""
    plugin_engine.delay_capabilities(0.5)
    window = system_and_user(5)
    plugin_call(window[:4])
    assert learned(jiuwen_hook, plugin_engine) == "unknown"
    plugin_engine.delay_capabilities(0)
    time.sleep(1.1)  # the first retry is due 1 s after the failed probe
    plugin_call(window)  # an append: no release due; starts the retry
    assert learned(jiuwen_hook, plugin_engine) == "in_request"
    plugin_call(window[:3])
    assert plugin_engine.hints[-1] == "messages_released_index=3"
    assert plugin_engine.releases == []


@pytest.mark.parametrize("jiuwen_hook_options", [{"in_request": False}])
def test_in_request_can_be_turned_off(
    plugin_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook, plugin_call: Caller
) -> None:
    window = system_and_user(3)
    plugin_call(window)
    plugin_call(window[:2])
    assert len(plugin_engine.releases) == 1
    assert plugin_engine.hints == [None, None]


def test_compressor_release_is_posted_and_the_next_call_carries_the_hint(
    plugin_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook, plugin_call: Caller
) -> None:
    """The compressor's POST may still be on the wire when the agent calls the model; the hint
    on that call closes the race (the engine's release is idempotent)."""

    @jiuwen_hooks.compressor(name="trim")
    def trim(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return messages[:2]

    window = system_and_user(4)
    plugin_call(window)
    jiuwen_hook.flush()
    with jiuwen_hooks.session("s"):
        window = trim(window)
    jiuwen_hook.flush()
    plugin_call([*window, {"role": "user", "content": "go on"}])
    assert [r.body["messages_released_index"] for r in plugin_engine.releases] == [2]
    assert plugin_engine.hints == [None, "messages_released_index=2"]


def test_next_use_rides_on_calls_to_the_plugin_only(
    plugin_engine: LocalEngine,
    strict_engine: LocalEngine,
    jiuwen_hook: jiuwen_hooks.Hook,
    plugin_call: Caller,
    strict_call: Caller,
) -> None:
    """``next_use()``: calls inside the block carry ``X-KV-Next-Use`` to an engine where the
    hook found the plugin, never to another server; a value the caller set wins."""
    window = system_and_user(3)
    plugin_call(window)
    assert learned(jiuwen_hook, plugin_engine) == "in_request"
    with jiuwen_hooks.next_use(300):
        plugin_call(window)
        plugin_call(window, extra_headers={"X-KV-Next-Use": "5"})
        strict_call(window)
        strict_call(window)
    plugin_call(window)
    sent = [c.headers.get("x-kv-next-use") for c in plugin_engine.chats]
    assert sent == [None, "300", "5", None]
    assert all("x-kv-next-use" not in c.headers for c in strict_engine.chats)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "300", True])
def test_next_use_refuses_what_is_not_seconds(bad: Any) -> None:
    with pytest.raises(ValueError, match="next_use"), jiuwen_hooks.next_use(bad):
        pass


def test_a_probe_asked_for_up_front_makes_the_first_release_ride_on_its_request(
    plugin_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook, plugin_call: Caller
) -> None:
    """``Hook.probe`` (a benchmark's warm-up) learns the engine's state on the caller's thread:
    the first release due is in-request, with no POST before it."""
    assert jiuwen_hook.probe(plugin_engine.root_url) == "in_request"
    window = system_and_user(4)
    plugin_call(window)
    plugin_call(window[:3])
    assert plugin_engine.hints[-1] == "messages_released_index=3"
    assert plugin_engine.releases == []
