"""The offline simulator and the trace generator (pure, no server)."""

from __future__ import annotations

import pytest
from agent_trace import PLACEHOLDER, TraceConfig, describe, generate
from cache_sim import POLICIES, Request, gap_closed, simulate, working_set
from hypothesis import given, settings
from hypothesis import strategies as st

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
