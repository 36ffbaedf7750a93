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
