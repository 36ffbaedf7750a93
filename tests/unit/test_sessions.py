"""Unit tests of the session table (pure core): snapshots, bounds, compressor de-duplication."""

from __future__ import annotations

import pytest

from jiuwen_hooks._diff import ReleasePolicy, Window
from jiuwen_hooks._sessions import SessionTable


def W(*contents: str) -> Window:
    return Window(tuple({"role": "user", "content": c} for c in contents))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(**kw: object) -> SessionTable:
    kw.setdefault("max_sessions", 100)
    kw.setdefault("idle_ttl", 60.0)
    kw.setdefault("policy", ReleasePolicy())
    return SessionTable(**kw)  # type: ignore[arg-type]


def test_first_window_releases_nothing_then_rewrite_releases_old_window() -> None:
    t = table()
    assert t.observe("s", W("a", "b"), "target").plan is None
    plan = t.observe("s", W("a", "X"), "target").plan
    assert plan is not None
    assert plan.old == W("a", "b") and plan.release.messages_released_index == 1
    assert plan.session_id == "s" and plan.target == "target"


def test_sessions_are_isolated() -> None:
    t = table()
    t.observe("a", W("1", "2"), None)
    t.observe("b", W("9"), None)
    assert t.observe("b", W("9", "10"), None).plan is None
    assert t.observe("a", W("1"), None).plan is not None


def test_size_limit_evicts_least_recently_used() -> None:
    t = table(max_sessions=2)
    t.observe("a", W("1"), None)
    t.observe("b", W("1"), None)
    t.observe("a", W("1", "2"), None)  # a is now the most recent
    t.observe("c", W("1"), None)
    assert len(t) == 2 and t.evicted == 1
    # b was evicted: its next window is treated as new, so no release
    assert t.observe("b", W("X"), None).plan is None
    assert t.observe("a", W("X"), None).plan is None  # a was evicted by b's return


def test_idle_ttl_expires_sessions() -> None:
    clock = Clock()
    t = table(idle_ttl=10.0, clock=clock)
    t.observe("a", W("1", "2"), None)
    clock.now = 11.0
    assert t.observe("b", W("1"), None).plan is None
    assert len(t) == 1
    assert t.observe("a", W("X"), None).plan is None


def test_compressor_release_is_not_repeated_by_next_call() -> None:
    t = table()
    t.observe("s", W("a", "b", "c"), None)
    decision = t.rewrite("s", W("a", "short", "c").messages, "compressor:c")
    assert decision.plan is not None and decision.plan.release.reason == "compressor:c"
    assert (
        t.rewrite("s", W("a", "short", "c").messages, "compressor:c").skipped == "already_released"
    )
    assert decision.job is not None and t.claim(decision.job)  # the sender took it
    d = t.observe("s", W("a", "short", "c", "d"), None)
    assert d.plan is None and d.skipped == "already_released"
    assert d.covered is not None and d.covered.release.messages_released_index == 1
    assert d.wait_for is decision.job  # still being sent: the call waits for it
    # after that call the snapshot is the new window: a later rewrite releases again
    assert t.observe("s", W("a", "short"), None).plan is not None


def test_compressor_then_earlier_rewrite_releases_again() -> None:
    t = table()
    t.observe("s", W("a", "b", "c"), None)
    assert t.rewrite("s", W("a", "b", "C").messages, "compressor:x").plan is not None
    plan = t.observe("s", W("A", "b", "C"), None).plan
    assert plan is not None and plan.release.messages_released_index == 0


def test_compressor_on_unknown_session() -> None:
    assert table().rewrite("nobody", W("a").messages, "compressor:x").skipped == "unknown_session"


def test_policy_skips_are_reported() -> None:
    t = table(policy=ReleasePolicy(min_released_messages=2))
    t.observe("s", W("a", "b", "c"), None)
    assert t.observe("s", W("a", "b", "X"), None).skipped == "below_min_gain"


def test_session_of_source_list_identity() -> None:
    t = table()
    window = [{"role": "user", "content": "a"}]
    t.observe("s", W("a"), None, source=window)
    assert t.session_of(window) == "s"
    assert t.session_of(list(window)) is None
    t.observe("s", W("a"), None, source=None)
    assert t.session_of(window) is None


def test_invalid_size() -> None:
    with pytest.raises(ValueError):
        table(max_sessions=0)


def test_next_call_takes_over_an_unsent_compressor_release() -> None:
    t = table()
    t.observe("s", W("a", "b", "c"), None)
    decision = t.rewrite("s", W("a", "short", "c").messages, "compressor:c")
    assert decision.job is not None
    d = t.observe("s", W("a", "short", "c", "d"), None)
    assert d.plan is not None and d.plan.release.messages_released_index == 1
    assert d.plan.release.reason == "compressor:c"  # the label survives the hand-over
    assert decision.job.superseded and not t.claim(decision.job)  # the sender stands down
