"""Compressor releases: dispatched at once on the background thread, labelled, never repeated by
the next model call (which takes over a release not sent yet, and waits for one on the wire)."""

from __future__ import annotations

import threading
from typing import Any

import agent_compressors
import pytest
from callers import Caller, system_and_user

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine, TelemetryCapture


def tool_window() -> list[dict[str, Any]]:
    window: list[dict[str, Any]] = system_and_user()
    for city in ("Paris", "Oslo", "Lima"):
        window.append(
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": f"c-{city}",
                        "type": "function",
                        "function": {"name": "weather", "arguments": f'{{"city": "{city}"}}'},
                    }
                ],
            }
        )
        window.append(
            {"role": "tool", "tool_call_id": f"c-{city}", "content": f"{city}: sunny " * 50}
        )
    return window


@jiuwen_hooks.compressor(name="micro")
def micro(messages: list[dict[str, Any]]) -> None:
    agent_compressors.clear_tool_results(messages)


@jiuwen_hooks.compressor
def returns_new_list(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [messages[0], {"role": "user", "content": "[DIALOGUE_MEMORY_BLOCK]"}, *messages[-1:]]


def test_in_place_compressor_releases_at_once_and_only_once(
    call: Caller,
    jiuwen_engine: LocalEngine,
    jiuwen_hook: jiuwen_hooks.Hook,
    jiuwen_telemetry: TelemetryCapture,
) -> None:
    window = tool_window()
    call(window)
    with jiuwen_hooks.session("s"):
        micro(window)
    jiuwen_hook.flush()
    assert len(jiuwen_engine.releases) == 1  # before any model call
    body = jiuwen_engine.releases[0].body
    assert body["messages_released_index"] == 3  # the first cleared tool result
    assert "sunny" in body["messages"][3]["content"]  # the old window, as sent
    window.append({"role": "user", "content": "next"})
    call(window)
    assert len(jiuwen_engine.releases) == 1
    assert jiuwen_hooks.stats()["skipped.already_released"] == 1
    (span,) = jiuwen_telemetry.spans("kv_cache.release")
    assert span.attributes["jiuwen.release.reason"] == "compressor:micro"


def test_returned_list_found_by_identity_without_session_context(
    call: Caller, jiuwen_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook
) -> None:
    window = tool_window()
    call(window, session="agent-9")
    new_window = returns_new_list(window)  # no session() around it: the list is recognised
    jiuwen_hook.flush()
    assert [r.body["cache_salt"] for r in jiuwen_engine.releases] == ["agent-9"]
    assert jiuwen_engine.releases[0].body["messages_released_index"] == 1
    call(new_window, session="agent-9")
    assert len(jiuwen_engine.releases) == 1


def test_compressor_on_unsent_messages_releases_nothing(
    call: Caller, jiuwen_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook
) -> None:
    window = system_and_user()
    call(window)
    window += tool_window()[2:]  # tool results arrived after the last call
    with jiuwen_hooks.session("s"):
        micro(window)
    assert jiuwen_engine.releases == []


def test_untracked_compressor_is_a_plain_function(jiuwen_engine: LocalEngine) -> None:
    window = tool_window()
    assert jiuwen_hooks.stats() == {}  # not installed
    micro(window)
    assert window[3]["content"] == agent_compressors.PLACEHOLDER
    assert jiuwen_engine.releases == []


@pytest.fixture
def dotted_hook(jiuwen_telemetry: TelemetryCapture) -> Any:
    jiuwen_hooks.uninstall()
    original = (
        agent_compressors.clear_tool_results,
        agent_compressors.Summariser.__dict__["compress"],
        agent_compressors.async_drop_middle,
    )
    hook = jiuwen_hooks.install(
        compressors=[
            "agent_compressors:clear_tool_results",
            "agent_compressors:Summariser.compress",
            "agent_compressors:async_drop_middle",
        ],
        tracer_provider=jiuwen_telemetry.tracer_provider,
    )
    yield hook
    jiuwen_hooks.uninstall()
    assert agent_compressors.clear_tool_results is original[0]
    assert agent_compressors.Summariser.__dict__["compress"] is original[1]
    assert agent_compressors.async_drop_middle is original[2]


def test_dotted_path_compressors(
    call: Caller, jiuwen_engine: LocalEngine, dotted_hook: Any, jiuwen_telemetry: TelemetryCapture
) -> None:
    window = tool_window()
    call(window)
    with jiuwen_hooks.session("s"):
        agent_compressors.clear_tool_results(window)
        summary = agent_compressors.Summariser().compress(window)
    dotted_hook.flush()
    # the summary rewrites from index 1, before the range already released: released at once
    # (two background sends: either may arrive first)
    assert sorted(r.body["messages_released_index"] for r in jiuwen_engine.releases) == [1, 3]
    call(summary)
    assert len(jiuwen_engine.releases) == 2
    reasons = {s.attributes["jiuwen.release.reason"] for s in jiuwen_telemetry.spans()}
    assert reasons == {"compressor:clear_tool_results", "compressor:Summariser.compress"}


def test_async_compressor(call: Caller, jiuwen_engine: LocalEngine, dotted_hook: Any) -> None:
    window = tool_window()
    call(window)

    async def compact() -> list[dict[str, Any]]:
        with jiuwen_hooks.session("s"):
            return await agent_compressors.async_drop_middle(window)

    import asyncio

    result = asyncio.run(compact()) if call.mode == "sync" else call.run(compact())
    assert len(result) == 2
    dotted_hook.flush()
    assert [r.body["messages_released_index"] for r in jiuwen_engine.releases] == [1]


def test_next_call_takes_over_a_compressor_release_not_sent_yet(
    call: Caller, jiuwen_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook
) -> None:
    """The background thread is busy (a slow probe): the model call that follows the compressor
    releases the range itself, before it goes out, and the compressor's job stands down."""
    window = tool_window()
    call(window)
    jiuwen_hook.flush()
    gate = threading.Event()
    for _ in range(2):  # occupy both background workers
        jiuwen_hook._submit(gate.wait, 5)
    with jiuwen_hooks.session("s"):
        micro(window)
    window.append({"role": "user", "content": "next"})
    call(window)
    gate.set()
    jiuwen_hook.flush()
    assert [r.body["messages_released_index"] for r in jiuwen_engine.releases] == [3]
    assert jiuwen_engine.paths[-2:] == ["/release_kv_cache", "/v1/chat/completions"]
    stats = jiuwen_hooks.stats()
    assert stats["releases.superseded"] == 1 and stats["releases.ok"] == 1


def test_next_call_waits_for_a_compressor_release_on_the_wire(
    call: Caller, jiuwen_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook
) -> None:
    """A slow release is being sent when the agent calls the model: the call waits for it (up to
    the release timeout), so the release lands before the rewritten request allocates."""
    window = tool_window()
    call(window)
    jiuwen_hook.flush()
    jiuwen_engine.answer_releases(delay=0.3)
    with jiuwen_hooks.session("s"):
        micro(window)
    jiuwen_engine.wait_for_releases(1)  # the release has reached the server
    window.append({"role": "user", "content": "next"})
    call(window)
    assert jiuwen_engine.paths[-2:] == ["/release_kv_cache", "/v1/chat/completions"]
    assert jiuwen_hooks.stats()["releases.ok"] == 1


def test_release_from_a_closing_event_loop_completes(
    jiuwen_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook
) -> None:
    """``asyncio.run`` closes its loop right after the compressor returns: the release runs on
    the background thread, not as a task of that loop, so it still completes."""
    import asyncio

    import openai

    window = tool_window()

    async def turn() -> None:
        async with openai.AsyncOpenAI(
            base_url=jiuwen_engine.base_url, api_key="k", max_retries=0
        ) as client:
            with jiuwen_hooks.session("short-loop"):
                await client.chat.completions.create(model="m", messages=window)

    @jiuwen_hooks.compressor
    async def drop(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return await agent_compressors.async_drop_middle(messages)

    async def compress_only() -> None:
        with jiuwen_hooks.session("short-loop"):
            await drop(window)

    asyncio.run(turn())
    asyncio.run(compress_only())  # the loop ends as soon as the compressor returned
    jiuwen_hook.flush()
    assert [r.body["cache_salt"] for r in jiuwen_engine.releases] == ["short-loop"]


def test_release_after_uninstall_is_counted_as_dropped(
    call: Caller, jiuwen_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook
) -> None:
    window = tool_window()
    call(window)
    jiuwen_hook.close()
    with jiuwen_hooks.session("s"):
        micro(window)
    assert jiuwen_hook.stats()["releases.dropped"] == 1
    assert jiuwen_engine.releases == []
