"""The plugin fails open inside vLLM's engine (``vllm_affinity/engine/fail_open.py``), on a real
server: with a failure injected into every other call of each engine path the plugin runs
(request add, step binding, free, prefix lookup, block handout, picker, utility), every
request is still served and the engine stays up; each path's failures are counted; once the
faults stop, the plugin acts again and the pool's invariants hold.

The model is the every-layer-sliding-window one (Mistral 7B v0.1's shape): one KV-cache group,
so the picker runs, and a sliding window, so the instructions' checkpoint (the prefix lookup's
path) does too. The failures are injected by ``engine_faults_site/sitecustomize.py``, switched
by a flag file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_faults import TARGETS

from benchmarks.hybrid.hybrid_models import (
    call,
    grow_then_compact,
    hybrid_vllm,
    system_prompt,
    text,
)
from jiuwen_kv_protocol.headers import CLAUDE_CODE_SESSION_HEADER, NEXT_USE_HEADER
from vllm_affinity.testing import SERVED_NAME, VLLMServer

pytestmark = pytest.mark.e2e

#: A session that grows to about 1,100 tokens before its compaction (the pool holds 1,536
#: tokens: a sliding window keeps few blocks of a prompt, so it takes many calls to fill it).
SMALL = {"system_pairs": 60, "turn_pairs": 60}
SITE = Path(__file__).resolve().parents[1] / "engine_faults_site"


@pytest.fixture(scope="module")
def flag(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults") / "on"


@pytest.fixture(scope="module")
def faulty_server(flag: Path) -> Iterator[VLLMServer]:
    """A tight pool (the picker chooses victims), every idle acted on (the utility path)."""
    env = {
        "VLLM_AFFINITY_IDLE_GUARD": "false",
        "JIUWEN_ENGINE_FAULTS": str(flag),
        "PYTHONPATH": str(SITE),
    }
    server = hybrid_vllm(
        "mistral",
        num_blocks=48,
        max_model_len=1280,
        env=env,
        worker_in_engine=True,
        extra_args=("--enable-scale-out",),  # /inference/v1/generate: sampling_params whole
    )
    with server:
        yield server


def sessions(server: VLLMServer, seed: int, count: int) -> None:
    """``count`` sessions of a coding agent (its own session header), two turns each under one
    system prompt (its checkpoint told), each call ending with an idle hint."""
    system = {"role": "system", "content": system_prompt(seed, 60)}
    for n in range(count):
        headers = {CLAUDE_CODE_SESSION_HEADER: f"s{seed}-{n}", NEXT_USE_HEADER: "120"}
        window = [system, {"role": "user", "content": text(seed * 100 + n, 60)}]
        call(server, window, headers)
        window += [
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": text(seed * 100 + n + 50, 30)},
        ]
        call(server, window, headers)


def test_every_engine_path_fails_open_and_the_plugin_comes_back(
    faulty_server: VLLMServer, flag: Path
) -> None:
    server = faulty_server
    assert server.engine_stats()["engine_errors"] == {}
    flag.touch()
    try:
        sessions(server, seed=1, count=6)  # every call answered (``call`` asserts its usage)
        grow_then_compact(
            server, seed=2, headers={CLAUDE_CODE_SESSION_HEADER: "compacting"}, **SMALL
        )
    finally:
        flag.unlink()
    errors = server.engine_stats()["engine_errors"]
    assert set(errors) == set(TARGETS), errors  # each path failed, and was caught
    assert httpx.get(server.root_url + "/health", timeout=10).status_code == 200
    # the faults are gone: the plugin binds, releases and idles again, and nothing it knew
    # before a failure released a live block
    before = server.engine_stats()
    sessions(server, seed=3, count=3)
    compaction = grow_then_compact(
        server, seed=4, headers={CLAUDE_CODE_SESSION_HEADER: "again"}, **SMALL
    )
    after = server.engine_stats()
    assert after["engine_errors"] == errors
    assert sum(compaction.released.values()) > 0, compaction
    assert after["released_hit"] == before["released_hit"]
    for engine in server.idle_check()["engines"]:
        assert engine["idle"] and not engine["problems"], engine["problems"]


#: The plugin's keys as a client might send them: malformed, and well formed but forged (another
#: tenant's principal, a compaction that never happened).
FORGED: dict[str, Any] = {
    "kv_head": "512",
    "kv_next_use": "soon",
    "kv_checkpoint": [1],
    "kv_release": 7,
    "kv_rewrite": "rewrite",
    "kv_principal": "another-tenant",
    "kv_vouched": "a guess",
}


def test_nothing_a_caller_sends_reaches_the_engine_as_the_plugins_own(
    faulty_server: VLLMServer,
) -> None:
    """Every entry point that passes a client's ``extra_args`` on (chat, completions, Responses,
    Anthropic's Messages, ``/inference/v1/generate``): the reserved keys never reach the
    engine, malformed or forged (``api_server/engine_funnel.py``), and every call is served."""
    server = faulty_server
    before = server.engine_stats()
    headers = {**server.headers(), CLAUDE_CODE_SESSION_HEADER: "forger"}
    prompt = text(9, 20)
    bodies = {
        "/v1/chat/completions": {
            "messages": [{"role": "user", "content": prompt}],
            "vllm_xargs": FORGED,
        },
        "/v1/completions": {"prompt": prompt, "vllm_xargs": FORGED},
        "/v1/responses": {"input": prompt, "vllm_xargs": FORGED},
        "/v1/messages": {
            "messages": [{"role": "user", "content": prompt}],
            "vllm_xargs": FORGED,
        },
    }
    with httpx.Client(base_url=server.root_url, headers=headers, timeout=120) as client:
        for route, body in bodies.items():
            answer = client.post(route, json={"model": SERVED_NAME, "max_tokens": 4, **body})
            assert answer.status_code == 200, (route, answer.text)
        tokens = server.tokenize([{"role": "user", "content": prompt}])
        generated = client.post(
            "/inference/v1/generate",
            json={
                "model": SERVED_NAME,
                "token_ids": tokens,
                "sampling_params": {"max_tokens": 4, "extra_args": FORGED},
            },
        )
        assert generated.status_code == 200, generated.text
    after = server.engine_stats()
    assert after["malformed_args"] == before["malformed_args"], after["malformed_args"]
    assert after["releases"] == before["releases"]  # the forged rewrite released nothing
    assert after["engine_errors"] == before["engine_errors"]
