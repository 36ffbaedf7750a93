"""The idle guard (``vllm_affinity/core/idle_guard.py``): an idle is acted on only when the
session's last absence outlasted LRU's reach, on the pool's eviction clock."""

from __future__ import annotations

import pytest

from vllm_affinity.core.idle_guard import IdleGuard


def test_with_no_history_the_signal_waits_for_evidence() -> None:
    assert not IdleGuard().worth_idling("a")


def test_a_quick_return_stops_the_next_idle_and_a_long_absence_restores_it() -> None:
    guard = IdleGuard()
    guard.went_idle("a", evictions=100, cached=50)
    guard.came_back("a", evictions=120)  # 20 evicted of the 50 ahead: LRU kept it all
    assert not guard.worth_idling("a")
    guard.went_idle("a", evictions=120, cached=50)  # noted even when not acted on
    guard.came_back("a", evictions=180)  # 60 evicted: past LRU's reach
    assert guard.worth_idling("a")


def test_a_new_session_goes_by_the_last_absence_of_any() -> None:
    guard = IdleGuard()
    guard.went_idle("a", 0, 10)
    guard.came_back("a", 2)
    assert not guard.worth_idling("new")
    guard.went_idle("b", 2, 10)
    guard.came_back("b", 30)
    assert guard.worth_idling("new") and not guard.worth_idling("a")


def test_a_call_without_an_idle_before_it_teaches_nothing() -> None:
    guard = IdleGuard()
    guard.came_back("a", 5)
    assert not guard.worth_idling("a") and len(guard) == 0


def test_an_empty_queue_counts_as_one_block_ahead() -> None:
    guard = IdleGuard()
    guard.went_idle("a", 7, 0)
    guard.came_back("a", 7)  # nothing evicted, nothing cached: ratio 0, not a division by 0
    assert not guard.worth_idling("a")


def test_bounded() -> None:
    guard = IdleGuard(max_sessions=2)
    for name in "abc":
        guard.went_idle(name, 0, 1)
        guard.came_back(name, 0)
    assert len(guard) == 2
    assert not guard.worth_idling("c")
    with pytest.raises(ValueError, match="max_sessions"):
        IdleGuard(max_sessions=0)


def hinted_absences(guard: IdleGuard, per_second: float, hints: list[float]) -> None:
    """Absences of session "h" whose reach, in LRU's, is ``per_second`` times its hint."""
    for hint in hints:
        guard.went_idle("h", 0, 100, next_use=hint)
        guard.came_back("h", round(100 * per_second * hint))


def test_a_hint_says_how_far_past_lrus_reach_the_absence_will_last() -> None:
    guard = IdleGuard()
    hinted_absences(guard, 0.01, [20.0, 50.0, 400.0])  # one reach per 100 hinted seconds
    assert guard.worth_idling("h")  # no hint: its last absence (4 reaches) decides
    guard.went_idle("h", 0, 100)
    guard.came_back("h", 10)  # a short one, without a hint
    assert not guard.worth_idling("h")
    assert not guard.worth_idling("h", next_use=30.0)  # 0.3 reaches
    assert guard.worth_idling("h", next_use=250.0)  # 2.5 reaches: sure, whatever the history
    assert not guard.worth_idling("h", next_use=120.0)  # 1.2: plausible, history says no
    guard.went_idle("h", 0, 100)
    guard.came_back("h", 150)  # now the history says yes
    assert guard.worth_idling("h", next_use=120.0)
    assert not guard.worth_idling("h", next_use=40.0)  # 0.4: not even plausible


def test_without_a_hinted_absence_a_hint_changes_nothing() -> None:
    guard = IdleGuard()
    guard.went_idle("a", 0, 10)
    guard.came_back("a", 30)  # no hint that time
    assert guard.worth_idling("a", next_use=1.0) and guard.worth_idling("a")
    assert not IdleGuard().worth_idling("new", next_use=3000.0)  # no evidence at all


def test_a_hint_of_an_hour_or_more_is_acted_on_without_evidence() -> None:
    """The agent's word that its task is over (a session's last call), as it ends a
    subagent's: such sessions never come back, so evidence would never come."""
    guard = IdleGuard()
    assert guard.worth_idling("last", next_use=3600.0)
    guard.went_idle("a", 0, 10)
    guard.came_back("a", 0)  # a quick return: history says "returns soon"
    assert guard.worth_idling("a", next_use=7200.0) and not guard.worth_idling("a")


def test_the_rate_is_learned_from_the_latest_hinted_absences() -> None:
    guard = IdleGuard()
    hinted_absences(guard, 0.001, [100.0] * 16)  # a quiet pool: 0.1 reach per 100 s
    assert not guard.worth_idling("x", next_use=1000.0)  # 1 reach: only plausible, no history
    hinted_absences(guard, 0.01, [100.0] * 16)  # the pool got busy: the old rate is forgotten
    assert guard.worth_idling("x", next_use=250.0)
