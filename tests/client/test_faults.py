"""Fault matrix: whatever the release endpoint does, the agent's call returns its normal result;
every outcome is counted; 404/405 start a cool-down with a single warning."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import pytest
from callers import Caller, system_and_user

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine

FAULTS: dict[str, tuple[dict[str, Any], str]] = {
    "200": ({}, "ok"),
    "200-non-json": ({"non_json": True}, "invalid_response"),
    "400": ({"status": 400}, "http_400"),
    "404": ({"status": 404}, "http_404"),
    "405": ({"status": 405}, "http_405"),
    "500": ({"status": 500}, "http_500"),
    "503": ({"status": 503}, "http_503"),
    "timeout": ({"delay": 1.0}, "timeout"),
    "reset": ({"reset": True}, "connection_reset"),
}


#: The hook's HTTP timeout for the tests whose release endpoint fails (indirect: the options
#: of the ``jiuwen_hook`` these tests install).
SHORT_TIMEOUT = pytest.mark.parametrize("jiuwen_hook_options", [{"timeout": 0.3}], ids=["t0.3"])


def rewrite_once(call: Caller) -> Any:
    window = system_and_user(3)
    call(window)
    return call(window[:2])


@pytest.mark.parametrize("fault", FAULTS, ids=list(FAULTS))
@SHORT_TIMEOUT
def test_agent_call_survives(
    fault: str, call: Caller, jiuwen_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook
) -> None:
    answer, outcome = FAULTS[fault]
    jiuwen_engine.answer_releases(**answer)
    reply = rewrite_once(call)
    assert reply.choices[0].message.content == "ok (2 messages)"
    assert len(jiuwen_engine.releases) == 1
    stats = jiuwen_hooks.stats()
    assert stats[f"releases.{outcome}"] == 1
    assert stats["releases.total"] == 1
    assert stats.get("internal_errors", 0) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_refused(
    call: Caller, jiuwen_engine: LocalEngine, jiuwen_hook_factory: Any
) -> None:
    jiuwen_hook_factory(release_url=f"http://127.0.0.1:{free_port()}/release_kv_cache")
    reply = rewrite_once(call)
    stats = jiuwen_hooks.stats()
    assert reply.choices[0].message.content == "ok (2 messages)"
    assert stats["releases.connect_error"] == 1


@pytest.mark.parametrize("status", [404, 405])
@SHORT_TIMEOUT
def test_unsupported_endpoint_cools_down_with_one_warning(
    status: int,
    call: Caller,
    jiuwen_engine: LocalEngine,
    jiuwen_hook: jiuwen_hooks.Hook,
    caplog: pytest.LogCaptureFixture,
) -> None:
    jiuwen_engine.answer_releases(status)
    window = system_and_user(6)
    with caplog.at_level(logging.WARNING, logger="jiuwen_hooks"):
        for n in (6, 5, 4, 3):
            call(window[:n])
    assert len(jiuwen_engine.releases) == 1  # the later three were not sent
    stats = jiuwen_hooks.stats()
    assert stats[f"releases.http_{status}"] == 1
    assert stats["releases.unsupported"] == 2
    warnings = [r for r in caplog.records if "does not support KV cache release" in r.getMessage()]
    assert len(warnings) == 1


def test_cool_down_expires(
    call: Caller, jiuwen_engine: LocalEngine, jiuwen_telemetry: Any, jiuwen_hook_factory: Any
) -> None:
    jiuwen_hook_factory(unsupported_cooldown=0)
    jiuwen_engine.answer_releases(404)
    window = system_and_user(4)
    call(window)
    call(window[:3])
    jiuwen_engine.answer_releases(200)
    call(window[:2])
    assert len(jiuwen_engine.releases) == 2


@SHORT_TIMEOUT
def test_failures_warn_at_a_limited_rate(
    call: Caller,
    jiuwen_engine: LocalEngine,
    jiuwen_hook: jiuwen_hooks.Hook,
    caplog: pytest.LogCaptureFixture,
) -> None:
    jiuwen_engine.answer_releases(500)
    window = system_and_user(6)
    with caplog.at_level(logging.WARNING, logger="jiuwen_hooks"):
        for n in (6, 5, 4, 3):
            call(window[:n])
    assert len(jiuwen_engine.releases) == 3
    assert jiuwen_hooks.stats()["releases.http_500"] == 3
    assert (
        len(
            [
                r
                for r in caplog.records
                if r.getMessage().startswith("Failed to release inference-affinity KV cache: ")
            ]
        )
        == 1
    )


def test_background_dispatch_does_not_wait(
    call: Caller, jiuwen_engine: LocalEngine, jiuwen_telemetry: Any, jiuwen_hook_factory: Any
) -> None:
    hook = jiuwen_hook_factory(dispatch="background", timeout=2.0)
    jiuwen_engine.answer_releases(delay=1.0)
    window = system_and_user(3)
    call(window)
    call(window[:2])
    # the chat call returned while the server was still holding the release
    assert jiuwen_hooks.stats().get("releases.total", 0) == 0
    if call.mode == "async":
        call.run(hook.aflush())
    hook.flush()
    assert jiuwen_hooks.stats()["releases.ok"] == 1
    assert len(jiuwen_engine.wait_for_releases(1)) == 1


def test_hanging_endpoint_delays_the_agent_once_per_cool_down(
    jiuwen_engine: LocalEngine, jiuwen_hook_factory: Any
) -> None:
    """A release endpoint that hangs costs the agent the timeout once; then releases are skipped
    (``releases.unreachable``) until the cool-down ends."""
    jiuwen_hook_factory(timeout=0.3, failure_cooldown=1.0)
    jiuwen_engine.answer_releases(delay=2.0)
    caller = Caller("sync", jiuwen_engine.base_url)
    window = system_and_user(3)
    durations = []
    try:
        for _ in range(4):
            caller(window)
            started = time.perf_counter()
            caller(window[:2])  # a release each time
            durations.append(time.perf_counter() - started)
        time.sleep(1.1)  # the cool-down ends: the next release is tried (and times out) again
        caller(window)
        started = time.perf_counter()
        caller(window[:2])
        durations.append(time.perf_counter() - started)
        stats = jiuwen_hooks.stats()
    finally:
        caller.close()
    assert durations[0] >= 0.3 and durations[4] >= 0.3  # the timeout, once per cool-down
    assert max(durations[1:4]) < 0.25, durations
    assert stats["releases.timeout"] == 2 and stats["releases.unreachable"] == 3


def broken(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a bug inside the hook")


async def abroken(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a bug inside the hook")


def test_a_bug_in_the_hook_never_reaches_the_agent(
    call: Caller,
    jiuwen_engine: LocalEngine,
    jiuwen_hook: jiuwen_hooks.Hook,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The call goes out exactly as the agent made it; the error is counted and logged."""
    monkeypatch.setattr(jiuwen_hook, "_before_call", broken)
    with caplog.at_level(logging.WARNING, logger="jiuwen_hooks"):
        reply = rewrite_once(call)
    assert reply.choices[0].message.content == "ok (2 messages)"
    assert jiuwen_engine.releases == []
    assert all("x-session-id" not in chat.headers for chat in jiuwen_engine.chats)
    assert jiuwen_hooks.stats()["internal_errors"] == 2
    assert "internal error; call passed through" in caplog.text


def test_a_bug_while_releasing_is_counted_and_the_call_succeeds(
    call: Caller,
    jiuwen_engine: LocalEngine,
    jiuwen_hook: jiuwen_hooks.Hook,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(jiuwen_hook.client, "send", broken)
    monkeypatch.setattr(jiuwen_hook.client, "asend", abroken)
    reply = rewrite_once(call)
    assert reply.choices[0].message.content == "ok (2 messages)"
    assert jiuwen_engine.releases == []
    assert jiuwen_hooks.stats()["internal_errors"] == 1


def test_a_bug_after_a_compressor_is_counted(
    jiuwen_hook: jiuwen_hooks.Hook, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jiuwen_hook.table, "rewrite", broken)
    window = system_and_user(2)
    with jiuwen_hooks.session("s"):
        assert jiuwen_hook.after_compress("summarise", window, window[:1]) is None
    assert jiuwen_hooks.stats()["internal_errors"] == 1
