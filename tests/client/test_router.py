"""The nginx configuration of ``vllm_affinity.nginx``, run by a real nginx in front of real
HTTP servers (``LocalEngine``), with the hook installed: a session's calls and its in-request
releases reach one replica; losing a replica moves only its sessions; round-robin does not pin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine
from vllm_affinity.nginx import find_nginx, nginx_config
from vllm_affinity.testing import NginxRouter

SESSIONS = [f"agent-{i}" for i in range(24)]


def _upstreams(engines: list[LocalEngine]) -> list[str]:
    return [e.root_url.removeprefix("http://") for e in engines]


def _window(session: str, turns: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{session} turn {t}"} for t in range(turns)]


def _run_sessions(router: NginxRouter, sessions: list[str], compact: bool = False) -> None:
    """Two calls per session, each naming its session as the hook does (``X-Session-ID``);
    with ``compact`` the second rewrites the window (a release, where the hook is installed)."""
    with openai.OpenAI(base_url=router.base_url, api_key="sk-test", max_retries=0) as client:
        for session in sessions:
            with jiuwen_hooks.session(session):
                for window in (_window(session, 3), _window(session, 1 if compact else 4)):
                    client.chat.completions.create(
                        model="m", messages=window, extra_headers={"X-Session-ID": session}
                    )


def _owner(engines: list[LocalEngine]) -> dict[str, set[int]]:
    """Session → the engines (by index) that served its chat calls."""
    out: dict[str, set[int]] = {}
    for index, engine in enumerate(engines):
        for chat in engine.chats:
            out.setdefault(chat.headers["x-session-id"], set()).add(index)
    return out


def test_a_session_and_its_releases_stay_on_one_replica(
    engines: list[LocalEngine], jiuwen_hook: jiuwen_hooks.Hook
) -> None:
    with NginxRouter(_upstreams(engines)) as router:
        _run_sessions(router, ["warm-up"])  # the hook's capability probe, through the router
        jiuwen_hook.flush()
        for engine in engines:
            engine.clear()
        _run_sessions(router, SESSIONS, compact=True)
    owners = _owner(engines)
    assert set(owners) == set(SESSIONS)
    assert all(len(found) == 1 for found in owners.values()), owners
    assert len({next(iter(found)) for found in owners.values()}) == 3  # all replicas in use
    for engine in engines:
        # the release rode on the second call, on the replica that served the first
        hinted = {c.headers["x-session-id"] for c in engine.chats if c.headers.get("x-kv-release")}
        mine = {c.headers["x-session-id"] for c in engine.chats}
        assert hinted == mine
    assert not any(e.releases for e in engines)  # none needed a POST
    # the router's log says the same
    logged = router.replica_of()
    for session, found in owners.items():
        assert logged[session] == _upstreams(engines)[next(iter(found))]


def test_losing_a_replica_moves_only_its_sessions(engines: list[LocalEngine]) -> None:
    with NginxRouter(_upstreams(engines)) as router:
        _run_sessions(router, SESSIONS)
        before = {s: next(iter(e)) for s, e in _owner(engines).items()}
        engines[0].stop()
        for engine in engines:
            engine.clear()
        _run_sessions(router, SESSIONS)  # no call fails: nginx moves on to a live replica
        after = {s: next(iter(e)) for s, e in _owner(engines).items()}
    assert set(after) == set(SESSIONS)
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == 0}  # consistent hashing
    assert moved, "some session lived on the stopped replica"
    assert 0 not in after.values()


def test_round_robin_does_not_pin_sessions(engines: list[LocalEngine]) -> None:
    with NginxRouter(_upstreams(engines), policy="round_robin") as router:
        _run_sessions(router, SESSIONS)
    assert any(len(found) > 1 for found in _owner(engines).values())


def test_the_cli_prints_the_configuration_nginx_accepts(tmp_path: Path) -> None:
    upstreams = ["127.0.0.1:18001", "127.0.0.1:18002"]
    printed = subprocess.run(
        [sys.executable, "-m", "vllm_affinity", "nginx-config", "--upstream", upstreams[0],
         "--upstream", upstreams[1], "--listen", "127.0.0.1:18000"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert printed == nginx_config(upstreams, "127.0.0.1:18000")
    assert "hash $jiuwen_session consistent;" in printed
    conf = tmp_path / "nginx.conf"
    conf.write_text(
        f"pid {tmp_path}/nginx.pid;\nerror_log {tmp_path}/error.log;\nevents {{}}\n"
        f"http {{\n{printed}}}\n"
    )
    checked = subprocess.run(
        [find_nginx(), "-t", "-p", str(tmp_path), "-c", str(conf)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stderr


def test_no_upstream_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="at least one upstream"):
        nginx_config([], 8000)


def test_the_deployment_page_shows_the_configuration_verbatim() -> None:
    readme = (Path(__file__).parents[2] / "docs" / "deployment.md").read_text()
    printed = nginx_config(["10.0.0.1:8000", "10.0.0.2:8000"], 8000)
    assert f"```nginx\n{printed}```" in readme


def test_posted_releases_reach_the_replica_of_their_session(engines: list[LocalEngine]) -> None:
    """A hook that POSTs its releases (``in_request=False``): each POST carries the session's
    header, so nginx sends it where the session's calls went."""
    jiuwen_hooks.uninstall()
    hook = jiuwen_hooks.install(in_request=False)
    try:
        with NginxRouter(_upstreams(engines)) as router:
            _run_sessions(router, SESSIONS, compact=True)
            hook.flush()
    finally:
        jiuwen_hooks.uninstall()
    owners = _owner(engines)
    for index, engine in enumerate(engines):
        posted = {r.headers["x-session-id"] for r in engine.releases}
        assert posted == {s for s, found in owners.items() if found == {index}}
    assert sum(len(e.releases) for e in engines) == len(SESSIONS)
