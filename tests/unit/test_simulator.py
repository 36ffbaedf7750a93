"""The offline simulator and the trace generator (pure, no server)."""

from __future__ import annotations

import statistics
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.agents.agent_trace import (
    PLACEHOLDER,
    TraceConfig,
    describe,
    generate,
    generate_timed,
)
from jiuwen_replay.simulator import POLICIES, Request, gap_closed, simulate, working_set

B = 4  # small blocks keep the scenarios readable


def seq(start: int, blocks: int) -> tuple[int, ...]:
    return (*range(start, start + blocks * B), 99_999)  # + one token: all blocks hittable


def squeeze() -> list[Request]:
    """B idles; A (hot) is rewritten; C needs more than the free blocks; B comes back."""
    a_old, a_new = seq(0, 6), seq(0, 1) + seq(500, 1)
    return [
        Request("B", seq(1000, 3)),
        Request("A", a_old),
        Request("A", a_new),  # rewrite after block 1: A's blocks 1.. are stale
        Request("C", seq(2000, 8)),
        Request("B", seq(1000, 3)),
    ]


def test_release_keeps_the_idle_session_prefix() -> None:
    trace = squeeze()
    lru = simulate(trace, 16, "lru", block=B, generated=1)
    rel = simulate(trace, 16, "lru_release", block=B, generated=1)
    # B's return hits 3 blocks only when A's stale blocks went first
    assert rel["hit_tokens"] - lru["hit_tokens"] == 3 * B
    assert simulate(trace, 16, "infinite", block=B, generated=1)["hit_tokens"] >= rel["hit_tokens"]


def test_no_pressure_all_policies_agree() -> None:
    trace = squeeze()
    hits = {p: simulate(trace, 1000, p, block=B, generated=1)["hit_tokens"] for p in POLICIES}
    assert len(set(hits.values())) == 1


def test_vllm_never_hits_the_last_token() -> None:
    exact = tuple(range(2 * B))  # a prompt of exactly two blocks
    result = simulate([Request("s", exact), Request("s", exact)], 100, "lru", block=B)
    assert result["hit_tokens"] == B  # the second block is recomputed


def test_capacity_error_and_unknown_policy() -> None:
    with pytest.raises(RuntimeError):
        simulate([Request("s", seq(0, 10))], 3, "lru", block=B)
    with pytest.raises(ValueError):
        simulate([], 3, "fifo")


requests = st.lists(
    st.tuples(st.sampled_from("abc"), st.integers(0, 3), st.integers(1, 5)), min_size=1, max_size=25
)


@settings(max_examples=60, deadline=None)
@given(requests, st.integers(min_value=6, max_value=30))
def test_bounds(spec: list[tuple[str, int, int]], capacity: int) -> None:
    """Infinite bounds everything; Belady is never worse than LRU; hits never exceed queries."""
    trace = [Request(s, seq(variant * 100, blocks)) for s, variant, blocks in spec]
    results = {p: simulate(trace, capacity, p, block=B, generated=1) for p in POLICIES}
    for r in results.values():
        assert 0 <= r["hit_tokens"] <= r["query_tokens"]
        assert r["hit_tokens"] <= results["infinite"]["hit_tokens"]
    assert results["belady"]["hit_tokens"] >= results["lru"]["hit_tokens"]
    closed = gap_closed(results)
    assert closed is None or closed <= 1.0 + 1e-9  # release never beats the optimal (Belady)


def test_working_set_counts_shared_blocks_once() -> None:
    shared = seq(0, 2)[:-1]
    trace = [Request("a", shared + seq(100, 1)), Request("b", shared + seq(200, 1))]
    assert working_set(trace, B) == 4


def test_trace_is_deterministic_and_compacts() -> None:
    config = TraceConfig(sessions=4, bursts_per_session=2, steps_per_burst=4, compact_after_tools=2)
    first, second = generate(config), generate(config)
    assert [c.window for c in first] == [c.window for c in second]
    summary = describe(first)
    assert summary["calls"] == 4 * 2 * 4 and summary["sessions"] == 4
    assert sum(summary["compactions"].values()) > 0
    micro = [c for c in first if c.compaction == "micro"]
    assert micro and any(m["content"] == PLACEHOLDER for m in micro[0].window)
    for call in first:  # every tool result answers a tool call in the same window
        ids = {tc["id"] for m in call.window for tc in m.get("tool_calls", [])}
        assert all(m["tool_call_id"] in ids for m in call.window if m["role"] == "tool")


def _return_hits(policy: str, a_finish: str) -> int:
    """B goes into a tool call; A, used after B, ends its call with ``a_finish``; C needs more
    than the free blocks; then B comes back. Returns the tokens B's return hits."""
    trace = [
        Request("B", seq(1000, 3), finish="tool_calls"),
        Request("A", seq(0, 3), finish=a_finish),
        Request("C", seq(2000, 11)),  # 12 blocks: 2 cached blocks must go
    ]
    back = Request("B", seq(1000, 3))
    # the IDLE segment itself: every idle acted on (the guard has seen no absence here)
    before = simulate(trace, 16, policy, block=B, generated=1, idle_guard=False)["hit_tokens"]
    after = simulate([*trace, back], 16, policy, block=B, generated=1, idle_guard=False)
    return after["hit_tokens"] - before


def test_lifecycle_evicts_the_idle_session_before_the_one_in_a_tool_call() -> None:
    # LRU evicts B's tail (B was used before A): B's return hits its first block only
    assert _return_hits("lru", "stop") == B
    # A waits for its user: its blocks go first, B's whole prefix survives
    assert _return_hits("lifecycle", "stop") == 3 * B
    # A is inside a tool call too: nothing to prefer, LRU order decides
    assert _return_hits("lifecycle", "tool_calls") == B
    # an ended session is released whole: the same effect
    assert _return_hits("lifecycle", "end") == 3 * B


def test_oracles_know_the_next_compaction_and_who_returns_first() -> None:
    """What lifecycle cannot know, each oracle's own case (both reach Belady there)."""
    # A's next call rewrites its window, and C needs room before it comes: released only when
    # the rewrite arrives, A's doomed blocks stay while C evicts B's tail.
    doomed = [
        Request("B", seq(1000, 3)),
        Request("A", seq(0, 6)),
        Request("C", seq(2000, 8)),
        Request("A", seq(0, 1) + seq(500, 1)),
        Request("B", seq(1000, 3)),
    ]
    # D and E wait on their users; C squeezes; D's user answers first: FIFO by idle time
    # evicts D's blocks (idle longest).
    two_idle = [
        Request("D", seq(3000, 3), finish="stop"),
        Request("E", seq(4000, 3), finish="stop"),
        Request("C", seq(2000, 13)),
        Request("D", seq(3000, 3)),
    ]
    for trace, oracle in ((doomed, "lifecycle+early"), (two_idle, "lifecycle+order")):
        hits = {
            p: simulate(trace, 16, p, block=B, generated=1, idle_guard=False)["hit_tokens"]
            for p in ("lifecycle", oracle, "lifecycle+both", "belady")
        }
        assert hits["lifecycle"] < hits[oracle] == hits["lifecycle+both"] == hits["belady"], hits


def test_timed_trace_has_the_same_sessions_on_a_clock() -> None:
    config = TraceConfig(sessions=5, bursts_per_session=2, steps_per_burst=3)
    ordered, timed = generate(config), generate_timed(config)
    by_session = {}
    for call in ordered:
        by_session.setdefault(call.session, []).append(call.window)
    for session, windows in by_session.items():
        assert [c.window for c in timed if c.session == session] == windows
    assert [c.at for c in timed] == sorted(c.at for c in timed)
    for trace in (ordered, timed):
        assert describe(trace)["finish"] == {"tool_calls": 20, "stop": 5, "end": 5}
    # a session's calls after a stop are farther apart than after a tool call (medians)
    steps: dict[str, list[float]] = {"tool_calls": [], "stop": []}
    last: dict[str, Any] = {}
    for call in timed:
        if call.session in last and last[call.session].finish in steps:
            steps[last[call.session].finish].append(call.at - last[call.session].at)
        last[call.session] = call
    assert statistics.median(steps["stop"]) > 3 * statistics.median(steps["tool_calls"])


def _script_driven(rounds: int = 6) -> list[Request]:
    """A lead whose "user" is a script: it answers (``stop``) and is back after one short
    tool session, long before LRU would have reached its blocks."""
    requests, lead = [], list(range(1000, 1008))
    for k in range(rounds):
        requests.append(Request("lead", tuple(lead), "stop"))
        lead = [*lead, 2000 + k]
        requests.append(Request(f"tool{k}", tuple(range(3000 + 10 * k, 3003 + 10 * k))))
    return requests


def _really_away(rounds: int = 5) -> list[Request]:
    """A lead that stays away while two live sessions run three tool calls each."""
    requests, lead = [], list(range(1000, 1006))
    a, b = list(range(2000, 2005)), list(range(3000, 3005))
    for k in range(rounds):
        requests.append(Request("lead", tuple(lead), "stop"))
        lead = [*lead, 1100 + k]
        for j in range(3):
            requests.append(Request("a", tuple(a)))
            a = [*a, 2100 + 10 * k + j]
            requests.append(Request("b", tuple(b)))
            b = [*b, 3100 + 10 * k + j]
    return requests


def _hits(requests: list[Request], capacity: int, policy: str, guard: bool = True) -> int:
    return int(
        simulate(requests, capacity, policy, block=1, generated=1, idle_guard=guard)["hit_tokens"]
    )


def test_the_idle_guard_keeps_a_script_driven_session_as_lru_would() -> None:
    trace = _script_driven()
    lru = _hits(trace, 18, "lru")
    assert _hits(trace, 18, "lifecycle", guard=False) < lru  # every idle was wrong
    assert _hits(trace, 18, "lifecycle") == lru


def test_the_idle_guard_keeps_idling_a_session_that_stays_away() -> None:
    trace = _really_away()
    lru = _hits(trace, 24, "lru")
    assert _hits(trace, 24, "lifecycle") > lru
    assert _hits(trace, 24, "lifecycle") <= _hits(trace, 24, "lifecycle", guard=False)


def test_a_waiting_lead_idles_once_its_waits_outlast_lrus_reach_and_is_back_at_its_end() -> None:
    """The picker's simulator, as the plugin (``Families._idle_waiting``): a lead's own
    blocks go to IDLE when its subagent starts, once an earlier wait of its outlasted LRU's
    reach, and back to the live ones when the subagent ends its task; a child named by no
    parent changes nothing."""
    from jiuwen_replay.simulator import _Cache, block_hashes

    def wait(cache: _Cache, child: str, squeeze: int, parent: str | None = "L") -> int:
        """The lead calls, its subagent runs while ``squeeze`` blocks of other work come, and
        ends: the lead's blocks that were IDLE while it waited."""
        lead = seq(0, 3)
        cache.request("L", block_hashes(lead, B), len(lead), 1)
        task = seq(5000 + 100 * squeeze, 1)
        cache.request(child, block_hashes(task, B), len(task), 1, parent=parent)
        idled = sum(b in cache.idle for b in cache.latest["L"])
        work = seq(9000 + 100 * squeeze, squeeze)
        cache.request(f"work-{child}", block_hashes(work, B), len(work), 1)
        cache.finished(child, "end")
        assert not cache.idle.keys() & set(cache.latest["L"])  # back with the live ones
        return idled

    cache = _Cache(16, "lifecycle+return-unguarded", [], B, idle_guard=True)
    assert wait(cache, "first", 14) == 0  # no evidence yet
    # the first wait outlasted LRU's reach: the lead's 3 blocks went IDLE, and the first of
    # them (its tail) was already reused by its subagent's own call
    assert wait(cache, "second", 2) == 2
    unnamed = _Cache(16, "lifecycle+return-unguarded", [], B, idle_guard=True)
    assert [wait(unnamed, child, n, parent=None) for child, n in (("a", 14), ("b", 2))] == [0, 0]
    lru = _Cache(16, "lru", [], B, idle_guard=True)
    assert [wait(lru, child, n) for child, n in (("a", 14), ("b", 2))] == [0, 0]


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("capacity", [12, 20, 40])
def test_beladys_heap_evicts_what_the_max_over_the_queue_would(
    seed: int, capacity: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heap (full-size traces) picks the victim the definition picks: the queued block
    used farthest ahead, the deepest, then the least recently queued."""
    import random

    from jiuwen_replay import simulator

    rng = random.Random(seed)
    prompts: dict[str, list[int]] = {f"s{i}": [rng.randrange(5)] * 8 for i in range(6)}
    requests = []
    for _ in range(80):
        session = rng.choice(list(prompts))
        prompt = prompts[session]
        if rng.random() < 0.15:  # a rewrite keeps a prefix
            prompt = prompt[: rng.randrange(1, len(prompt) + 1)]
        prompts[session] = (prompt + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))])[
            -120:
        ]
        requests.append(Request(session, tuple(prompts[session])))

    def by_definition(cache: Any) -> int:
        key = lambda b: (cache._next_use(cache.hash_of[b]), cache.depth_of[b])  # noqa: E731
        return max(cache.order, key=key)

    try:
        heap = simulator.hits_per_request(requests, capacity, "belady", B)
    except simulator.CapacityError:
        return
    monkeypatch.setattr(simulator._Cache, "_farthest", by_definition)
    assert heap == simulator.hits_per_request(requests, capacity, "belady", B)
