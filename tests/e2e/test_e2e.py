"""End to end against real vLLM servers (CPU build, the small local model): one with the plugin,
one vanilla, started once per test run (fixtures of ``vllm_affinity.testing.pytest_plugin``)."""

from __future__ import annotations

import concurrent.futures
import random
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

import jiuwen_hooks
from jiuwen_hooks.testing import TelemetryCapture
from vllm_affinity.testing import (
    BLOCK_SIZE,
    SERVED_NAME,
    VLLMServer,
    filler_text,
    filler_window,
)

pytestmark = pytest.mark.e2e


def text(n_words: int, seed: int) -> str:
    return filler_text(random.Random(seed), n_words)


def window(seed: int, words: int) -> list[dict[str, Any]]:
    return filler_window(seed, words)


def chat(server: VLLMServer, session: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
    client = openai.OpenAI(
        base_url=server.base_url, api_key=server.api_key or "none", max_retries=0
    )
    with client:
        return client.chat.completions.create(
            model=SERVED_NAME,
            messages=messages,
            max_tokens=kw.pop("max_tokens", 8),
            extra_body={"cache_salt": session, "ignore_eos": True, **kw.pop("extra_body", {})},
            extra_headers={"X-Session-ID": session},
            **kw,
        )


def release_body(session: str, messages: list[dict[str, Any]], index: int) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "cache_salt": session,
        "messages": messages,
        "messages_released_index": index,
    }


def engine(server: VLLMServer) -> dict[str, Any]:
    (stats,) = server.affinity_stats()["engines"]
    return stats


def cached_tokens(reply: Any) -> int:
    details = reply.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details else 0


def test_the_server_runs_vllms_default_process_layout(vllm_affinity_server: VLLMServer) -> None:
    """The server these tests share runs as users run vLLM: the model in a worker process of
    its own, a child of the engine core's (``VLLMServer(worker_in_engine=False)``), not in the
    engine core's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the other test servers' layout,
    which vLLM's CPU platform calls unsupported)."""
    server = vllm_affinity_server
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server.env
    titles = {p.pid: (p.name(), p.ppid()) for p in server._process_tree()}
    engines = [pid for pid, (title, _) in titles.items() if title == "VLLM::EngineCore"]
    workers = [ppid for title, ppid in titles.values() if title == "VLLM::Worker"]
    assert len(engines) == 1 and workers == engines, titles


def test_release_moves_exactly_the_stale_blocks(vllm_affinity_server: VLLMServer) -> None:
    server = vllm_affinity_server
    messages = window(seed=1, words=300)
    reply = chat(server, "exact", messages)
    before = engine(server)
    response = server.release(release_body("exact", messages, 3))
    assert response.status_code == 200, response.text
    body = response.json()
    computed = reply.usage.prompt_tokens + reply.usage.completion_tokens - 1
    full_blocks = computed // BLOCK_SIZE  # the partial tail block is uncached: already FREE
    assert body["status"] == "ok"
    assert body["prompt_tokens"] == reply.usage.prompt_tokens
    assert 0 < body["first_stale_block"] < full_blocks
    assert body["block_released"] == full_blocks - body["first_stale_block"]
    after = engine(server)
    assert after["segments"]["released"] - before["segments"]["released"] == body["block_released"]
    repeat = server.release(release_body("exact", messages, 3)).json()
    assert repeat["block_released"] == 0


def test_unknown_session_releases_nothing(vllm_affinity_server: VLLMServer) -> None:
    response = vllm_affinity_server.release(release_body("never-seen", window(2, 20), 1))
    assert response.status_code == 200
    assert response.json()["block_released"] == 0
    assert response.json()["status"] == "unknown_session"


def test_other_sessions_prefix_survives_a_squeeze_side_by_side(
    vllm_affinity_server: VLLMServer, vllm_vanilla_server: VLLMServer
) -> None:
    """B (oldest) and D idle; A (the hot session) compacts; C's new prompt needs more than the
    free blocks. With the plugin C takes A's stale blocks; vanilla LRU evicts B's prefix."""
    results = {}
    for server in (vllm_affinity_server, vllm_vanilla_server):
        tag = "plugin" if server.plugin else "vanilla"
        b_window = window(seed=10, words=85)
        b_first = chat(server, f"B-{tag}", b_window)
        chat(server, f"D-{tag}", window(seed=15, words=280))
        a_window = window(seed=20, words=410)
        a_reply = chat(server, f"A-{tag}", a_window)
        if server.plugin:
            released = server.release(release_body(f"A-{tag}", a_window, 1)).json()
            assert released["block_released"] >= 30, released
        else:
            assert server.release(release_body(f"A-{tag}", a_window, 1)).status_code == 404
        free = engine(server)["segments"]["free"] if server.plugin else None
        c_reply = chat(server, f"C-{tag}", window(seed=30, words=410))
        b_again = chat(server, f"B-{tag}", b_window)
        results[tag] = {
            "b_prompt": b_first.usage.prompt_tokens,
            "a_prompt": a_reply.usage.prompt_tokens,
            "c_prompt": c_reply.usage.prompt_tokens,
            "b_hit": cached_tokens(b_again),
            "free_before_c": free,
        }
    plugin, vanilla = results["plugin"], results["vanilla"]
    # the scenario really squeezes: C needs more blocks than were free
    assert plugin["c_prompt"] // BLOCK_SIZE > plugin["free_before_c"], results
    assert plugin["b_hit"] == (plugin["b_prompt"] - 1) // BLOCK_SIZE * BLOCK_SIZE, results
    assert vanilla["b_hit"] == 0, results
    assert engine(vllm_affinity_server)["released_reused"] > 0


def test_bad_input_gets_4xx_and_changes_nothing(vllm_affinity_server: VLLMServer) -> None:
    server = vllm_affinity_server
    messages = window(seed=40, words=60)
    chat(server, "bad-input", messages)
    before = engine(server)
    huge = [{"role": "user", "content": text(3000, 41)}]
    cases: list[tuple[Any, int]] = [
        ({}, 400),
        ({**release_body("bad-input", messages, 1), "cache_salt": ""}, 400),
        ({**release_body("bad-input", messages, 1), "cache_salt": 7}, 400),
        (release_body("bad-input", messages, -1), 400),
        (release_body("bad-input", messages, 5), 400),
        (release_body("bad-input", [], 0), 400),
        (release_body("bad-input", [{"role": "user", "content": 12}], 0), 400),
        (release_body("bad-input", [{"content": "no role"}], 0), 400),
        ({**release_body("bad-input", messages, 1), "tools": [{"type": "nope"}]}, 400),
        ({**release_body("bad-input", messages, 1), "tools_released_index": 0}, 400),
        (release_body("bad-input", [*huge, *messages], 1), 400),
        ({**release_body("bad-input", messages, 1), "model": "no-such-model"}, 404),
    ]
    for body, status in cases:
        response = server.release(body)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert error["code"] == status and error["message"]
    raw = httpx.post(
        server.root_url + "/release_kv_cache",
        content=b"{not json",
        headers={**server.headers(), "Content-Type": "application/json"},
    )
    assert raw.status_code == 400
    after = engine(server)
    assert after["segments"] == before["segments"]
    assert after.get("releases", 0) == before.get("releases", 0)


def test_api_key_is_enforced(vllm_affinity_server: VLLMServer) -> None:
    server = vllm_affinity_server
    body = release_body("auth", window(50, 20), 1)
    assert server.release(body, headers={}).status_code == 401
    assert server.release(body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert server.release(body).status_code == 200
    assert httpx.get(server.root_url + "/affinity/stats").status_code == 401


def test_metrics_show_segments(vllm_affinity_server: VLLMServer) -> None:
    server = vllm_affinity_server
    messages = window(seed=57, words=60)
    chat(server, "metrics", messages)
    requests = server.metric("vllm_affinity_release_requests_total", outcome="ok")
    blocks = server.metric("vllm_affinity_block_released_total")
    calls = engine(server)["utility_calls"]
    released = server.release(release_body("metrics", messages, 1)).json()["block_released"]
    assert released > 0
    stats = engine(server)  # also refreshes the snapshot behind /metrics
    for segment, count in stats["segments"].items():
        assert server.metric("vllm_affinity_blocks", segment=segment) == count
    assert server.metric("vllm_affinity_release_requests_total", outcome="ok") == requests + 1
    assert server.metric("vllm_affinity_block_released_total") == blocks + released
    # the plugin's own time on the scheduler path, and the steps to divide it by
    assert stats["engine_steps"] > 0 and stats["engine_us"] > 0
    spent = server.metric("vllm_affinity_engine_seconds_total")
    assert server.metric("vllm_affinity_engine_steps_total") == stats["engine_steps"]
    # /metrics shows the snapshot of the last stats call, that one or a later refresh (every
    # 2 s), which counts the utility call that answered this one: between the two readings
    later = engine(server)
    assert stats["engine_us"] / 1e6 - 1e-6 <= spent <= later["engine_us"] / 1e6 + 1e-6, (
        stats["engine_us"],
        spent,
        later["engine_us"],
    )
    per_step = stats["engine_us"] / stats["engine_steps"]
    assert per_step < 50_000, f"{per_step:.0f} µs of the plugin per step"
    # engine utility calls count in that time: the stats call before and the release (a call
    # is counted once it has answered, so the last stats call is not in its own figures)
    assert stats["utility_calls"] >= calls + 2
    assert 0 < stats["utility_us_max"] <= stats["utility_us"] <= stats["engine_us"]


def test_concurrent_releases_during_generation(vllm_affinity_server: VLLMServer) -> None:
    server = vllm_affinity_server
    sessions = [f"busy-{i}" for i in range(6)]
    windows = {s: window(seed=60 + i, words=120) for i, s in enumerate(sessions)}
    for s in sessions:
        chat(server, s, windows[s], max_tokens=2)

    def generate(s: str) -> int:
        return chat(server, s, windows[s], max_tokens=48).usage.completion_tokens

    def release(s: str) -> int:
        return server.release(release_body(s, windows[s], 2)).status_code

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        gens = [pool.submit(generate, s) for s in sessions]
        rels = [pool.submit(release, s) for s in sessions for _ in range(3)]
        assert all(f.result() == 48 for f in gens)
        assert all(f.result() == 200 for f in rels)
    assert httpx.get(server.root_url + "/health").status_code == 200
    stats = engine(server)
    assert stats["pending"] == 0
    assert sum(stats["segments"].values()) == stats["num_blocks"] - 1  # nothing in use, no leak


def test_cache_sharing_shares_prefixes_across_sessions(vllm_affinity_server: VLLMServer) -> None:
    server = vllm_affinity_server
    shared = window(seed=70, words=200)
    chat(server, "share-1", shared, extra_body={"cache_sharing": True})
    second = chat(server, "share-2", shared, extra_body={"cache_sharing": True})
    salted = chat(server, "share-3", shared)  # no sharing: its own salt, no hit
    assert cached_tokens(second) >= (second.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert cached_tokens(salted) == 0
    # a release by one sharing session keeps the blocks the other still uses
    body = {**release_body("share-1", shared, 0), "cache_sharing": True}
    result = server.release(body).json()
    assert result["kept_shared"] >= second.usage.prompt_tokens // BLOCK_SIZE - 1


def test_installed_hook_posts_when_in_request_is_off(
    vllm_affinity_server: VLLMServer,
    jiuwen_hook_factory: Callable[..., jiuwen_hooks.Hook],
    jiuwen_telemetry: TelemetryCapture,
) -> None:
    server = vllm_affinity_server
    hook = jiuwen_hook_factory(in_request=False)
    client = openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)
    messages = window(seed=80, words=400)
    with jiuwen_hooks.session("hooked"):
        client.chat.completions.create(
            model=SERVED_NAME, messages=messages, max_tokens=4, extra_body={"ignore_eos": True}
        )
        messages[3] = {**messages[3], "content": "[Old tool result content cleared]"}
        reply = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=4)
    client.close()
    stats = hook.stats()
    assert reply.choices[0].message is not None
    assert stats["releases.ok"] == 1
    (span,) = jiuwen_telemetry.spans("kv_cache.release")
    assert span.attributes["jiuwen.release.messages_released_index"] == 3
    assert span.attributes["jiuwen.release.block_released"] > 0
    assert stats["block_released"] == span.attributes["jiuwen.release.block_released"]


def test_end_session_releases_the_session_whole(
    vllm_affinity_server: VLLMServer, jiuwen_hook_factory: Callable[..., jiuwen_hooks.Hook]
) -> None:
    """``jiuwen_hooks.end_session``: every block of the session that no other session holds goes
    to the released segment; the shared system prompt stays."""
    server = vllm_affinity_server
    hook = jiuwen_hook_factory()
    shared = {"role": "system", "content": text(120, seed=90)}
    with openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0) as c:
        for session, seed in (("ending", 91), ("staying", 92)):
            with jiuwen_hooks.session(session):
                c.chat.completions.create(
                    model=SERVED_NAME, max_tokens=4,
                    messages=[shared, {"role": "user", "content": text(300, seed)}],
                )  # fmt: skip
    before = engine(server)
    jiuwen_hooks.end_session("ending")
    hook.flush()
    stats = hook.stats()
    after = engine(server)
    assert stats["end_session.released"] == 1 and stats["releases.ok"] == 1
    released = after["segments"]["released"] - before["segments"]["released"]
    shared_blocks = len(server.tokenize([shared])) // BLOCK_SIZE
    own_blocks = len(server.tokenize([shared, {"role": "user", "content": text(300, 91)}]))
    assert 0 < released <= own_blocks // BLOCK_SIZE - shared_blocks + 1
    assert after["releases_ok"] == before.get("releases_ok", 0) + 1
