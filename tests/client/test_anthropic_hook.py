"""The hook on the ``anthropic`` SDK against the recording ``LocalEngine``: every way of calling
``messages`` is tracked (clients made before ``install()`` too), releases carry the Anthropic
window, and ``uninstall()`` stops it all."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine

SYSTEM = "You are a coding agent."
FIRST = [
    {"role": "user", "content": "read the file"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read",
                                       "input": {"path": "a.py"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]},
]  # fmt: skip
COMPACTED = [FIRST[0], {"role": "user", "content": "summary: a.py read"}]


@pytest.fixture
def engine() -> Iterator[LocalEngine]:
    with LocalEngine() as local:
        yield local


def sdk(engine: LocalEngine, **kwargs: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=engine.root_url, api_key="sk-test", max_retries=0, **kwargs)


def call(client: anthropic.Anthropic, how: str, messages: list[dict[str, Any]]) -> None:
    kwargs: dict[str, Any] = {"model": "m", "system": SYSTEM, "messages": messages,
                              "max_tokens": 8}  # fmt: skip
    if how == "create":
        client.messages.create(**kwargs)
    elif how == "stream":
        with client.messages.stream(**kwargs) as stream:
            stream.get_final_message()
    elif how == "raw":
        client.messages.with_raw_response.create(**kwargs).parse()
    elif how == "beta":
        client.beta.messages.create(**kwargs)


@pytest.mark.parametrize("how", ["create", "stream", "raw", "beta"])
def test_every_call_path_releases_the_anthropic_window(
    engine: LocalEngine, jiuwen_hook_factory: Any, how: str
) -> None:
    client = sdk(engine)  # made before install(): the SDK's funnel is patched, not the client
    call(client, how, FIRST)
    jiuwen_hook_factory()
    with jiuwen_hooks.session(f"anthropic-{how}"):
        call(client, how, FIRST)
        call(client, how, COMPACTED)
    (release,) = engine.releases
    assert release.body["api"] == "messages" and release.body["system"] == SYSTEM
    assert release.body["messages"] == FIRST
    assert release.body["messages_released_index"] == 2  # system + the kept user message
    sent = [c.headers.get("x-session-id") for c in engine.chats]
    assert sent == [None, f"anthropic-{how}", f"anthropic-{how}"]
    assert all("cache_salt" not in c.body for c in engine.chats)  # no field a strict server refuses


async def test_async_client(engine: LocalEngine, jiuwen_hook_factory: Any) -> None:
    jiuwen_hook_factory()
    async with anthropic.AsyncAnthropic(
        base_url=engine.root_url, api_key="sk-test", max_retries=0
    ) as client:
        with jiuwen_hooks.session("anthropic-async"):
            for messages in (FIRST, COMPACTED):
                await client.messages.create(
                    model="m", system=SYSTEM, messages=messages, max_tokens=8
                )
    assert [r.body["messages_released_index"] for r in engine.releases] == [2]


async def test_async_stream_manager_is_passed_through(
    engine: LocalEngine, jiuwen_hook_factory: Any
) -> None:
    """``AsyncMessages.stream`` returns its manager synchronously: the hook must not turn it
    into a coroutine (``async with`` would fail in the agent)."""
    jiuwen_hook_factory()
    async with anthropic.AsyncAnthropic(
        base_url=engine.root_url, api_key="sk-test", max_retries=0
    ) as client:
        with jiuwen_hooks.session("anthropic-async-stream"):
            for messages in (FIRST, COMPACTED):
                async with client.messages.stream(
                    model="m", system=SYSTEM, messages=messages, max_tokens=8
                ) as stream:
                    await stream.get_final_message()
    assert [r.body["messages_released_index"] for r in engine.releases] == [2]


def test_metadata_user_id_by_resolver_only(engine: LocalEngine, jiuwen_hook_factory: Any) -> None:
    jiuwen_hook_factory(session_resolver=lambda kw: (kw.get("metadata") or {}).get("user_id"))
    client = sdk(engine)
    for messages in (FIRST, COMPACTED):
        client.messages.create(
            model="m", system=SYSTEM, messages=messages, max_tokens=8,
            metadata={"user_id": "user-7"},
        )  # fmt: skip
    assert [c.headers.get("x-session-id") for c in engine.chats] == ["user-7", "user-7"]
    assert len(engine.releases) == 1
    jiuwen_hooks.uninstall()
    jiuwen_hook_factory()  # no resolver: metadata names no session
    engine.clear()
    client.messages.create(
        model="m", system=SYSTEM, messages=FIRST, max_tokens=8, metadata={"user_id": "user-7"}
    )
    assert engine.chats[0].headers.get("x-session-id") is None


def test_metadata_user_id_by_option(engine: LocalEngine, jiuwen_hook_factory: Any) -> None:
    jiuwen_hook_factory(session_from_user_id=True)
    client = sdk(engine)
    for messages in (FIRST, COMPACTED):
        client.messages.create(
            model="m", system=SYSTEM, messages=messages, max_tokens=8,
            metadata={"user_id": "user_ab_session_9"},
        )  # fmt: skip
    assert [c.headers.get("x-session-id") for c in engine.chats] == ["user_ab_session_9"] * 2
    assert len(engine.releases) == 1
    jiuwen_hooks.uninstall()


def test_uninstall_stops_tracking(engine: LocalEngine, jiuwen_hook_factory: Any) -> None:
    jiuwen_hook_factory()
    client = sdk(engine, default_headers={"X-Session-ID": "anthropic-gone"})
    call(client, "create", FIRST)
    jiuwen_hooks.uninstall()
    call(client, "create", COMPACTED)
    assert engine.releases == []
    assert all("x-kv-release" not in c.headers for c in engine.chats)
