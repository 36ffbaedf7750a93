"""End to end on the real plugin server: subagents. A subagent names its parent (the hook's
``session(id, parent=...)``, or Claude Code's own session and agent headers on
``/v1/messages``); the engine counts it as running until the call that ends its task, which
releases its own blocks as dead. (The PROTECTED segment for waiting parents is off by default;
``tests/adapter/test_adapter.py`` checks it on vLLM's own classes.)"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest

import jiuwen_hooks
from vllm_affinity.testing import (
    BLOCK_SIZE,
    SERVED_NAME,
    VLLMServer,
    filler_text,
    filler_window,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("clean_hook")]

NEXT_USE = "X-KV-Next-Use"  # 0: back at once (a tool call); 3600: the task is over


def wait_for(server: VLLMServer, what: str, done: Any) -> dict[str, Any]:
    """The engine's stats once ``done(stats)`` holds (idle signals arrive after the answer)."""

    def finished() -> dict[str, Any] | None:
        stats = server.engine_stats()
        return stats if done(stats) else None

    return wait_until(finished, 20, what)  # type: ignore[no-any-return]


def test_hook_subagent_protects_its_parent_and_its_end_releases_it(
    vllm_affinity_server: VLLMServer, jiuwen_hook_factory: Callable[..., jiuwen_hooks.Hook]
) -> None:
    server = vllm_affinity_server
    hook = jiuwen_hook_factory()
    before = server.engine_stats()
    with openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0) as c:

        def chat(seed: int) -> None:
            c.chat.completions.create(
                model=SERVED_NAME, messages=filler_window(seed=seed, words=300), max_tokens=2
            )

        with jiuwen_hooks.session("hook-lead"), jiuwen_hooks.next_use(0):
            chat(601)  # the lead hands a task over; also the hook's first contact (probe)
            hook.flush()  # the capability probe has answered
            chat(601)  # now known as the plugin: hints go in the request
        with jiuwen_hooks.session("hook-sub", parent="hook-lead"):
            with jiuwen_hooks.next_use(0):
                chat(602)
            running = server.engine_stats()
            assert running["children"] == before["children"] + 1
            with jiuwen_hooks.next_use(3600):  # an hour or more: done (less: a slow tool)
                chat(603)  # its last call: the task is done
    after = wait_for(server, "the subagent's end", lambda s: s["children"] == before["children"])
    released = after.get("block_released_child_end", 0) - before.get("block_released_child_end", 0)
    assert released > 0
    assert after["segments"]["protected"] == 0  # off by default


def test_claude_code_headers_make_a_subagent_on_messages(vllm_affinity_server: VLLMServer) -> None:
    """No hook: Claude Code's session header, plus its agent id header on a subagent's calls."""
    server = vllm_affinity_server
    lead = {"X-Claude-Code-Session-Id": "cc-e2e-session", NEXT_USE: "0"}
    sub = {**lead, "X-Claude-Code-Agent-Id": "agent-7"}
    before = server.engine_stats()
    with anthropic.Anthropic(
        base_url=server.root_url, auth_token=server.api_key, max_retries=0
    ) as sdk:

        def call(seed: int, headers: dict[str, str]) -> None:
            sdk.messages.create(
                model=SERVED_NAME,
                messages=[{"role": "user", "content": filler_text(random.Random(seed), 300)}],
                max_tokens=2,
                extra_headers=headers,
            )

        call(611, lead)
        call(612, sub)
        running = server.engine_stats()
        assert running["children"] == before["children"] + 1
        call(613, {**sub, NEXT_USE: "3600"})
    after = wait_for(server, "the subagent's end", lambda s: s["children"] == before["children"])
    assert after.get("children_ended", 0) > before.get("children_ended", 0)
    assert after["segments"]["protected"] == 0


def test_a_subagents_end_keeps_its_instructions(vllm_affinity_server: VLLMServer) -> None:
    """No hook, Claude Code's headers: the subagent's end releases its own blocks after its
    system prompt and tools, which the agent's next subagents send again."""
    server = vllm_affinity_server
    system = filler_text(random.Random(621), 120)
    tools = [
        {
            "name": "read_file",
            "description": filler_text(random.Random(622), 40),
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
    ]
    lead = {"X-Claude-Code-Session-Id": "cc-e2e-instructions", NEXT_USE: "0"}
    sub = {**lead, "X-Claude-Code-Agent-Id": "agent-9"}
    before = server.engine_stats()
    with anthropic.Anthropic(
        base_url=server.root_url, auth_token=server.api_key, max_retries=0
    ) as sdk:

        def call(text: str, headers: dict[str, str] | None) -> int:
            answer = sdk.messages.create(
                model=SERVED_NAME,
                system=system,
                tools=tools,  # type: ignore[arg-type]
                messages=[{"role": "user", "content": text}],
                max_tokens=2,
                extra_headers=headers,
            )
            usage = answer.usage
            cached = (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
            return usage.input_tokens + cached

        # the instructions and a one-word message, in no session: how long they render
        instructions = call("Alpha", None)
        call(filler_text(random.Random(623), 60), lead)
        call(filler_text(random.Random(624), 150), sub)
        call(filler_text(random.Random(625), 150), {**sub, NEXT_USE: "3600"})  # its task is done
    after = wait_for(server, "the subagent's end", lambda s: s["children"] == before["children"])

    def delta(name: str) -> int:
        return int(after.get(name, 0) - before.get(name, 0))

    kept, released = delta("blocks_kept_instructions"), delta("block_released_child_end")
    # the instructions, and the block that straddles their end
    assert (instructions - 8) // BLOCK_SIZE <= kept <= instructions // BLOCK_SIZE + 1, (kept, after)
    assert kept >= 4 and released >= 8  # 120 words of instructions; 150 of the task's own
