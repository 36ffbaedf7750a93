"""What Belady keeps that the plugin lets go (``jiuwen_replay.gap``) and the simulator's
candidate predictors (pure, no server)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jiuwen_replay.gap import CLASSES, call_class, classify
from jiuwen_replay.returns import ReturnBets
from jiuwen_replay.simulator import PREDICTORS, Request, hits_per_request, simulate
from vllm_affinity.core.returns import BREAK, SILENT_AFTER, ReturnPredictor, swap_for

B = 4


def seq(start: int, blocks: int) -> tuple[int, ...]:
    """``blocks`` full blocks and one token more (all of them hittable); a longer one from the
    same start extends a shorter one."""
    return tuple(range(start, start + blocks * B + 1))


def test_call_classes() -> None:
    lead_1 = Request("L", seq(0, 2))
    calls = [
        lead_1,  # 0: a lead's first call
        Request("S", seq(500, 2)),  # 1: a subagent's first call
        Request("L", seq(0, 3)),  # 2: the lead back from its subagent
        Request("L", seq(0, 4), finish="stop"),  # 3: a tool loop, away 1 call
        Request("L", seq(0, 5)),  # 4: back from its user
        Request("L", seq(0, 1)),  # 5: a rewrite
        Request("X", seq(900, 1)),
        Request("X", seq(900, 2)),
        Request("L", seq(0, 2)),  # 8: a tool loop, away 3 calls
    ]
    parents = {"S": "L"}
    expected = {0: 0, 1: 1, 2: 2, 3: 5, 4: 4, 5: 3, 8: 6}
    last: dict[str, int] = {}
    for index, request in enumerate(calls):
        kind = call_class(calls, index, last.get(request.session), parents)
        if index in expected:
            assert kind == CLASSES[expected[index]], index
        last[request.session] = index


def test_classify_accounts_for_every_token_and_refuses_ragged_input() -> None:
    calls = [Request("a", seq(0, 2)), Request("b", seq(100, 2)), Request("a", seq(0, 3))]
    shares = classify(calls, {}, [0, 0, 4], [0, 0, 8])
    assert sum(s.behind for s in shares.values()) == 4
    assert shares["tool loop, away 2-4 calls"].behind == 4
    assert sum(s.calls for s in shares.values()) == 3
    with pytest.raises(ValueError):
        classify(calls, {}, [0, 0], [0, 0, 8])


def cycle(sessions: int, rounds: int, blocks: int) -> list[Request]:
    """Sessions calling in turn, each prompt growing by one block a call: the tool loops of a
    lead's concurrent peers."""
    return [
        Request(f"s{s}", seq(s * 10_000, blocks + r))
        for r in range(rounds)
        for s in range(sessions)
    ]


def test_predicted_return_matches_belady_on_a_cycle_longer_than_the_pool() -> None:
    """Four sessions in turn, a pool for about two: LRU evicts each session's prompt shortly
    before it comes back (its prefix survives, its tail does not); evicting the session due
    back last keeps the others' whole, as Belady does. Idling a tool loop that outlasts LRU's
    reach is in between."""
    calls = cycle(4, 8, 3)
    hits = {
        p: simulate(calls, 24, p, block=B, generated=1)["hit_tokens"]
        for p in (
            "lru",
            "lifecycle",
            "lifecycle+loop",
            "lifecycle+reuse",
            "lifecycle+return-unguarded",
            "belady",
        )
    }
    assert hits["lifecycle"] == hits["lru"] < hits["lifecycle+loop"] < hits["lifecycle+reuse"]
    # the engine's form (only where LRU's victim is one session's block) loses nothing here
    assert hits["lifecycle+reuse"] == hits["lifecycle+return-unguarded"] == hits["belady"]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from("abc"),
            st.integers(0, 3),
            st.integers(1, 5),
            st.sampled_from(("tool_calls", "stop", "end")),
        ),
        min_size=1,
        max_size=25,
    ),
    st.integers(min_value=6, max_value=30),
)
def test_predictors_stay_within_bounds(
    spec: list[tuple[str, int, int, str]], capacity: int
) -> None:
    calls = [Request(s, seq(v * 100, n), finish) for s, v, n, finish in spec]
    infinite = hits_per_request(calls, capacity, "infinite", B, 1)
    for policy in PREDICTORS:
        hits = hits_per_request(calls, capacity, policy, B, 1)
        assert all(0 <= h <= i for h, i in zip(hits, infinite, strict=True)), policy


def test_return_predictor_learns_absences_and_grows_overdue_ones() -> None:
    returns = ReturnPredictor()
    assert returns.due("a") == float("inf")  # not known: LRU's order
    for session in ("a", "b", "c", "a"):  # a: away 3 calls
        returns.called(session)
    assert returns.now == 4
    assert returns.due("a") == 3 + 3  # back its last absence after its last call
    assert returns.due("b") == 1 + 3  # no absence yet: the last one of any session
    for session in ("x", "y", "z"):
        returns.called(session)
    assert returns.now == 7
    assert returns.due("b") == 7 + (7 - 1)  # overdue: as long again as it has been away
    assert returns.back_last_first()[0] == "b"
    assert returns.back_last_first(limit=1) == ["b", "z"]  # the oldest and the latest
    bounded = ReturnPredictor(max_sessions=2)
    for session in ("s1", "s2", "s3"):
        bounded.called(session)
    assert len(bounded) == 2 and bounded.due("s1") == float("inf")
    with pytest.raises(ValueError):
        ReturnPredictor(max_sessions=0)


def test_return_bets_trust_only_won_bets_and_stay_bounded() -> None:
    bets = ReturnBets(max_bets=2, window=4)
    assert not bets.trusted()  # no evidence: LRU's choice
    bets.bet("x", "y")
    bets.bet("x", "y")  # once per pair
    bets.called("y")  # LRU's victim came back first: the prediction was right
    assert (bets.won, bets.lost) == (1, 0) and bets.trusted()
    bets.bet("p", "q")
    bets.called("p")  # the chosen session came back first: lost
    assert (bets.won, bets.lost) == (1, 1) and not bets.trusted()
    for pair in (("a", "b"), ("c", "d"), ("e", "f")):
        bets.bet(*pair)
    assert len(bets._bets) == 2  # the oldest open bet went first
    with pytest.raises(ValueError):
        ReturnBets(window=0)


def test_a_hinted_call_is_due_when_its_hint_says() -> None:
    """``X-KV-Next-Use`` on the engine's request clock: the requests that pass per hinted
    second are learned from hinted absences; a hinted session is due its hint after its last
    call, and one that breaks its word is overdue like any other."""
    returns = ReturnPredictor()
    returns.called("a", next_use=10.0)
    for session in ("x", "y", "z", "w"):
        returns.called(session)
    returns.called("a")  # back 5 requests after a 10-second hint: 0.5 requests per second
    returns.called("long", next_use=40.0)  # due 20 requests after its call
    returns.called("short", next_use=2.0)  # due 1 request after
    assert returns.due("long") == 6 + 20 and returns.due("short") == 7 + 1
    returns.called("other")
    assert returns.due("short") == 9 + (9 - 7)  # it broke its word: overdue, as long again
    assert returns.back_last_first()[0] == "long"
    unhinted = ReturnPredictor()
    unhinted.called("long", next_use=40.0)  # no hinted absence yet: the call order decides
    unhinted.called("b")
    assert unhinted.due("long") == 2 + (2 - 0)  # the call order's rule (overdue), not the hint


def test_a_session_that_hinted_every_call_and_then_falls_silent_is_not_due_back() -> None:
    """An agent that knows its schedule sends no hint on a session's last call: after
    ``SILENT_AFTER`` hinted calls in a row, a call without one reads as the last (due back
    after every other session) until the session calls again. Fewer hints in a row, or a
    session that never hinted, keep the call order's rule."""
    returns = ReturnPredictor()
    for _ in range(SILENT_AFTER):
        returns.called("hinter", next_use=0.0)  # a tool call: live, says nothing of when
        returns.called("other")
    returns.called("hinter")  # no hint after a run of them: its last call
    returns.called("other")
    assert returns.due("hinter") == float("inf")
    assert returns.back_last_first()[0] == "hinter"
    returns.called("hinter")  # it came back after all: the call order decides again
    assert returns.due("hinter") < float("inf")
    sporadic = ReturnPredictor()
    for _ in range(SILENT_AFTER - 1):
        sporadic.called("s", next_use=300.0)
    sporadic.called("s")  # too few hints in a row to read anything into one missing
    assert sporadic.due("s") < float("inf")


def test_a_forgotten_session_is_no_candidate_and_left_in_lrus_order() -> None:
    """A subagent's end (``Families._end_child``): what it keeps belongs to its family, so
    the picker neither evicts from it as a session due back late nor spares it: its blocks go
    in LRU's order, as on vanilla. Spared as a session due back first (the form before), an
    ended subagent's kept start outlived every live session's blocks: on the Claude Code
    trace at 0.1x the real server computed 62,424 prompt tokens, 61,688 without the pin."""
    returns = ReturnPredictor()
    for session in ("child", "lead", "child"):
        returns.called(session)
    returns.forget("child")
    assert "child" not in returns.back_last_first()
    assert returns.due("child") == float("inf") and len(returns) == 1
    assert not swap_for(returns.due("lead"), returns.due("child"))  # LRU's victim goes


def test_a_session_back_from_a_break_is_due_in_its_usual_rhythm() -> None:
    """An absence over ``BREAK`` times the longest of the session's earlier ones (a user back
    from lunch, a trace replayed again under the same names) is a break: the session resumes
    its rhythm, so it is due that bound after the call, not another break later. On a real
    server a replay after two earlier ones computed 1,600 prompt tokens against vanilla's 1,536
    without this rule, 1,536 with it."""
    returns = ReturnPredictor()
    for _ in range(3):  # a and b in turn: away 1 call each time
        returns.called("a")
        returns.called("b")
    for i in range(50):
        returns.called(f"other-{i}")
    returns.called("a")  # back after 50 calls away
    assert returns.due("a") == returns.now - 1 + BREAK * 2
    returns.called("b")
    returns.called("a")  # its rhythm again: the last absence rules
    assert returns.due("a") == returns.now - 1 + 2
    first = ReturnPredictor()
    first.called("c")
    for i in range(9):
        first.called(f"x-{i}")
    first.called("c")  # one absence only: nothing says it is a break
    assert first.due("c") == first.now - 1 + 10


def test_the_picker_swaps_for_a_session_due_later_or_as_late_but_not_between_two_gone() -> None:
    assert swap_for(10, 5) and not swap_for(5, 10)
    assert swap_for(7, 7)  # due together: the one that called last goes, not LRU's next caller
    assert not swap_for(float("inf"), float("inf"))  # both gone: LRU's order
    assert swap_for(float("inf"), 7) and swap_for(3, float("-inf"))
