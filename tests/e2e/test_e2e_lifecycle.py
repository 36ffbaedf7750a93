"""End to end: a session whose call ends with the model's answer goes to the IDLE segment; one
whose call is cut off (or ends in a tool call) stays live; ``X-KV-Next-Use`` overrides both.
Against real plugin servers: the IDLE segment's own tests on one that acts on every idle signal
(``second_plugin_server``), the idle guard as shipped on the shared server
(``vllm_affinity.testing.pytest_plugin``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from vllm_affinity.testing import BLOCK_SIZE, SERVED_NAME, VLLMServer, filler_window

pytestmark = pytest.mark.e2e


def vocabulary(server: VLLMServer) -> list[int]:
    config = json.loads((Path(server.model) / "config.json").read_text())
    return list(range(config["vocab_size"]))


def call(
    server: VLLMServer,
    session: str,
    messages: list[dict[str, Any]],
    answered: bool,
    headers: dict[str, str] | None = None,
    stream: bool = False,
) -> str | None:
    """One chat call; ``answered`` ends it with ``finish_reason`` ``stop`` (every token is a stop
    token), else it is cut off at ``max_tokens`` (``length``). Returns the finish reason."""
    extra: dict[str, Any] = {"cache_salt": session}
    if answered:
        extra["stop_token_ids"] = vocabulary(server)
    else:
        extra["ignore_eos"] = True
    key = server.api_key or "none"  # the server of the IDLE segment's own tests has no key
    with openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0) as c:
        kwargs: dict[str, Any] = {
            "model": SERVED_NAME,
            "messages": messages,
            "max_tokens": 4,
            "extra_body": extra,
            "extra_headers": {"X-Session-ID": session, **(headers or {})},
        }
        if not stream:
            return c.chat.completions.create(**kwargs).choices[0].finish_reason
        reason = None
        for chunk in c.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                reason = choice.finish_reason or reason
        return reason


def lifecycle(server: VLLMServer) -> dict[str, int]:
    counts = server.affinity_stats()["api_server"]
    return {
        k.removeprefix("lifecycle."): v for k, v in counts.items() if k.startswith("lifecycle.")
    }


def wait_for_idles(server: VLLMServer, at_least: int) -> dict[str, Any]:
    """The engine's stats once it has handled ``at_least`` idle signals (they are sent in the
    background, after the answer)."""
    deadline = time.monotonic() + 20
    while True:
        stats = server.engine_stats()
        if stats.get("idles", 0) >= at_least or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def test_an_answered_session_goes_idle_and_comes_back(second_plugin_server: VLLMServer) -> None:
    server = second_plugin_server
    messages = filler_window(seed=401, words=200)
    before = server.engine_stats()
    assert call(server, "answered", messages, answered=True) == "stop"
    after = wait_for_idles(server, before.get("idles", 0) + 1)
    idled = after["blocks_idled"] - before.get("blocks_idled", 0)
    prompt_blocks = len(server.tokenize(messages)) // BLOCK_SIZE
    assert after["idles_ok"] == before.get("idles_ok", 0) + 1
    assert 2 < idled <= prompt_blocks
    assert after["segments"]["idle"] >= idled
    assert server.metric("vllm_affinity_blocks", segment="idle") == after["segments"]["idle"]
    assert server.metric("vllm_affinity_engine_blocks_idled_total") == after["blocks_idled"]
    # The session's user answers: its blocks are hit, so they leave IDLE (live again).
    follow_up = [
        *messages,
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "go"},
    ]
    assert call(server, "answered", follow_up, answered=False) == "length"
    back = server.engine_stats()
    assert (
        back["segments"]["idle"] <= after["segments"]["idle"] - idled + 2
    )  # but the diverging tail
    assert back["idles"] == after["idles"]  # a cut-off call sends no signal


def test_a_cut_off_call_leaves_the_session_live(second_plugin_server: VLLMServer) -> None:
    server = second_plugin_server
    before, counts = server.engine_stats(), lifecycle(server)
    assert call(server, "cut-off", filler_window(seed=402, words=120), answered=False) == "length"
    time.sleep(0.5)
    assert lifecycle(server).get("live.finish_reason", 0) == counts.get("live.finish_reason", 0) + 1
    assert server.engine_stats().get("idles", 0) == before.get("idles", 0)


def test_a_streamed_answer_goes_idle(second_plugin_server: VLLMServer) -> None:
    server = second_plugin_server
    before = server.engine_stats()
    reason = call(server, "streamed", filler_window(403, 150), answered=True, stream=True)
    assert reason == "stop"
    after = wait_for_idles(server, before.get("idles", 0) + 1)
    assert after["idles_ok"] == before.get("idles_ok", 0) + 1
    assert after["blocks_idled"] > before.get("blocks_idled", 0)


def test_next_use_hint_overrides_the_finish_reason(second_plugin_server: VLLMServer) -> None:
    """An agent that knows its tool takes minutes says so; one that knows its user is quick too."""
    server = second_plugin_server
    before, counts = server.engine_stats(), lifecycle(server)
    slow_tool = {"X-KV-Next-Use": "120"}
    assert call(server, "hinted-slow", filler_window(404, 120), False, slow_tool) == "length"
    after = wait_for_idles(server, before.get("idles", 0) + 1)
    assert after["idles_ok"] == before.get("idles_ok", 0) + 1
    quick_user = {"X-KV-Next-Use": "0.5"}
    assert call(server, "hinted-quick", filler_window(405, 120), True, quick_user) == "stop"
    time.sleep(0.5)
    now = lifecycle(server)
    assert now.get("idle.hint", 0) == counts.get("idle.hint", 0) + 1
    assert now.get("live.hint", 0) == counts.get("live.hint", 0) + 1
    assert server.engine_stats()["idles"] == after["idles"]


@pytest.mark.parametrize("value", ["soon", "-1", "inf", ""])
def test_a_malformed_next_use_is_a_400_and_serves_nothing(
    vllm_affinity_server: VLLMServer, value: str
) -> None:
    server = vllm_affinity_server
    counts, served = lifecycle(server), server.metric("vllm:request_success_total")
    hints = server.affinity_stats()["api_server"].get("hints.accepted", 0)
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {
        **server.headers(),
        "X-Session-ID": "bad-hint",
        "X-KV-Next-Use": value,
        "X-KV-Release": "messages_released_index=0",  # valid, but the request is refused first
    }
    response = httpx.post(
        server.base_url + "/chat/completions", json=body, headers=headers, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "X-KV-Next-Use" in error["message"] and error["code"] == 400
    assert lifecycle(server).get("invalid", 0) == counts.get("invalid", 0) + 1
    assert server.metric("vllm:request_success_total") == served
    assert server.affinity_stats()["api_server"].get("hints.accepted", 0) == hints


def test_vanilla_vllm_ignores_the_hint(vllm_vanilla_server: VLLMServer) -> None:
    """Installing the hint never makes a call fail where the plugin is absent."""
    reason = call(
        vllm_vanilla_server, "plain", filler_window(406, 40), False, {"X-KV-Next-Use": "x"}
    )
    assert reason == "length"


def test_an_idle_is_not_repeated_for_a_session_back_within_lrus_reach(
    vllm_affinity_server: VLLMServer,
) -> None:
    """The idle guard as shipped (``core/idle_guard.py``): the session answered, went idle
    (or not, as the absences before it say), and came back before the pool evicted a single
    block; so its next answer's idle is not acted on."""
    server = vllm_affinity_server
    messages = filler_window(seed=404, words=120)
    before = server.engine_stats()
    assert call(server, "guarded", messages, answered=True) == "stop"
    first = wait_for_idles(server, before.get("idles", 0) + 1)
    follow_up = [
        *messages,
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "go"},
    ]
    assert call(server, "guarded", follow_up, answered=True) == "stop"
    second = wait_for_idles(server, first["idles"] + 1)
    assert second["idles_returns_soon"] == first.get("idles_returns_soon", 0) + 1
    assert second["blocks_idled"] == first["blocks_idled"]
