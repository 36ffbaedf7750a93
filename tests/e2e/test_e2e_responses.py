"""End to end on the real plugin server: the Responses API. A compaction of ``input`` releases
exactly the stale blocks, by POST (the plugin renders the cut window as vLLM's Responses endpoint
does) and in the request itself (``X-KV-Release`` on ``POST /v1/responses``); malformed Responses
releases get vLLM's 400."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

import jiuwen_hooks
from vllm_affinity.core import common_prefix_length
from vllm_affinity.testing import BLOCK_SIZE, SERVED_NAME, VLLMServer, filler_text

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("clean_hook")]

INSTRUCTIONS = "You are a research agent."


def history(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {"role": "user", "content": filler_text(rng, 60)},
        {"role": "assistant", "content": filler_text(rng, 60)},
        {"role": "user", "content": filler_text(rng, 60)},
        {"role": "assistant", "content": filler_text(rng, 60)},
    ]


@pytest.mark.parametrize("mode", ["post", "in_request"])
def test_compaction_releases_exactly(
    vllm_affinity_server: VLLMServer,
    jiuwen_hook_factory: Callable[..., jiuwen_hooks.Hook],
    mode: str,
) -> None:
    server = vllm_affinity_server
    hook = jiuwen_hook_factory(in_request=mode == "in_request")
    items = history(31 if mode == "post" else 32)
    client = openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)
    with client, jiuwen_hooks.session(f"responses-{mode}"):
        first = client.responses.create(
            model=SERVED_NAME, instructions=INSTRUCTIONS, input=items, max_output_tokens=4
        )
        hook.flush()
        before = server.engine_stats()
        compacted = [*items[:2], {"role": "user", "content": "summary: nothing new"}]
        client.responses.create(
            model=SERVED_NAME, instructions=INSTRUCTIONS, input=compacted, max_output_tokens=2
        )
        hook.flush()
    after = server.engine_stats()
    system = {"role": "system", "content": INSTRUCTIONS}
    old = server.tokenize([system, *items])
    cut = server.tokenize([system, *items[:2]])  # window index 3 = input[2] is stale
    first_stale = common_prefix_length(old, cut) // BLOCK_SIZE
    usage = first.usage
    cached = (usage.input_tokens + usage.output_tokens - 1) // BLOCK_SIZE
    assert after[f"releases_{mode}"] - before.get(f"releases_{mode}", 0) == 1
    released = after[f"block_released_{mode}"] - before.get(f"block_released_{mode}", 0)
    assert released == cached - first_stale
    assert released > 0
    stats = hook.stats()
    assert stats[f"releases.{'ok' if mode == 'post' else 'in_request'}"] == 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": [{"type": "no_such_item"}]}, "invalid input"),
        (
            {"input": [{"role": "user", "content": "x"}], "messages": [{"role": "user"}]},
            "exactly one",
        ),
        ({"instructions": "x", "messages": [{"role": "user", "content": "x"}]}, "instructions"),
        ({"input": [{"role": "user", "content": "x"}], "messages_released_index": 3}, "beyond"),
    ],
)
def test_malformed_responses_release_is_a_400(
    vllm_affinity_server: VLLMServer, body: dict[str, Any], message: str
) -> None:
    server = vllm_affinity_server
    payload = {"model": SERVED_NAME, "cache_salt": "bad", "messages_released_index": 1, **body}
    before = server.engine_stats()
    response = httpx.post(
        server.root_url + "/release_kv_cache", json=payload, headers=server.headers()
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == 400
    after = server.engine_stats()
    assert after.get("releases_post", 0) == before.get("releases_post", 0)
