"""End to end: a session belongs to the caller that made it. The shared plugin server takes
two API keys (A and B) and reads a tenant header set by a (trusted) gateway. On every release
path, B naming A's session neither moves A's blocks nor gets an answer that tells a right guess
of A's prompt from a wrong one; A's own releases still work; a client's ``vllm_xargs`` cannot
pose as another principal."""

from __future__ import annotations

import string
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_affinity.core.tenants import key_principal
from vllm_affinity.testing import SERVED_NAME, VLLMServer, filler_window
from vllm_affinity.testing.pytest_plugin import API_KEY, SECOND_API_KEY, TENANT_HEADER

pytestmark = pytest.mark.e2e

KEY_A, KEY_B = API_KEY, SECOND_API_KEY
TIMING = ("render_ms", "engine_ms")


@pytest.fixture
def server(vllm_affinity_server: VLLMServer) -> VLLMServer:
    """The shared plugin server: it takes two keys and reads the tenant header."""
    return vllm_affinity_server


def auth(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


def chat(
    server: VLLMServer, key: str, session: str, window: list[dict[str, Any]], **headers: str
) -> None:
    with openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0) as client:
        client.chat.completions.create(
            model=SERVED_NAME,
            messages=window,  # type: ignore[arg-type]
            max_tokens=2,
            extra_headers={"X-Session-ID": session, **headers},
        )


def release_body(session: str, window: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": SERVED_NAME, "cache_salt": session, "cache_sharing": True,
            "messages": window, "messages_released_index": 2}  # fmt: skip


def post(server: VLLMServer, key: str, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    response = server.release(body, headers=auth(key, **headers))
    assert response.status_code == 200, response.text
    return {k: v for k, v in response.json().items() if k not in TIMING}


def demotions(server: VLLMServer) -> dict[str, int]:
    """What every release or idle signal counts when it moves a block: any change here touched
    somebody's blocks. (Segment sizes would not do: any allocation takes released blocks.)"""
    stats = server.engine_stats()
    names = ("blocks_moved", "blocks_pending", "blocks_idled", "blocks_protected")
    return {name: stats.get(name, 0) for name in names}


def test_post_release_of_another_keys_session_is_no_oracle(server: VLLMServer) -> None:
    window = filler_window(seed=701, words=300)
    chat(server, KEY_A, "tenants-post", window)
    before = demotions(server)
    right = post(server, KEY_B, release_body("tenants-post", window))
    wrong = post(server, KEY_B, release_body("tenants-post", filler_window(seed=702, words=300)))
    assert right == wrong  # the same answer for a right and a wrong guess of A's prompt
    assert right["status"] == "unknown_session" and right["block_released"] == 0
    assert demotions(server) == before
    own = post(server, KEY_A, release_body("tenants-post", window))
    assert own["status"] == "ok" and own["block_released"] > 0


def test_in_request_hint_on_another_keys_session_releases_nothing(server: VLLMServer) -> None:
    window = filler_window(seed=711, words=300)
    chat(server, KEY_A, "tenants-hint", window)
    before, moved = server.engine_stats(), demotions(server)
    rewritten = window[:2] + filler_window(seed=712, words=100)[2:]
    chat(server, KEY_B, "tenants-hint", rewritten, **{"X-KV-Release": "messages_released_index=2"})
    after = server.engine_stats()
    assert after.get("block_released_in_request", 0) == before.get("block_released_in_request", 0)
    assert demotions(server) == moved
    chat(server, KEY_A, "tenants-hint", rewritten, **{"X-KV-Release": "messages_released_index=2"})
    mine = server.engine_stats()
    assert mine["block_released_in_request"] > after.get("block_released_in_request", 0)


def test_a_client_cannot_pose_as_another_principal_in_vllm_xargs(server: VLLMServer) -> None:
    window = filler_window(seed=721, words=300)
    chat(server, KEY_A, "tenants-xargs", window)
    before, moved = server.engine_stats(), demotions(server)
    spoofed = {"vllm_xargs": {"kv_principal": key_principal(KEY_A),
                              "kv_release": "messages_released_index=2"}}  # fmt: skip
    with openai.OpenAI(base_url=server.base_url, api_key=KEY_B, max_retries=0) as client:
        client.chat.completions.create(
            model=SERVED_NAME, messages=window[:2], max_tokens=2,  # type: ignore[arg-type]
            extra_headers={"X-Session-ID": "tenants-xargs"}, extra_body=spoofed,
        )  # fmt: skip
    after = server.engine_stats()
    assert after.get("block_released_in_request", 0) == before.get("block_released_in_request", 0)
    assert demotions(server) == moved


def test_agent_hint_evict_of_another_keys_session_is_no_oracle(server: VLLMServer) -> None:
    window = filler_window(seed=731, words=300)
    chat(server, KEY_A, "tenants-agent-hint", window)
    before = demotions(server)

    def evict(key: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
        body = {
            "model": SERVED_NAME, "messages": messages, "max_tokens": 1,
            "agent_hint": {"session_id": "tenants-agent-hint", "context_management": {
                "manage_request": True,
                "edits": [{"type": "evict", "target": "messages", "start": 2, "end": 4}]}},
        }  # fmt: skip
        response = httpx.post(
            server.base_url + "/chat/completions", json=body, headers=auth(key), timeout=60
        )
        assert response.status_code == 200, response.text
        figures = response.json()["kv_cache"]
        return {k: v for k, v in figures.items() if k not in TIMING}

    right, wrong = evict(KEY_B, window), evict(KEY_B, filler_window(seed=732, words=300))
    assert right == wrong and right["status"] == "unknown_session"
    assert demotions(server) == before
    assert evict(KEY_A, window)["block_released"] > 0


def test_next_use_on_another_keys_session_name_leaves_its_record(server: VLLMServer) -> None:
    """B's calls under A's session name (an idle hint included) bind and idle B's own session:
    A's record stays, so A's release still finds its cache."""
    window = filler_window(seed=741, words=300)
    chat(server, KEY_A, "tenants-idle", window)
    chat(
        server, KEY_B, "tenants-idle", filler_window(seed=742, words=300), **{"X-KV-Next-Use": "60"}
    )
    own = post(server, KEY_A, release_body("tenants-idle", window))
    assert own["status"] == "ok" and own["block_released"] > 0


def test_the_gateways_tenant_header_scopes_sessions_over_one_key(server: VLLMServer) -> None:
    window = filler_window(seed=751, words=300)
    chat(server, KEY_A, "tenants-header", window, **{TENANT_HEADER: "team-1"})
    before = demotions(server)
    other = post(server, KEY_A, release_body("tenants-header", window), **{TENANT_HEADER: "team-2"})
    keyed = post(server, KEY_A, release_body("tenants-header", window))  # no header: the key's
    assert other["status"] == keyed["status"] == "unknown_session"
    assert demotions(server) == before
    own = post(server, KEY_A, release_body("tenants-header", window), **{TENANT_HEADER: "team-1"})
    assert own["status"] == "ok" and own["block_released"] > 0


def test_fuzzed_tenant_header_values_never_break_a_call(server: VLLMServer) -> None:
    """Whatever the tenant header holds (empty, long, odd characters), a chat with a release
    hint and a POST release are served or refused cleanly, never a 5xx."""
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    @settings(max_examples=25, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(value=st.text(string.printable.strip() + " ", max_size=300).map(str.strip))
    def one(value: str) -> None:
        headers = auth(KEY_B, **{TENANT_HEADER: value, "X-Session-ID": "tenants-fuzz",
                                 "X-KV-Release": "messages_released_index=1"})  # fmt: skip
        with httpx.Client(base_url=server.root_url, timeout=60) as http:
            chat = http.post("/v1/chat/completions", json=body, headers=headers)
            assert chat.status_code == 200, chat.text
            release = http.post(
                "/release_kv_cache", json=release_body("tenants-fuzz", body["messages"] * 3),
                headers=headers,
            )  # fmt: skip
            assert release.status_code == 200, release.text

    one()


def test_the_cached_block_list_is_refused_on_a_server_of_several_tenants(
    server: VLLMServer,
) -> None:
    """``/affinity/check?blocks=true`` lists every cached block's hash: on this server of two
    keys and a tenant header it would fingerprint the other tenant's cache, so it is refused;
    the plain check (counts only) still answers."""
    url = server.root_url + "/affinity/check"
    refused = httpx.get(url, params={"blocks": "true"}, headers=auth(KEY_B), timeout=30)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["type"] == "PermissionDeniedError"
    plain = httpx.get(url, headers=auth(KEY_B), timeout=30)
    assert plain.status_code == 200 and "cached_blocks" not in plain.json()["engines"][0]
