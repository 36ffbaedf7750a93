"""The Responses API through the real openai client against the recording ``LocalEngine``: the
window is ``instructions`` + ``input``; releases go by POST (``input`` in the body) or ride on the
request (``X-KV-Release``); calls whose history lives on the server are not tracked."""

from __future__ import annotations

from typing import Any

import openai
import pytest

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine

INSTRUCTIONS = "You are a careful agent."


def items(n: int) -> list[Any]:
    out: list[Any] = []
    for i in range(n):
        out.append({"role": "user", "content": f"question {i}"})
        out.append({"type": "function_call", "call_id": f"c{i}", "name": "ls", "arguments": "{}"})
        out.append({"type": "function_call_output", "call_id": f"c{i}", "output": f"{i} files"})
    return out


def test_compaction_releases_by_post(
    jiuwen_hook: Any, client: openai.OpenAI, jiuwen_engine: LocalEngine
) -> None:
    history = items(3)
    with jiuwen_hooks.session("r1"):
        client.responses.create(model="m", instructions=INSTRUCTIONS, input=history)
        compacted = [*history[:3], {"role": "user", "content": "summary of the rest"}]
        client.responses.create(model="m", instructions=INSTRUCTIONS, input=compacted)
    (release,) = jiuwen_engine.releases
    body = release.body
    assert body["instructions"] == INSTRUCTIONS
    assert body["input"] == history  # the previous window, as sent
    assert "messages" not in body
    # index 0 is the instructions: the first changed input item is input[3] → window index 4
    assert body["messages_released_index"] == 4
    assert release.headers["x-session-id"] == "r1"
    assert jiuwen_engine.paths == ["/v1/responses", "/release_kv_cache", "/v1/responses"]
    assert jiuwen_engine.responses[1].headers["x-session-id"] == "r1"


def test_changed_instructions_release_everything(
    jiuwen_hook: Any, client: openai.OpenAI, jiuwen_engine: LocalEngine
) -> None:
    with jiuwen_hooks.session("r2"):
        client.responses.create(model="m", instructions=INSTRUCTIONS, input="hello")
        client.responses.create(model="m", instructions="Be brief.", input="hello")
    (release,) = jiuwen_engine.releases
    assert release.body["messages_released_index"] == 0
    assert release.body["input"] == [{"role": "user", "content": "hello"}]


def test_pure_append_releases_nothing(
    jiuwen_hook: Any, client: openai.OpenAI, jiuwen_engine: LocalEngine
) -> None:
    history = items(2)
    with jiuwen_hooks.session("r3"):
        first = client.responses.create(model="m", input=history)
        history += [o.model_dump(exclude_none=True) for o in first.output]
        client.responses.create(model="m", input=history)
    assert jiuwen_engine.releases == []
    assert jiuwen_hooks.stats()["calls.tracked"] == 2


def test_previous_response_id_is_not_tracked(
    jiuwen_hook: Any, client: openai.OpenAI, jiuwen_engine: LocalEngine
) -> None:
    with jiuwen_hooks.session("r4"):
        client.responses.create(model="m", input=items(2))
        client.responses.create(model="m", input="next", previous_response_id="resp_local")
    assert jiuwen_engine.releases == []
    stats = jiuwen_hooks.stats()
    assert stats["calls.untracked.server_history"] == 1
    assert stats["calls.tracked"] == 1
    assert "x-session-id" not in jiuwen_engine.responses[1].headers  # passed through untouched


@pytest.mark.parametrize("path", ["create", "stream", "raw", "streaming_response", "parse"])
async def test_every_async_path_is_tracked(
    jiuwen_hook: Any, aclient: openai.AsyncOpenAI, jiuwen_engine: LocalEngine, path: str
) -> None:
    async def send(window: list[Any]) -> None:
        responses = aclient.responses
        if path == "create":
            await responses.create(model="m", input=window)
        elif path == "stream":
            stream = await responses.create(model="m", input=window, stream=True)
            async for _ in stream:
                pass
        elif path == "raw":
            raw = await responses.with_raw_response.create(model="m", input=window)
            raw.parse()
        elif path == "streaming_response":
            async with responses.with_streaming_response.create(model="m", input=window) as r:
                await r.read()
        else:
            await responses.parse(model="m", input=window)

    history = items(2)
    with jiuwen_hooks.session(f"async-{path}"):
        await send(history)
        await send(history[:2])
    (release,) = jiuwen_engine.releases
    assert release.body["messages_released_index"] == 2
    assert release.body["input"] == history


def test_in_request_release_on_responses(jiuwen_hook: Any, client: openai.OpenAI) -> None:
    with LocalEngine(in_request=True) as engine:
        c = openai.OpenAI(base_url=engine.base_url, api_key="sk-test", max_retries=0)
        history = items(2)
        with jiuwen_hooks.session("r5"):
            c.responses.create(model="m", instructions=INSTRUCTIONS, input=history)
            jiuwen_hook.flush()  # the capability probe
            c.responses.create(model="m", instructions=INSTRUCTIONS, input=history[:1])
        c.close()
        assert engine.releases == []
        assert engine.hints == [None, "messages_released_index=2"]
        assert engine.responses[1].headers["x-session-id"] == "r5"
    assert jiuwen_hooks.stats()["releases.in_request"] == 1


def test_switching_api_mid_session_releases_everything(
    jiuwen_hook: Any, client: openai.OpenAI, jiuwen_engine: LocalEngine
) -> None:
    with jiuwen_hooks.session("r6"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        client.responses.create(model="m", input=[{"role": "user", "content": "hi"}])
    (release,) = jiuwen_engine.releases
    assert release.body["messages_released_index"] == 0
    assert release.body["messages"] == [{"role": "user", "content": "hi"}]
