"""End to end on the real plugin server: openJiuwen's ``agent_hint`` protocol (>= 0.1.19), sent
on the wire as its client sends it (``extra_body``). The session comes from the hint; management
requests release (or restore) exactly the stale blocks and never reach inference; malformed hints
get vLLM's 400 and change nothing. The real openJiuwen client is in ``tests/frameworks/openjiuwen``.
"""

from __future__ import annotations

import random
from typing import Any

import httpx
import openai
import pytest

from vllm_affinity.core import common_prefix_length
from vllm_affinity.testing import BLOCK_SIZE, SERVED_NAME, VLLMServer, filler_text

pytestmark = pytest.mark.e2e


def history(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    roles = ("system", "user", "assistant", "user", "assistant", "user")
    return [{"role": role, "content": filler_text(rng, 50)} for role in roles]


def hint(session: str, **management: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"session_id": session, "parent_session_id": session}
    if management:
        out["context_management"] = {"manage_request": True, **management}
    return out


def client(server: VLLMServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)


def chat(server: VLLMServer, messages: list[dict[str, Any]], agent_hint: dict[str, Any]) -> Any:
    with client(server) as c:
        return c.chat.completions.create(
            model=SERVED_NAME,
            messages=messages,
            max_tokens=4,
            extra_body={"agent_hint": agent_hint, "ignore_eos": True},
        )


def manage(server: VLLMServer, messages: list[dict[str, Any]], agent_hint: dict[str, Any]) -> Any:
    """A management request as openJiuwen's client sends it: no max_tokens, not streamed."""
    with client(server) as c:
        return c.chat.completions.create(
            model=SERVED_NAME, messages=messages, extra_body={"agent_hint": agent_hint}
        )


def finished_requests(server: VLLMServer) -> float:
    return server.metric("vllm:request_success_total")


def test_evict_of_a_messages_range_releases_exactly_and_runs_no_inference(
    vllm_affinity_server: VLLMServer,
) -> None:
    server, session = vllm_affinity_server, "oj-evict-range"
    window = history(41)
    first = chat(server, window, hint(session))
    before, done_before = server.engine_stats(), finished_requests(server)
    edit = {"type": "evict", "target": "messages", "start": 3, "end": len(window)}
    answer = manage(server, window, hint(session, edits=[edit]))
    after = server.engine_stats()
    assert answer.choices[0].message.content == ""
    assert answer.usage.total_tokens == 0
    figures = answer.model_extra["kv_cache"]
    old, cut = server.tokenize(window), server.tokenize(window[:3])
    first_stale = common_prefix_length(old, cut) // BLOCK_SIZE
    cached = (first.usage.prompt_tokens + first.usage.completion_tokens - 1) // BLOCK_SIZE
    assert figures["status"] == "ok"
    assert figures["block_released"] == cached - first_stale > 0
    assert figures["first_stale_block"] == first_stale
    released = after["block_released_agent_hint"] - before.get("block_released_agent_hint", 0)
    assert released == figures["block_released"]
    assert finished_requests(server) == done_before  # no generation ran
    counted = server.metric("vllm_affinity_agent_hint_requests_total", action="evict", outcome="ok")
    assert counted >= 1


def test_evict_of_the_session_releases_all_its_blocks(vllm_affinity_server: VLLMServer) -> None:
    server, session = vllm_affinity_server, "oj-evict-session"
    window = history(42)
    first = chat(server, window, hint(session))
    answer = manage(server, [], hint(session, edits=[{"type": "evict", "target": "session"}]))
    cached = (first.usage.prompt_tokens + first.usage.completion_tokens - 1) // BLOCK_SIZE
    assert answer.model_extra["kv_cache"]["block_released"] == cached
    again = manage(server, [], hint(session, edits=[{"type": "evict", "target": "session"}]))
    assert again.model_extra["kv_cache"]["block_released"] == 0  # idempotent


def test_offload_demotes_and_prefetch_brings_back(vllm_affinity_server: VLLMServer) -> None:
    server, session = vllm_affinity_server, "oj-offload"
    window = history(43)
    chat(server, window, hint(session))
    released_before = server.engine_stats()["segments"]["released"]
    offload = manage(server, [], hint(session, edits=[{"type": "offload", "target": "session"}]))
    moved = offload.model_extra["kv_cache"]["moved"]
    assert moved > 0
    assert server.engine_stats()["segments"]["released"] == released_before + moved
    prefetch = manage(server, [], hint(session, edits=[{"type": "prefetch", "target": "session"}]))
    assert prefetch.model_extra["kv_cache"]["blocks_restored"] == moved
    assert server.engine_stats()["segments"]["released"] == released_before
    with client(server) as c:  # offloaded blocks kept their hashes: they still hit
        again = c.chat.completions.create(
            model=SERVED_NAME,
            messages=window,
            max_tokens=1,
            extra_body={"agent_hint": hint(session)},
        )
    assert again.usage.prompt_tokens_details.cached_tokens >= moved * BLOCK_SIZE - BLOCK_SIZE


BAD_HINTS: list[tuple[str, Any]] = [
    ("not an object", "oj-session"),
    ("session id not a string", {"session_id": 7}),
    ("empty session id", {"session_id": ""}),
    ("no edits", hint("oj-bad", edits=[])),
    (
        "edits on an inference request",
        {
            "session_id": "oj-bad",
            "context_management": {
                "manage_request": False,
                "edits": [{"type": "evict", "target": "session"}],
            },
        },
    ),
    ("unknown action", hint("oj-bad", edits=[{"type": "forget", "target": "session"}])),
    (
        "session edit with a range",
        hint("oj-bad", edits=[{"type": "evict", "target": "session", "start": 0, "end": 2}]),
    ),
    (
        "empty range",
        hint("oj-bad", edits=[{"type": "evict", "target": "messages", "start": 2, "end": 2}]),
    ),
    (
        "range beyond the window",
        hint("oj-bad", edits=[{"type": "evict", "target": "messages", "start": 1, "end": 99}]),
    ),
    (
        "two actions",
        hint(
            "oj-bad",
            edits=[
                {"type": "evict", "target": "messages", "start": 1, "end": 2},
                {"type": "prefetch", "target": "tools", "start": 0, "end": 1},
            ],
        ),
    ),
    (
        "bool as index",
        hint("oj-bad", edits=[{"type": "evict", "target": "messages", "start": True, "end": 2}]),
    ),
]


@pytest.mark.parametrize(("case", "agent_hint"), BAD_HINTS, ids=[c for c, _ in BAD_HINTS])
def test_bad_agent_hints_get_400_and_change_nothing(
    vllm_affinity_server: VLLMServer, case: str, agent_hint: Any
) -> None:
    server = vllm_affinity_server
    before, done_before = server.engine_stats(), finished_requests(server)
    body = {"model": SERVED_NAME, "messages": history(44)[:3], "agent_hint": agent_hint}
    response = httpx.post(
        server.base_url + "/chat/completions", json=body, headers=server.headers(), timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and error["message"]
    after = server.engine_stats()
    assert after["segments"] == before["segments"]
    assert after.get("releases", 0) == before.get("releases", 0)
    assert finished_requests(server) == done_before


def test_management_needs_the_api_key(vllm_affinity_server: VLLMServer) -> None:
    server = vllm_affinity_server
    body = {
        "model": SERVED_NAME,
        "messages": [],
        "agent_hint": hint("oj-key", edits=[{"type": "evict", "target": "session"}]),
    }
    response = httpx.post(server.base_url + "/chat/completions", json=body, timeout=30)
    assert response.status_code == 401


def test_unknown_model_gets_vllms_404(vllm_affinity_server: VLLMServer) -> None:
    server = vllm_affinity_server
    body = {
        "model": "no-such-model",
        "messages": [],
        "agent_hint": hint("oj-model", edits=[{"type": "evict", "target": "session"}]),
    }
    response = httpx.post(
        server.base_url + "/chat/completions", json=body, headers=server.headers(), timeout=30
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == 404
