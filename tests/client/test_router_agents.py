"""Coding agents' own session headers through the printed nginx configuration (a real nginx in
front of real HTTP servers, ``LocalEngine``): every session stays on one replica whatever header
names it, sessions spread over all replicas, nginx's key is the session the plugin reads, and a
lost replica moves only its own sessions."""

from __future__ import annotations

import random
from dataclasses import dataclass

import httpx

from jiuwen_hooks.testing import LocalEngine
from jiuwen_kv_protocol.headers import (
    CLAUDE_CODE_AGENT_HEADER,
    CLAUDE_CODE_SESSION_HEADER,
    CODEX_PARENT_HEADER,
    CODEX_THREAD_HEADER,
    GENERIC_SESSION_HEADERS,
    OPENCODE_PARENT_HEADER,
    SESSION_HEADER,
)
from vllm_affinity.core.session_headers import DEFAULT_SESSION_HEADERS, session_from_headers
from vllm_affinity.testing import NginxRouter

CODEX_SESSION, AFFINITY = GENERIC_SESSION_HEADERS


@dataclass(frozen=True)
class AgentSession:
    """One session as an agent names it: the path it calls and the headers on every call."""

    path: str
    headers: dict[str, str]

    @property
    def key(self) -> str:
        """The session the plugin reads from these headers."""
        found = session_from_headers(httpx.Headers(self.headers), DEFAULT_SESSION_HEADERS)
        assert found is not None
        return found

    def body(self, turn: int) -> dict[str, object]:
        messages = [{"role": "user", "content": f"{self.key} turn {t}"} for t in range(turn + 1)]
        if self.path == "/v1/responses":
            return {"model": "m", "input": messages}
        return {"model": "m", "messages": messages, "max_tokens": 8}


def agent_sessions() -> list[AgentSession]:
    """Leads and subagents of Claude Code (``/v1/messages``), the Codex CLI (``/v1/responses``
    and chat), opencode and a gateway's ``X-Session-Affinity`` (chat)."""
    out = []
    for i in range(5):
        lead = f"cc-{i}"
        lead_headers = {CLAUDE_CODE_SESSION_HEADER: lead, "x-app": "cli"}
        out.append(AgentSession("/v1/messages", lead_headers))
        subagent = {CLAUDE_CODE_SESSION_HEADER: lead, CLAUDE_CODE_AGENT_HEADER: f"agent-{i}"}
        out.append(AgentSession("/v1/messages", subagent))
    for i in range(5):
        root = f"codex-{i}"
        path = "/v1/responses" if i % 2 else "/v1/chat/completions"
        out.append(AgentSession(path, {CODEX_SESSION: root, CODEX_THREAD_HEADER: root}))
        sub = {CODEX_SESSION: root, CODEX_THREAD_HEADER: f"{root}-sub", CODEX_PARENT_HEADER: root}
        out.append(AgentSession(path, sub))
    for i in range(4):
        opencode = {SESSION_HEADER: f"oc-{i}", AFFINITY: f"oc-{i}"}
        out.append(AgentSession("/v1/chat/completions", opencode))
        child = {SESSION_HEADER: f"oc-{i}-child", AFFINITY: f"oc-{i}-child",
                 OPENCODE_PARENT_HEADER: f"oc-{i}"}  # fmt: skip
        out.append(AgentSession("/v1/chat/completions", child))
        out.append(AgentSession("/v1/chat/completions", {AFFINITY: f"gateway-{i}"}))
    return out


def _upstreams(engines: list[LocalEngine]) -> list[str]:
    return [e.root_url.removeprefix("http://") for e in engines]


def _run(router: NginxRouter, sessions: list[AgentSession], turns: int, seed: int) -> None:
    """``turns`` calls per session, all sessions' calls shuffled together."""
    calls = [(s, t) for s in sessions for t in range(turns)]
    random.Random(seed).shuffle(calls)
    with httpx.Client(base_url=router.root_url, timeout=30) as client:
        for session, turn in calls:
            response = client.post(session.path, json=session.body(turn), headers=session.headers)
            assert response.status_code == 200, response.text


def _owners(engines: list[LocalEngine]) -> dict[str, set[int]]:
    """The plugin's session → the engines (by index) that served its calls."""
    out: dict[str, set[int]] = {}
    for index, engine in enumerate(engines):
        for call in engine.chats:
            key = session_from_headers(httpx.Headers(call.headers), DEFAULT_SESSION_HEADERS)
            assert key is not None, call.headers
            out.setdefault(key, set()).add(index)
    return out


def test_every_agent_session_stays_on_one_replica(engines: list[LocalEngine]) -> None:
    sessions = agent_sessions()
    with NginxRouter(_upstreams(engines)) as router:
        _run(router, sessions, turns=4, seed=1)
        routed = router.wait_routed(4 * len(sessions))
    owners = _owners(engines)
    assert set(owners) == {s.key for s in sessions}
    split = {key: found for key, found in owners.items() if len(found) > 1}
    assert not split, split
    assert {next(iter(found)) for found in owners.values()} == {0, 1, 2}  # spread over all
    # nginx hashed exactly the session the plugin reads (one list of headers for both)
    assert {r.session for r in routed} == {s.key for s in sessions}
    assert len(routed) == 4 * len(sessions)


def test_a_subagent_is_routed_as_a_session_of_its_own(engines: list[LocalEngine]) -> None:
    """Claude Code's subagents (its lead's session id and an agent id) and the Codex CLI's (the
    root's ``session-id``, a ``thread-id`` of their own) are keyed apart from their leads, as on
    the server (docs/deployment.md says why)."""
    with NginxRouter(_upstreams(engines)) as router:
        sessions = agent_sessions()
        _run(router, sessions, turns=1, seed=2)
        keys = {r.session for r in router.wait_routed(len(sessions))}
    assert {"cc-0", "cc-0/agent-0", "codex-1", "codex-1-sub"} <= keys


def test_losing_a_replica_moves_only_its_own_agent_sessions(engines: list[LocalEngine]) -> None:
    sessions = agent_sessions()
    with NginxRouter(_upstreams(engines)) as router:
        _run(router, sessions, turns=2, seed=3)
        before = {key: next(iter(found)) for key, found in _owners(engines).items()}
        engines[1].stop()
        for engine in engines:
            engine.clear()
        _run(router, sessions, turns=2, seed=4)  # no call fails: nginx moves on
        after = {key: next(iter(found)) for key, found in _owners(engines).items()}
    assert set(after) == set(before)
    moved = {key for key in before if before[key] != after[key]}
    assert moved == {key for key in before if before[key] == 1} and moved
    assert 1 not in after.values()


def test_a_request_that_names_no_session_is_spread(engines: list[LocalEngine]) -> None:
    with (
        NginxRouter(_upstreams(engines)) as router,
        httpx.Client(base_url=router.root_url, timeout=30) as client,
    ):
        for turn in range(9):
            body = {"model": "m", "messages": [{"role": "user", "content": f"hi {turn}"}]}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert all(len(engine.chats) == 3 for engine in engines)  # round-robin
