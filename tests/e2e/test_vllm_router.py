"""vLLM's own router (``vllm-router`` 0.1.17 from PyPI, as ``make test`` installs it) in front of
two plugin replicas that publish their KV events: the policy that pins agent sessions by their
own headers (``kv_aware`` with session affinity) keeps Codex- and opencode-shaped sessions each
on one replica, their compactions are released on that replica, a killed replica loses only its
own sessions, and a subscriber's replay of each replica's KV events equals its prefix cache.
What the router cannot do for agents (Claude Code's ``/v1/messages``, the release endpoint) is
shown here too (``docs/deployment.md`` says what the upstream change would be)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from benchmarks.fleet.vllm_router import (
    POLICIES,
    KvEventView,
    Router,
    event_replica,
    router_binary,
    served_by,
    views_agree,
)
from jiuwen_kv_protocol.headers import (
    CLAUDE_CODE_SESSION_HEADER,
    CODEX_THREAD_HEADER,
    GENERIC_SESSION_HEADERS,
    SESSION_HEADER,
)
from vllm_affinity.testing import SERVED_NAME, VLLMServer, filler_text
from vllm_affinity.testing.hybrid_model import build_hybrid

pytestmark = pytest.mark.e2e

BINARY = router_binary()
#: A dead replica found in seconds, not vllm-router's default three minutes (three failed checks a
#: minute apart): until then a session pinned to it fails on ``/v1/messages`` and
#: ``/v1/responses`` (Chat Completions the router retries on another worker).
HEALTH_CHECKS = ["--health-check-interval-secs", "2", "--health-failure-threshold", "2"]
#: Each replica's KV events as a subscriber replays them (``replicas`` fills it).
VIEWS: list[KvEventView] = []


@dataclass
class ShapedSession:
    """A session shaped as an agent sends it: its own headers, its API, its system prompt
    (different agents' prompts differ). ``opencode``: Chat Completions with ``X-Session-Id``
    and ``x-session-affinity``; ``python``: what the hook sends (``X-Session-ID``); ``codex``:
    the Responses API with ``session-id`` and ``thread-id`` (Codex CLI 0.169); ``claude``: the
    Messages API with ``X-Claude-Code-Session-Id`` (Claude Code)."""

    agent: str
    name: str
    system: str
    items: list[dict[str, Any]] = field(default_factory=list)
    served: list[int] = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        if self.agent == "codex":
            return {GENERIC_SESSION_HEADERS[0]: self.name, CODEX_THREAD_HEADER: self.name}
        if self.agent == "opencode":
            return {SESSION_HEADER: self.name, GENERIC_SESSION_HEADERS[1]: self.name}
        if self.agent == "claude":
            return {CLAUDE_CODE_SESSION_HEADER: self.name}
        return {SESSION_HEADER: self.name}

    def body(self, max_tokens: int) -> tuple[str, dict[str, Any]]:
        if self.agent == "codex":
            return "/v1/responses", {
                "model": SERVED_NAME, "instructions": self.system, "input": self.items,
                "max_output_tokens": max_tokens, "store": False, "prompt_cache_key": self.name,
            }  # fmt: skip
        if self.agent == "claude":
            return "/v1/messages", {
                "model": SERVED_NAME, "system": self.system, "messages": self.items,
                "max_tokens": max_tokens,
            }  # fmt: skip
        messages = [{"role": "system", "content": self.system}, *self.items]
        return "/v1/chat/completions", {
            "model": SERVED_NAME, "messages": messages, "max_tokens": max_tokens,
        }  # fmt: skip

    def item(self, role: str, text: str) -> dict[str, Any]:
        if self.agent == "codex":  # the Responses items Codex sends
            part = "input_text" if role == "user" else "output_text"
            return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}
        return {"role": role, "content": text}

    def say(self, text: str) -> None:
        self.items.append(self.item("user", text))

    def heard(self, answer: dict[str, Any]) -> None:
        if self.agent == "codex":
            text = "".join(
                part.get("text", "")
                for item in answer["output"] if item.get("type") == "message"
                for part in item["content"]
            )  # fmt: skip
        elif self.agent == "claude":
            text = "".join(b.get("text", "") for b in answer["content"] if b["type"] == "text")
        else:
            text = answer["choices"][0]["message"]["content"] or ""
        self.items.append(self.item("assistant", text or "ok"))

    def compact(self) -> None:
        """The agent's compaction: the new window is the summary alone."""
        self.items = [self.item("user", f"Summary of {self.name}: " + filler(7, 40))]


def filler(seed: int, words: int) -> str:
    return filler_text(random.Random(seed), words)


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[VLLMServer]]:
    """Two plugin replicas (a core each) publishing their KV events. The router passes neither
    the hook's capability probe nor ``/release_kv_cache`` (below), so the replicas tell every
    session's compactions themselves (``VLLM_AFFINITY_INFER_COMPACTION=all``)."""
    if BINARY is None:
        pytest.fail("vllm-router is not installed: make test installs it in .venv-router")
    env = {"VLLM_AFFINITY_INFER_COMPACTION": "all"}
    servers = [event_replica(num_blocks=160, cpu_cores=str(i), env=env) for i in range(2)]
    for server in servers:
        server.start(wait=False)
    try:
        for server in servers:
            server.wait_healthy()
        # subscribed before any request: the replay covers every block the replica caches
        VIEWS.extend(KvEventView(f"tcp://127.0.0.1:{s.kv_events_port}").start() for s in servers)  # type: ignore[attr-defined]
        yield servers
    finally:
        for view in VIEWS:
            view.stop()
        for server in servers:
            server.stop()


def call(router: Router, replicas: list[VLLMServer], session: ShapedSession) -> None:
    """One call of ``session`` through the router, nothing else in flight: its replica noted."""
    path, body = session.body(4)

    def send() -> httpx.Response:
        return httpx.post(router.url + path, json=body, headers=session.headers, timeout=120)

    replica, answer = served_by(replicas, send)
    session.served.append(replica)
    session.heard(answer)


def start_together(router: Router, sessions: list[ShapedSession]) -> None:
    """Every session's first call at once, as agents started together send them: a policy that
    weighs load spreads them (one at a time, each would find the other replica idle too)."""
    answers: dict[str, httpx.Response] = {}

    def first_call(session: ShapedSession) -> None:
        session.say(f"task of {session.name}: " + filler(len(session.name) * 7, 30))
        path, body = session.body(24)
        answers[session.name] = httpx.post(
            router.url + path, json=body, headers=session.headers, timeout=120
        )

    threads = [threading.Thread(target=first_call, args=(s,)) for s in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for session in sessions:
        answers[session.name].raise_for_status()
        session.heard(answers[session.name].json())


def windows(replica: VLLMServer) -> dict[str, float]:
    return {
        verdict: replica.metric("vllm_affinity_agent_windows_total", verdict=verdict)
        for verdict in ("first", "append", "rewrite")
    }


def test_what_the_router_does_not_pass(replicas: list[VLLMServer]) -> None:
    """vllm-router 0.1.17 forwards a request's headers on ``/v1/chat/completions`` only: on
    ``/v1/messages`` (Claude Code's API) and ``/v1/responses`` (the Codex CLI's) the replica gets
    none of them. A Claude Code session then reaches the plugin unnamed (no
    ``X-Claude-Code-Session-Id``: it is bound as a session the plugin infers, not as Claude
    Code's). The Codex CLI also names its thread in the body (``prompt_cache_key``), which the
    router passes: its sessions are bound all the same. The router's own placement still pins
    both by their headers. Forwarding the headers is the upstream change
    (``docs/deployment.md``)."""
    assert BINARY is not None
    claude = {CLAUDE_CODE_SESSION_HEADER: "cc-1"}
    messages = {
        "model": SERVED_NAME, "max_tokens": 4, "system": "You are Claude Code.",
        "messages": [{"role": "user", "content": "hello"}],
    }  # fmt: skip
    replica = replicas[0]
    with Router(BINARY, replicas[:1], POLICIES["kv_aware+affinity"]) as router:
        codex = ShapedSession("codex", "codex-thread", "You are Codex. " + filler(3, 120))
        before = windows(replica)
        for turn in range(2):
            codex.say(f"turn {turn}")
            call(router, replicas[:1], codex)
        after = windows(replica)  # bound by prompt_cache_key: first, then append
        assert (after["first"] - before["first"], after["append"] - before["append"]) == (1, 1)
        unnamed = claude_unnamed = replica.metric(
            "vllm_affinity_implicit_sessions_total", outcome="started"
        )
        for root in (router.url, replica.root_url):
            answer = httpx.post(root + "/v1/messages", json=messages, headers=claude, timeout=60)
            assert answer.status_code == 200, answer.text
            if root == router.url:
                claude_unnamed = replica.metric(
                    "vllm_affinity_implicit_sessions_total", outcome="started"
                )
        # through the router, no header: an implicit session; directly, Claude Code's own
        assert claude_unnamed == unnamed + 1
        assert replica.metric("vllm_affinity_implicit_sessions_total", outcome="started") == (
            claude_unnamed
        )


def test_agent_sessions_stay_on_their_replica_and_releases_happen_there(
    replicas: list[VLLMServer],
) -> None:
    """Eight sessions, two of each agent's shape (each agent its own system prompt), behind
    ``kv_aware`` with session affinity: their first calls at once, then three turns, a
    compaction and a turn each, one call at a time (each call's replica told apart). Every
    session stays on one replica and the two share them; each replica releases exactly the
    compactions of the sessions it holds and that reach it named (not Claude Code's: the
    router drops its header, above); the KV events each replica published replay into exactly
    its prefix cache. Then one replica is killed: every call still succeeds, only its sessions
    move, and the survivor's sessions still hit their prefix there."""
    assert BINARY is not None
    agents = ("opencode", "python", "codex", "claude")
    systems = {agent: f"You are {agent}. " + filler(seed, 260) for seed, agent in enumerate(agents)}
    sessions = [ShapedSession(a, f"{a}-{i}", systems[a]) for i in range(2) for a in agents]
    before = [r.engine_stats()["releases_compaction"] for r in replicas]
    with Router(BINARY, replicas, [*POLICIES["kv_aware+affinity"], *HEALTH_CHECKS]) as router:
        start_together(router, sessions)
        for turn in range(3):
            for session in sessions:
                session.say(f"turn {turn}: " + filler(turn * 31 + len(session.items), 25))
                call(router, replicas, session)
        for session in sessions:
            session.compact()
            session.say("go on")
            call(router, replicas, session)
        placement = {s.name: set(s.served) for s in sessions}
        assert all(len(found) == 1 for found in placement.values()), placement
        held = [sum(1 for found in placement.values() if found == {i}) for i in range(2)]
        assert all(held), placement  # spread over both replicas
        named = [
            sum(1 for s in sessions if s.agent != "claude" and set(s.served) == {i})
            for i in range(2)
        ]
        after = [r.engine_stats()["releases_compaction"] for r in replicas]
        # each replica told the compactions of its own sessions, and of no other
        assert [a - b for a, b in zip(after, before, strict=True)] == named, (named, placement)
        assert [r.engine_stats()["released_hit"] for r in replicas] == [0, 0]  # none live
        for replica, view in zip(replicas, VIEWS, strict=True):
            assert views_agree(replica, view) is None, views_agree(replica, view, timeout=0)

        survivor, victim = replicas[0], replicas[1]
        victim.kill()
        failed: dict[str, int] = {}
        for session in sessions:
            session.say("after the crash")
            hits = survivor.metric("vllm:prefix_cache_hits_total")
            for attempt in range(30):  # the agents retry a 5xx (the SDKs, Codex, Claude Code)
                try:
                    call(router, [survivor], session)
                    break
                except httpx.HTTPStatusError as error:
                    assert error.response.status_code == 502 and attempt < 29, error
                    failed[session.name] = attempt + 1
                    time.sleep(1)
            if placement[session.name] == {0}:  # its cache lives on: the window is hit
                assert survivor.metric("vllm:prefix_cache_hits_total") > hits, session.name
        # only calls pinned to the dead replica failed, and only on the APIs the router does not
        # retry on another worker (Chat Completions it does)
        assert all(placement[name] == {1} for name in failed), failed
        assert all(name.split("-")[0] in ("codex", "claude") for name in failed), failed
        print(f"calls refused after the kill (502), by session: {failed}")


def test_kv_events_replay_into_a_hybrid_replicas_cache() -> None:
    """Gemma 3's shape (sliding window beside full attention, four KV-cache groups), one plugin
    replica behind the router, a pool too small for the traffic: sessions grow, compact (their
    old windows released) and go idle while new ones evict. The subscriber's replay of the KV
    events equals the engine's prefix cache in every group."""
    assert BINARY is not None
    model = build_hybrid("gemma3")
    env = {"VLLM_AFFINITY_INFER_COMPACTION": "all", "VLLM_AFFINITY_IDLE_GUARD": "false"}
    replica = event_replica(model=str(model), num_blocks=320, max_model_len=2048, env=env)
    with replica, Router(BINARY, [replica], POLICIES["kv_aware+affinity"]) as router:
        view = KvEventView(f"tcp://127.0.0.1:{replica.kv_events_port}").start()  # type: ignore[attr-defined]
        try:
            for wave in range(3):
                sessions = [
                    ShapedSession(
                        agent, f"{agent}-{wave}-{i}", f"You are {agent}. " + filler(i, 120)
                    )
                    for i in range(2)
                    for agent in ("opencode", "python")
                ]
                for turn in range(3):
                    for session in sessions:
                        session.say(f"turn {turn}: " + filler(wave * 100 + turn, 40))
                        call(router, [replica], session)
                for session in sessions[:2]:
                    session.compact()
                    session.say("go on")
                    call(router, [replica], session)
            stats = replica.engine_stats()
            assert len(stats["groups"]) > 1 and stats["releases_compaction"] >= 6
            assert stats["released_hit"] == 0  # no released block was live
            assert view.removed > 0  # the pool was reused: evictions reported
            assert views_agree(replica, view) is None, views_agree(replica, view, timeout=0)
        finally:
            view.stop()
