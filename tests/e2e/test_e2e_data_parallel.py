"""A data-parallel server (``--data-parallel-size 2``, two engine-core processes on CPU, and
``--api-server-count 2``, two API-server processes, as ``vllm serve`` starts it): each session is
served by one engine, its in-request releases act there, a POSTed release fans out to both
engines (the one holding the session releases, the other answers unknown), and a coding
agent's windows are judged as with one API server though each API server sees only some of a
session's requests."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import openai
import pytest

import jiuwen_hooks
from jiuwen_kv_protocol.headers import CLAUDE_CODE_SESSION_HEADER
from vllm_affinity.core import engine_rank
from vllm_affinity.core.compaction import VERDICTS
from vllm_affinity.testing import SERVED_NAME, VLLMServer, filler_text
from vllm_affinity.testing.pytest_plugin import shared_server

pytestmark = pytest.mark.e2e

SESSIONS = [f"sess-{i}" for i in range(5)]


def _data_parallel_server() -> VLLMServer:
    return VLLMServer(
        num_blocks=128,
        extra_args=("--data-parallel-size", "2", "--api-server-count", "2"),
        eager=True,
        worker_in_engine=True,
    )


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


TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def _agent_call(server: VLLMServer, session: str, messages: list[dict[str, str]]) -> str:
    """One call as Claude Code makes it (its session header, tools), on a new connection: the
    two API servers take connections as they come."""
    with httpx.Client(timeout=120) as fresh:
        answer = fresh.post(
            server.base_url + "/chat/completions",
            headers={CLAUDE_CODE_SESSION_HEADER: session},
            json={"model": SERVED_NAME, "messages": messages, "tools": TOOLS, "max_tokens": 2},
        )
    answer.raise_for_status()
    return str(answer.json()["choices"][0]["message"]["content"] or "")


def _api_server_verdicts(server: VLLMServer, asks: int = 64) -> dict[int, dict[str, int]]:
    """Each API server's own verdict counts (``/affinity/stats`` answers with its process's,
    ``pid`` naming it), asked on new connections, eight held open at a time, until both
    answered."""
    seen: dict[int, dict[str, int]] = {}
    for _ in range(0, asks, 8):
        with ExitStack() as stack:
            clients = [stack.enter_context(httpx.Client(timeout=30)) for _ in range(8)]
            for fresh in clients:
                own = fresh.get(server.root_url + "/affinity/stats").json()["api_server"]
                seen[own["pid"]] = {k: v for k, v in own.items() if k.startswith("windows.")}
        if len(seen) == 2:
            break
    return seen


def _agent_session(server: VLLMServer, session: str) -> None:
    """A turn, a tool loop, the compaction request, the new window."""
    rng = random.Random(session)
    system = {"role": "system", "content": filler_text(rng, 60)}
    window = [system, {"role": "user", "content": filler_text(rng, 30)}]
    for _ in range(3):
        window.append({"role": "assistant", "content": _agent_call(server, session, window)})
        window.append({"role": "user", "content": filler_text(rng, 20)})
    _agent_call(server, session, [system, {"role": "user", "content": "the summary"}])


def test_two_api_servers_judge_a_sessions_windows_as_one_does(
    data_parallel_server: VLLMServer,
) -> None:
    server = data_parallel_server
    before = {v: server.metric("vllm_affinity_agent_windows_total", verdict=v) for v in VERDICTS}
    engines_before = server.affinity_stats()["engines"]
    verdicts_before = _api_server_verdicts(server)
    # Six sessions side by side, each call on a new connection; another six while one API
    # server has taken every call (the kernel hands a shared socket's connections to whichever
    # process accepts first, and under load that can be one of them for a while).
    sessions: list[str] = []
    for batch in range(4):
        names = [f"agent-{batch}-{i}" for i in range(6)]
        with ThreadPoolExecutor(len(names)) as pool:
            list(pool.map(lambda s: _agent_session(server, s), names))
        sessions += names
        per_process = _api_server_verdicts(server)
        took = [
            pid for pid, own in per_process.items()
            if sum(own.values()) > sum(verdicts_before.get(pid, {}).values())
        ]  # fmt: skip
        if len(took) == 2:
            break
    # both API servers judged some windows: a rule kept per API server would have seen a
    # session's later windows there as first ones
    assert len(took) == 2, (per_process, verdicts_before)
    judged = {
        v: server.metric("vllm_affinity_agent_windows_total", verdict=v) - before[v]
        for v in VERDICTS
    }
    # what one API server judges: each session's first window, two appends, one rewrite
    n = len(sessions)
    assert judged == {"first": n, "append": 2 * n, "retry": 0, "rewrite": n, "side": 0}
    engines = server.affinity_stats()["engines"]
    for rank, (engine, earlier) in enumerate(zip(engines, engines_before, strict=True)):
        mine = sum(engine_rank(s, 2) == rank for s in sessions)
        grew = engine.get("releases_compaction", 0) - earlier.get("releases_compaction", 0)
        assert grew == mine  # each rewrite released on the engine that serves its session
    # /metrics, whichever API server answers, shows both engines' figures: vLLM's
    # multiprocess registry (several API servers) held no collector of the plugin before
    deadline = time.monotonic() + 15  # each API server refreshes its snapshot every 2 s
    for rank, engine in enumerate(engines):
        labels = {"mode": "compaction", "engine": str(rank)}
        while server.metric("vllm_affinity_engine_releases_total", **labels) < engine.get(
            "releases_compaction", 0
        ):
            assert time.monotonic() < deadline, [k for k in server.metrics() if "engine" in k]
            time.sleep(0.5)
