"""End to end on the real plugin server: the Anthropic Messages API through the ``anthropic``
SDK. A compaction releases exactly the stale blocks, by POST (the plugin converts the Anthropic
window as vLLM's ``/v1/messages`` does, then renders it) and in the request itself
(``X-KV-Release`` on ``POST /v1/messages``); streamed and async calls are tracked; against
vanilla vLLM the hook sends nothing but the session header."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import anthropic
import pytest

import jiuwen_hooks
from vllm_affinity.core import common_prefix_length
from vllm_affinity.testing import BLOCK_SIZE, SERVED_NAME, VLLMServer, filler_text

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("clean_hook")]

SYSTEM = "You are a coding agent. Read files, then answer."


def history(seed: int) -> list[dict[str, Any]]:
    """A user request, two tool calls with their results: content blocks of every kind."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = [{"role": "user", "content": filler_text(rng, 50)}]
    for i in range(2):
        out.append(
            {"role": "assistant", "content": [
                {"type": "text", "text": filler_text(rng, 5)},
                {"type": "tool_use", "id": f"toolu_{i}", "name": "read_file",
                 "input": {"path": f"src/{i}.py"}},
            ]}
        )  # fmt: skip
        out.append(
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{i}",
                 "content": filler_text(rng, 60), "cache_control": {"type": "ephemeral"}},
            ]}
        )  # fmt: skip
    return out


def rendered(server: VLLMServer, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt tokens of an Anthropic window, converted as vLLM's ``/v1/messages`` converts."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    request = AnthropicMessagesRequest(
        model=SERVED_NAME, max_tokens=1, system=SYSTEM, messages=messages
    )
    chat = AnthropicServingMessages.to_chat_completion_request(request)
    return server.tokenize([m if isinstance(m, dict) else dict(m) for m in chat.messages])


def client(server: VLLMServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.root_url, auth_token=server.api_key, max_retries=0)


@pytest.mark.parametrize("mode", ["post", "in_request"])
def test_compaction_releases_exactly(
    vllm_affinity_server: VLLMServer,
    jiuwen_hook_factory: Callable[..., jiuwen_hooks.Hook],
    mode: str,
) -> None:
    server = vllm_affinity_server
    hook = jiuwen_hook_factory(in_request=mode == "in_request")
    messages = history(41 if mode == "post" else 42)
    with client(server) as sdk, jiuwen_hooks.session(f"anthropic-{mode}"):
        first = sdk.messages.create(
            model=SERVED_NAME, system=SYSTEM, messages=messages, max_tokens=4
        )
        hook.flush()
        before = server.engine_stats()
        compacted = [*messages[:3], {"role": "user", "content": "summary: both files read"}]
        sdk.messages.create(model=SERVED_NAME, system=SYSTEM, messages=compacted, max_tokens=2)
        hook.flush()
    after = server.engine_stats()
    # window index 4 (system + 3 messages kept) is the first stale item
    first_stale = (
        common_prefix_length(rendered(server, messages), rendered(server, messages[:3]))
        // BLOCK_SIZE
    )
    usage = first.usage
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    prompt += usage.cache_creation_input_tokens or 0
    cached = (prompt + usage.output_tokens - 1) // BLOCK_SIZE
    assert after[f"releases_{mode}"] - before.get(f"releases_{mode}", 0) == 1
    released = after[f"block_released_{mode}"] - before.get(f"block_released_{mode}", 0)
    assert released == cached - first_stale
    assert released > 0
    assert hook.stats()[f"releases.{'ok' if mode == 'post' else 'in_request'}"] == 1


def test_streamed_and_async_calls_are_tracked(
    vllm_affinity_server: VLLMServer, jiuwen_hook_factory: Callable[..., jiuwen_hooks.Hook]
) -> None:
    server = vllm_affinity_server
    hook = jiuwen_hook_factory()
    messages = history(43)
    compacted = [messages[0], {"role": "user", "content": "summary"}]
    with client(server) as sdk, jiuwen_hooks.session("anthropic-stream"):
        for window in (messages, compacted):
            with sdk.messages.stream(
                model=SERVED_NAME, system=SYSTEM, messages=window, max_tokens=2
            ) as stream:
                assert stream.get_final_message().usage.output_tokens > 0
            hook.flush()

    async def run() -> None:
        async with anthropic.AsyncAnthropic(
            base_url=server.root_url, auth_token=server.api_key, max_retries=0
        ) as sdk:
            for window in (messages, compacted):
                stream = await sdk.messages.create(
                    model=SERVED_NAME, system=SYSTEM, messages=window, max_tokens=2, stream=True,
                    extra_headers={"X-Session-ID": "anthropic-async"},
                )  # fmt: skip
                async for _ in stream:
                    pass

    asyncio.run(run())
    hook.flush()
    stats = hook.stats()
    assert stats["calls.tracked"] == 4
    assert stats["releases.in_request"] + stats.get("releases.ok", 0) == 2
    assert stats["engines"][server.root_url] == "in_request"


def test_vanilla_vllm_sees_only_the_session_header(
    vllm_vanilla_server: VLLMServer, jiuwen_hook_factory: Callable[..., jiuwen_hooks.Hook]
) -> None:
    server = vllm_vanilla_server
    hook = jiuwen_hook_factory()
    messages = history(44)
    with client(server) as sdk, jiuwen_hooks.session("anthropic-vanilla"):
        for window in (messages, [messages[0], {"role": "user", "content": "summary"}]):
            answer = sdk.messages.create(
                model=SERVED_NAME, system=SYSTEM, messages=window, max_tokens=2
            )
            assert answer.usage.output_tokens > 0
            hook.flush()
    stats = hook.stats()
    assert stats["engines"][server.root_url] == "unsupported"
    assert stats.get("releases.in_request", 0) == 0 and stats.get("releases.ok", 0) == 0


@pytest.mark.parametrize(
    ("headers", "session"),
    [
        ({"X-Claude-Code-Session-Id": "cc-1", "X-Claude-Code-Agent-Id": "agent-7"}, "cc-1/agent-7"),
        ({"X-Claude-Code-Session-Id": "cc-2"}, "cc-2"),
        ({"session-id": "codex-3"}, "codex-3"),
    ],
)
def test_agents_own_session_headers_bind_the_session(
    vllm_affinity_server: VLLMServer, headers: dict[str, str], session: str
) -> None:
    """No hook: a coding agent's own session header is enough for the plugin to bind its
    blocks, so a release naming that session (subagents apart) finds them."""
    server = vllm_affinity_server
    # content of its own per case: a prefix another session already hit is kept by releases
    messages = history(45 + sum(map(ord, session)))
    with client(server) as sdk:
        sdk.messages.create(
            model=SERVED_NAME, system=SYSTEM, messages=messages, max_tokens=2,
            extra_headers=headers,
        )  # fmt: skip
    base = {"api": "messages", "model": SERVED_NAME, "cache_sharing": True, "system": SYSTEM}
    base |= {"messages": messages, "messages_released_index": 2}
    other = server.release({**base, "cache_salt": session + "-other"}).json()
    assert other["status"] == "unknown_session" and other["block_released"] == 0
    released = server.release({**base, "cache_salt": session}).json()
    assert released["status"] == "ok" and released["block_released"] > 0
