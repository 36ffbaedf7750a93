"""Abuse of the real plugin server: a hypothesis fuzz of ``POST /release_kv_cache`` (wrong types,
huge or negative indices, deep or huge bodies, unicode, missing fields, wrong model, bad auth)
and of the ``X-KV-Release`` header. The only answers are 200 or 4xx, never 5xx, and a 4xx
changes nothing in the engine."""

from __future__ import annotations

import json
import os
import string
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_affinity.testing import SERVED_NAME, VLLMServer

pytestmark = pytest.mark.e2e

EXAMPLES = int(os.environ.get("JIUWEN_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "bogus"]) | json_values},
    optional={"content": st.text(max_size=300) | json_values, "tool_call_id": json_values},
)
item = message | st.fixed_dictionaries(
    {"type": st.sampled_from(["function_call", "function_call_output", "reasoning", "x"])},
    optional={"call_id": json_values, "name": json_values, "output": json_values},
)
index = st.integers(-3, 8) | st.integers(-(2**70), 2**70) | json_values
FIELDS = {
    "model": st.sampled_from([SERVED_NAME, "", "no-such-model"]) | json_values,
    "cache_salt": st.sampled_from(["fuzz", ""]) | st.text(max_size=600) | json_values,
    "cache_sharing": st.booleans() | json_values,
    "messages": st.lists(message, max_size=4) | json_values,
    "input": st.lists(item, max_size=4) | json_values,
    "instructions": st.text(max_size=50) | json_values,
    "messages_released_index": index,
    "tools": st.lists(json_values, max_size=3) | json_values,
    "tools_released_index": index,
}
bodies = st.fixed_dictionaries({}, optional=FIELDS)


@pytest.fixture(scope="module")
def http(vllm_affinity_server: VLLMServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vllm_affinity_server.root_url, timeout=60) as client:
        yield client


def engine_releases(server: VLLMServer) -> int:
    return sum(e.get("releases", 0) for e in server.affinity_stats()["engines"])


def post(http: httpx.Client, server: VLLMServer, content: bytes, **headers: str) -> httpx.Response:
    all_headers = {**server.headers(), "Content-Type": "application/json", **headers}
    return http.post("/release_kv_cache", content=content, headers=all_headers)


def assert_clean(server: VLLMServer, response: httpx.Response, releases_before: int) -> None:
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text
    if response.status_code != 200:
        assert engine_releases(server) == releases_before, response.text  # nothing changed
        if response.status_code != 401:
            error = response.json()["error"]  # vLLM's ErrorResponse shape
            assert error["code"] == response.status_code and error["message"]


def test_fuzzed_release_bodies(vllm_affinity_server: VLLMServer, http: httpx.Client) -> None:
    server = vllm_affinity_server
    seen: set[int] = set()

    @FUZZ
    @given(body=bodies)
    def one(body: dict[str, Any]) -> None:
        before = engine_releases(server)
        response = post(http, server, json.dumps(body).encode())
        seen.add(response.status_code)
        assert_clean(server, response, before)

    one()
    assert 400 in seen  # the fuzz reached validation


def test_fuzzed_raw_bytes_and_auth(vllm_affinity_server: VLLMServer, http: httpx.Client) -> None:
    server = vllm_affinity_server

    @FUZZ
    @given(
        content=st.binary(max_size=200) | st.text(max_size=200).map(str.encode),
        token=st.text(string.printable.strip(), max_size=30),
    )
    def one(content: bytes, token: str) -> None:
        before = engine_releases(server)
        response = post(http, server, content)
        assert_clean(server, response, before)
        wrong = post(http, server, content, Authorization=f"Bearer x{token}")
        assert wrong.status_code == 401

    one()


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_bodies_are_a_400(
    vllm_affinity_server: VLLMServer, http: httpx.Client, depth: int
) -> None:
    content = ("[" * depth + "]" * depth).encode()
    body = (
        b'{"model": "m", "cache_salt": "s", "messages_released_index": 0, "messages": '
        + content
        + b"}"
    )
    response = post(http, vllm_affinity_server, body)
    assert response.status_code == 400, response.text


def test_oversized_body_is_a_413(vllm_affinity_server: VLLMServer, http: httpx.Client) -> None:
    server = vllm_affinity_server
    before = engine_releases(server)
    huge = b'{"messages": ["' + b"x" * (33 * 1024 * 1024) + b'"]}'
    response = post(http, server, huge)
    assert response.status_code == 413 and "over" in response.json()["error"]["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        yield b'{"messages": ["'
        for _ in range(34):
            yield b"x" * (1024 * 1024)

    response = http.post("/release_kv_cache", content=chunked(), headers=server.headers())
    assert response.status_code == 413
    assert engine_releases(server) == before


HINTED_REQUESTS = {
    "/v1/chat/completions": {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
    },
    "/v1/responses": {"model": SERVED_NAME, "input": "hi", "max_output_tokens": 16},
}  # fmt: skip


@pytest.mark.parametrize("path", list(HINTED_REQUESTS))
def test_fuzzed_release_header(
    vllm_affinity_server: VLLMServer, http: httpx.Client, path: str
) -> None:
    server = vllm_affinity_server
    body = HINTED_REQUESTS[path]

    @settings(
        max_examples=max(EXAMPLES // 3, 10),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(value=st.text(string.printable.strip() + " ", max_size=60).map(str.strip))
    def one(value: str) -> None:
        headers = {**server.headers(), "X-Session-ID": "fuzz-hint", "X-KV-Release": value}
        response = http.post(path, json=body, headers=headers)
        assert response.status_code in (200, 400), response.text

    one()
