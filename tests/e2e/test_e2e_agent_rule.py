"""The main-thread rule on a real plugin server, with the request shapes opencode and Qwen Code
send (recorded from the real agents, issue 37): a compaction right after opencode's first turn
is released, and Qwen Code's request metadata names its session and its side requests. No hook:
what the agents send is all the server sees."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from jiuwen_kv_protocol.headers import GENERIC_SESSION_HEADERS, SESSION_HEADER
from vllm_affinity.testing import BLOCK_SIZE, SERVED_NAME, VLLMServer

pytestmark = pytest.mark.e2e

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
SYSTEM = {"role": "system", "content": "You are opencode, a coding agent. " + "Be terse. " * 12}


def words(seed: int, n: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(n))


def send(
    server: VLLMServer,
    messages: list[dict[str, Any]],
    tools: bool = True,
    headers: dict[str, str] | None = None,
    body: dict[str, Any] | None = None,
) -> None:
    with openai.OpenAI(base_url=server.base_url, api_key=server.api_key or "none") as client:
        client.chat.completions.create(
            model=SERVED_NAME,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            tools=TOOLS if tools else openai.omit,  # type: ignore[arg-type]
            extra_headers=headers or {},
            extra_body=body or {},
        )


def released(server: VLLMServer) -> tuple[int, int]:
    stats = server.engine_stats()
    return stats.get("releases_compaction", 0), stats.get("block_released_compaction", 0)


def test_opencode_compaction_right_after_the_first_turn_is_released(
    vllm_affinity_server: VLLMServer,
) -> None:
    """The old window is the system prompt and one user message; the new one keeps the system
    prompt and goes on with "What did we do so far?", the summary and the next message: the
    first user message's blocks are dead, and the next turn, an append, releases nothing."""
    server = vllm_affinity_server
    sid = "ses_e2e_opencode_one_turn"
    headers = {SESSION_HEADER: sid, GENERIC_SESSION_HEADERS[1]: sid}
    first = [SYSTEM, {"role": "user", "content": words(1, 160)}]
    send(server, first, headers=headers)
    count, blocks = released(server)
    summarize = [
        {"role": "system", "content": "You are a context summarization agent."},
        *first[1:],
    ]
    send(server, summarize, tools=False, headers=headers)  # no tools: a side request
    assert released(server) == (count, blocks)
    after = [
        SYSTEM,
        {"role": "user", "content": "What did we do so far?"},
        {"role": "assistant", "content": "Summary: " + words(2, 20)},
        {"role": "user", "content": "go on"},
    ]
    send(server, after, headers=headers)
    now_count, now_blocks = released(server)
    assert now_count == count + 1
    assert now_blocks - blocks >= 160 // BLOCK_SIZE  # the first message's blocks at least
    more = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    send(server, [*after, *more], headers=headers)
    assert released(server) == (now_count, now_blocks)


def test_qwen_codes_request_metadata_names_its_session_and_side_requests(
    vllm_affinity_server: VLLMServer,
) -> None:
    """No session header: ``metadata.sessionId`` binds the session; the memory extractor (its
    own system prompt, tools) and the compression request are side requests (nothing
    released); the first main turn after the compression releases the old window."""
    server = vllm_affinity_server
    sid = "qwen-e2e-session"

    def meta(prompt_id: str) -> dict[str, Any]:
        return {"metadata": {"sessionId": sid, "promptId": prompt_id}}

    sessions = server.engine_stats()["sessions"]
    turn1 = [SYSTEM, {"role": "user", "content": words(3, 160)}]
    send(server, turn1, body=meta(f"{sid}########1"))
    assert server.engine_stats()["sessions"] == sessions + 1
    count, blocks = released(server)
    extractor = [{"role": "system", "content": "Extract memories. " + words(4, 30)}, turn1[1]]
    send(server, extractor, body=meta(f"{sid}#managed-auto-memory-extractor-ab12#0"))
    history = [*turn1, {"role": "assistant", "content": "done"}]
    send(server, [*history, {"role": "user", "content": "Summarize."}], body=meta("compress-17"))
    assert released(server) == (count, blocks)
    after = [
        SYSTEM,
        {"role": "user", "content": "<state_snapshot>" + words(5, 20) + "</state_snapshot>"},
        {"role": "assistant", "content": "Got it. Thanks for the additional context!"},
        {"role": "user", "content": "go on"},
    ]
    send(server, after, body=meta(f"{sid}########2"))
    now_count, now_blocks = released(server)
    assert now_count == count + 1
    assert now_blocks - blocks >= 160 // BLOCK_SIZE
