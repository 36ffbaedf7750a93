"""A data-parallel server (``--data-parallel-size 2``, two engine-core processes on CPU): each
session is served by one engine, its in-request releases act there, and a POSTed release fans
out to both engines (the one holding the session releases, the other answers unknown)."""

from __future__ import annotations

import random
from collections.abc import Callable

import openai
import pytest

import jiuwen_hooks
from vllm_affinity.core import engine_rank
from vllm_affinity.pytest_plugin import shared_server
from vllm_affinity.testing import SERVED_NAME, VLLMServer, filler_text

pytestmark = pytest.mark.e2e

SESSIONS = [f"sess-{i}" for i in range(5)]


def _data_parallel_server() -> VLLMServer:
    return VLLMServer(num_blocks=128, extra_args=("--data-parallel-size", "2"), eager=True)


#: Started with the other shared servers.
data_parallel_server = shared_server("data_parallel_server", _data_parallel_server)


def _turn(window: list[dict[str, str]], session: str, turn: int) -> None:
    window.append({"role": "user", "content": filler_text(random.Random(f"{session}{turn}"), 30)})


def test_sessions_stay_on_one_engine_and_releases_reach_it(
    data_parallel_server: VLLMServer, jiuwen_hook_factory: Callable[..., jiuwen_hooks.Hook]
) -> None:
    server = data_parallel_server
    assert {engine_rank(s, 2) for s in SESSIONS} == {0, 1}  # both engines have sessions
    hook = jiuwen_hook_factory()
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0) as client:
        windows = {}
        for session in SESSIONS:
            system = filler_text(random.Random(session), 60)
            windows[session] = [{"role": "system", "content": system}]
        for turn in range(3):
            for session, window in windows.items():
                if turn == 2:  # compaction: the middle turn is dropped
                    del window[1:3]
                _turn(window, session, turn)
                with jiuwen_hooks.session(session):
                    client.chat.completions.create(model=SERVED_NAME, messages=window, max_tokens=2)
                window.append({"role": "assistant", "content": "ok"})
            hook.flush()  # the capability probe answered before the compaction turn
    hook_stats = hook.stats()
    assert hook_stats.get("releases.in_request", 0) == len(SESSIONS)
    engines = server.affinity_stats()["engines"]
    assert len(engines) == 2
    for rank, engine in enumerate(engines):
        mine = [s for s in SESSIONS if engine_rank(s, 2) == rank]
        assert engine["sessions"] == len(mine)  # no session touched the other engine
        assert engine["releases_in_request"] == engine["releases_ok"] == len(mine)
        assert engine.get("releases_unknown_session", 0) == 0
        assert engine["block_released_in_request"] > 0


def test_a_posted_release_fans_out_to_both_engines(data_parallel_server: VLLMServer) -> None:
    server = data_parallel_server
    session = "fan-out"
    window = [{"role": "system", "content": filler_text(random.Random(session), 80)}]
    _turn(window, session, 0)
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0) as client:
        client.chat.completions.create(
            model=SERVED_NAME, messages=window, max_tokens=2,
            extra_headers={"X-Session-ID": session},
        )  # fmt: skip
    before = server.affinity_stats()["engines"]
    body = {"model": SERVED_NAME, "cache_salt": session, "messages": window,
            "messages_released_index": 0}  # fmt: skip
    answer = server.release(body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "ok"
    assert answer.json()["block_released"] > 0
    after = server.affinity_stats()["engines"]
    holder = engine_rank(session, 2)
    for rank in (0, 1):
        grew = {
            key: after[rank].get(key, 0) - before[rank].get(key, 0)
            for key in ("releases_post", "releases_ok", "releases_unknown_session")
        }
        assert grew == {
            "releases_post": 1,  # every engine was asked
            "releases_ok": int(rank == holder),
            "releases_unknown_session": int(rank != holder),
        }
