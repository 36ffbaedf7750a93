"""End to end on real vLLM servers: the hook is neutral where the plugin is absent, releases ride
on the chat request where it is present (no extra HTTP), exactly (block-hash chains, whatever the
template does), before that request allocates; and the openJiuwen 0.1.16 POST contract still
works."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

import jiuwen_hooks
from jiuwen_hooks.testing import TelemetryCapture
from vllm_affinity.core import common_prefix_length
from vllm_affinity.testing import BLOCK_SIZE, SERVED_NAME, VLLMServer, filler_text, filler_window

pytestmark = pytest.mark.e2e

#: Like the model's own template, but earlier turns' reasoning (``<think>...</think>``) is dropped
#: once a newer user message follows, as Qwen3-style templates do: a pure rewrite of message k
#: changes the rendered tokens *before* k.
DROPS_REASONING = (
    "{{ bos_token }}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{%- for message in messages %}<|{{ message['role'] }}|>"
    "{%- if message['role'] == 'assistant' and '</think>' in message['content']"
    " and loop.index0 < ns.last_user %}{{ message['content'].split('</think>')[-1] }}"
    "{%- else %}{{ message['content'] }}{% endif %}</s>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


def client_of(server: VLLMServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.api_key or "none", max_retries=0)


def engine(server: VLLMServer) -> dict[str, Any]:
    (stats,) = server.affinity_stats()["engines"]
    return stats


def grew(before: dict[str, Any], after: dict[str, Any], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def release_posts(server: VLLMServer) -> float:
    """``POST /release_kv_cache`` requests the server has handled, whatever their outcome."""
    return server.metric("http_requests_total", handler="/release_kv_cache")


def prefix_cache(server: VLLMServer) -> tuple[float, float]:
    return (
        server.metric("vllm:prefix_cache_queries_total"),
        server.metric("vllm:prefix_cache_hits_total"),
    )


def tokens(
    server: VLLMServer, messages: list[dict[str, Any]], template: str | None = None
) -> list[int]:
    body: dict[str, Any] = {"model": SERVED_NAME, "messages": messages}
    if template is not None:
        body["chat_template"] = template
    response = httpx.post(server.root_url + "/tokenize", json=body, headers=server.headers())
    response.raise_for_status()
    return response.json()["tokens"]


def test_in_request_release_is_exact_and_costs_no_round_trip(
    vllm_affinity_server: VLLMServer,
    jiuwen_hook_factory: Callable[..., jiuwen_hooks.Hook],
    jiuwen_telemetry: TelemetryCapture,
) -> None:
    server = vllm_affinity_server
    hook = jiuwen_hook_factory()
    rng = random.Random(7)
    window = [
        {"role": "system", "content": "You are agent 7."},
        {"role": "user", "content": filler_text(rng, 100)},
        {"role": "assistant", "content": f"<think>{filler_text(rng, 100)}</think>done"},
        {"role": "tool", "tool_call_id": "c1", "content": filler_text(rng, 100)},
    ]
    extra = {"chat_template": DROPS_REASONING, "ignore_eos": True}
    with client_of(server) as client, jiuwen_hooks.session("in-request-exact"):
        first = client.chat.completions.create(
            model=SERVED_NAME, messages=window, max_tokens=8, extra_body=extra
        )
        hook.flush()  # the capability probe has answered
        before, posts_before = engine(server), release_posts(server)
        rewritten = [*window[:3], {"role": "tool", "tool_call_id": "c1", "content": "[cleared]"}]
        rewritten.append({"role": "user", "content": "next"})
        client.chat.completions.create(
            model=SERVED_NAME, messages=rewritten, max_tokens=2, extra_body=extra
        )
    after = engine(server)
    # the hook saw message 3 change; the template also re-renders message 2 without its reasoning
    old, new = tokens(server, window, DROPS_REASONING), tokens(server, rewritten, DROPS_REASONING)
    cut = tokens(server, window[:3], DROPS_REASONING)
    first_stale = common_prefix_length(old, new) // BLOCK_SIZE
    assert first_stale < common_prefix_length(old, cut) // BLOCK_SIZE  # earlier than message 3
    cached_blocks = (first.usage.prompt_tokens + first.usage.completion_tokens - 1) // BLOCK_SIZE
    assert grew(before, after, "releases_in_request") == 1
    assert grew(before, after, "block_released_in_request") == cached_blocks - first_stale
    assert grew(before, after, "releases_post") == 0
    assert release_posts(server) == posts_before  # no extra HTTP request
    stats = hook.stats()
    assert stats["releases.in_request"] == 1 and "releases.ok" not in stats
    assert stats["engines"] == {server.root_url: "in_request"}
    (span,) = jiuwen_telemetry.spans("kv_cache.release")
    assert span.attributes["jiuwen.release.mode"] == "in_request"
    assert span.attributes["jiuwen.release.messages_released_index"] == 3


def test_in_request_release_serves_that_very_request_side_by_side(
    vllm_affinity_server: VLLMServer,
    vllm_vanilla_server: VLLMServer,
    jiuwen_hook_factory: Callable[..., jiuwen_hooks.Hook],
) -> None:
    """B (oldest) and D idle; A rewrites its history and its new prompt needs more blocks than
    are free. With the plugin the hint frees A's stale blocks before A's request allocates, so B's
    prefix survives; on vanilla (the same hook installed) LRU evicts B's."""
    hook = jiuwen_hook_factory()
    results = {}
    for server in (vllm_affinity_server, vllm_vanilla_server):
        tag = "plugin" if server.plugin else "vanilla"
        with client_of(server) as client:
            call = squeezer(client, tag)
            b_window = filler_window(110, 85)
            b_first = call("B", b_window)
            call("D", filler_window(115, 280))
            a_window = filler_window(120, 410)
            call("A", a_window)
            hook.flush()
            before = engine(server) if server.plugin else {}
            a_window[1] = {"role": "user", "content": filler_text(random.Random(121), 205)}
            a_again = call("A", a_window)
            after = engine(server) if server.plugin else {}
            b_again = call("B", b_window)
        details = b_again.usage.prompt_tokens_details
        results[tag] = {
            "b_prompt": b_first.usage.prompt_tokens,
            "a_prompt": a_again.usage.prompt_tokens,
            "b_hit": (details.cached_tokens or 0) if details else 0,
            "free_before": before.get("segments", {}).get("free"),
            "reused": grew(before, after, "released_reused") if server.plugin else None,
            "in_request": grew(before, after, "releases_in_request") if server.plugin else None,
        }
    plugin, vanilla = results["plugin"], results["vanilla"]
    assert plugin["a_prompt"] // BLOCK_SIZE > plugin["free_before"], results  # a real squeeze
    assert plugin["in_request"] == 1 and plugin["reused"] > 0, results
    assert plugin["b_hit"] == (plugin["b_prompt"] - 1) // BLOCK_SIZE * BLOCK_SIZE, results
    assert vanilla["b_hit"] == 0, results
    assert hook.stats()["engines"] == {
        vllm_affinity_server.root_url: "in_request",
        vllm_vanilla_server.root_url: "unsupported",
    }


def squeezer(client: openai.OpenAI, tag: str) -> Any:
    def call(session: str, messages: list[dict[str, Any]]) -> Any:
        with jiuwen_hooks.session(f"{session}-squeeze-{tag}"):
            return client.chat.completions.create(
                model=SERVED_NAME, messages=messages, max_tokens=4, extra_body={"ignore_eos": True}
            )

    return call


@pytest.mark.parametrize("server_name", ["vllm_vanilla_server", "vllm_affinity_server"])
def test_sessions_sharing_a_system_prompt_hit_alike_with_and_without_the_hook(
    server_name: str,
    request: pytest.FixtureRequest,
    jiuwen_hook_factory: Callable[..., jiuwen_hooks.Hook],
) -> None:
    """Six sessions share a long system prompt. The hook (header only) must not change the hit
    rate. The old default (a ``cache_salt`` per session, with ``cache_sharing``) is measured too:
    it splits vanilla's cache per session (which shows the test can tell), while the plugin
    honours ``cache_sharing``."""
    server: VLLMServer = request.getfixturevalue(server_name)
    jiuwen_hooks.uninstall()
    rates = {}
    for seed, mode in enumerate(("no hook", "hook", "hook + session_body")):
        if mode != "no hook":
            jiuwen_hook_factory(session_body=mode == "hook + session_body")
        system = f"{seed} " + filler_text(random.Random(1000), 300)  # same length each run
        queries, hits = prefix_cache(server)
        try:
            with client_of(server) as client:
                for i in range(6):
                    window = [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"question {i} from session {i}"},
                    ]
                    with jiuwen_hooks.session(f"share-{server_name}-{seed}-{i}"):
                        client.chat.completions.create(
                            model=SERVED_NAME, messages=window, max_tokens=2
                        )
        finally:
            jiuwen_hooks.uninstall()
        queries_after, hits_after = prefix_cache(server)
        rates[mode] = (hits_after - hits) / (queries_after - queries)
    print(f"prefix-cache hit rate on {server_name}: {rates}")
    assert rates["no hook"] > 0.7, rates
    assert abs(rates["hook"] - rates["no hook"]) <= 0.01, rates
    if server_name == "vllm_vanilla_server":
        assert rates["hook + session_body"] < rates["no hook"] - 0.3, rates
    else:
        assert abs(rates["hook + session_body"] - rates["no hook"]) <= 0.01, rates


def test_seed_contract_client_still_works(vllm_affinity_server: VLLMServer) -> None:
    """The openJiuwen 0.1.16 path: ``cache_salt`` + ``cache_sharing: true`` in the chat body, no
    session header, then ``POST /release_kv_cache`` with the old window."""
    server = vllm_affinity_server
    messages = filler_window(130, 300)
    with client_of(server) as client:
        reply = client.chat.completions.create(
            model=SERVED_NAME,
            messages=messages,
            max_tokens=8,
            extra_body={"cache_salt": "seed-client", "cache_sharing": True, "ignore_eos": True},
        )
    body = {
        "model": SERVED_NAME,
        "cache_salt": "seed-client",
        "cache_sharing": True,
        "messages": messages,
        "messages_released_index": 3,
    }
    result = server.release(body).json()
    cut = tokens(server, messages[:3])
    cached_blocks = (reply.usage.prompt_tokens + reply.usage.completion_tokens - 1) // BLOCK_SIZE
    assert result["status"] == "ok"
    assert result["prompt_tokens"] == reply.usage.prompt_tokens
    assert result["block_released"] == cached_blocks - result["first_stale_block"]
    assert (
        result["first_stale_block"]
        == common_prefix_length(tokens(server, messages), cut) // BLOCK_SIZE
    )
    assert result["capabilities"]["in_request_release"] is True
    assert server.release(body).json()["block_released"] == 0  # idempotent


def test_malformed_hint_gets_vllms_400_and_changes_nothing(
    vllm_affinity_server: VLLMServer,
) -> None:
    server = vllm_affinity_server
    messages = filler_window(140, 60)
    headers = {**server.headers(), "X-Session-ID": "bad-hint"}
    body = {"model": SERVED_NAME, "messages": messages, "max_tokens": 2}
    url = server.base_url + "/chat/completions"
    assert httpx.post(url, json=body, headers=headers, timeout=60).status_code == 200
    before = engine(server)
    response = httpx.post(
        url,
        json=body,
        headers={**headers, "X-KV-Release": "messages_released_index=-3"},
        timeout=60,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == 400 and "X-KV-Release" in error["message"]
    after = engine(server)
    assert after["segments"] == before["segments"]
    assert grew(before, after, "releases") == 0
    assert server.metric("vllm_affinity_release_hints_total", outcome="invalid") >= 1


def test_release_on_divergence_without_a_hint(second_plugin_server: VLLMServer) -> None:
    """``VLLM_AFFINITY_RELEASE_ON_DIVERGENCE=true``: a client that cannot send the hint (plain
    requests with only ``X-Session-ID``) still has its rewritten history released."""
    server = second_plugin_server
    window = filler_window(150, 300)
    headers = {"X-Session-ID": "diverging"}
    with client_of(server) as client:
        first = client.chat.completions.create(
            model=SERVED_NAME,
            messages=window,
            max_tokens=8,
            extra_headers=headers,
            extra_body={"ignore_eos": True},
        )
        before = engine(server)
        rewritten = [*window[:2], {"role": "user", "content": "[summary]"}]
        client.chat.completions.create(
            model=SERVED_NAME, messages=rewritten, max_tokens=2, extra_headers=headers
        )
        after = engine(server)
        appended = [*rewritten, {"role": "assistant", "content": "ok"}]
        client.chat.completions.create(
            model=SERVED_NAME, messages=appended, max_tokens=2, extra_headers=headers
        )
        last = engine(server)
    old, new = tokens(server, window), tokens(server, rewritten)
    first_stale = common_prefix_length(old, new) // BLOCK_SIZE
    cached_blocks = (first.usage.prompt_tokens + first.usage.completion_tokens - 1) // BLOCK_SIZE
    assert grew(before, after, "releases_divergence") == 1
    assert grew(before, after, "block_released_divergence") == cached_blocks - first_stale
    assert grew(after, last, "releases_divergence") == 1  # compared every time...
    assert grew(after, last, "block_released_divergence") <= 1  # ...an append frees ~nothing
