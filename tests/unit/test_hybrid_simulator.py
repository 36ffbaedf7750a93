"""The hybrid-model simulator (full attention beside sliding-window or Mamba groups)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jiuwen_replay.hybrid_simulator import (
    HybridModel,
    HybridRequest,
    full_attention_bound,
    simulate_hybrid,
)
from jiuwen_replay.simulator import CapacityError

SWA = HybridModel(block=4, sparse_kind="sliding_window", window_blocks=2)
MAMBA = HybridModel(block=4, sparse_kind="mamba")
INSTRUCTIONS = tuple(range(1000, 1024))  # six blocks


def hits(requests: list[HybridRequest], model: HybridModel, policy: str, **kw: int) -> int:
    return int(simulate_hybrid(requests, 10_000, model, policy, **kw)["hit_tokens"])


def new_sessions(n: int, instructions: int = len(INSTRUCTIONS)) -> list[HybridRequest]:
    """``n`` sessions' first calls: the same instructions, then a task of their own."""
    return [
        HybridRequest(f"s{k}", INSTRUCTIONS + tuple(range(k * 100, k * 100 + 9)), instructions)
        for k in range(n)
    ]


@pytest.mark.parametrize("model", [SWA, MAMBA], ids=["sliding_window", "mamba"])
def test_vanilla_hits_shared_instructions_from_their_third_appearance(model: HybridModel) -> None:
    """The second call pins the junction (full attention hit further): the third hits."""
    calls = new_sessions(3)
    per_call = [
        hits(calls[: k + 1], model, "lru") - hits(calls[:k], model, "lru") for k in range(3)
    ]
    assert per_call == [0, 0, 24]


@pytest.mark.parametrize("model", [SWA, MAMBA], ids=["sliding_window", "mamba"])
def test_the_checkpoint_hits_them_from_the_second(model: HybridModel) -> None:
    calls = new_sessions(3, instructions=len(INSTRUCTIONS) + 2)  # floored to six blocks
    per_call = [
        hits(calls[: k + 1], model, "checkpoint") - hits(calls[:k], model, "checkpoint")
        for k in range(3)
    ]
    assert per_call == [0, 24, 24]


def test_a_compactions_first_call_hits_the_kept_instructions() -> None:
    """Four turns, then a window of the instructions and a summary: the checkpoint kept from
    the first call serves it; vanilla recomputes them."""
    window = INSTRUCTIONS + tuple(range(9))
    calls = [HybridRequest("a", window, len(INSTRUCTIONS))]
    for turn in range(3):
        window += tuple(range(200 + 20 * turn, 213 + 20 * turn))
        calls.append(HybridRequest("a", window, len(INSTRUCTIONS)))
    compacted = HybridRequest("a", INSTRUCTIONS + tuple(range(500, 509)), len(INSTRUCTIONS))
    for policy, expected in (("lru", 0), ("release", 0), ("checkpoint", 24)):
        before = hits(calls, SWA, policy)
        assert hits([*calls, compacted], SWA, policy) - before == expected, policy


def test_a_retention_interval_keeps_states_every_interval() -> None:
    calls = new_sessions(2)
    second = hits(calls, SWA, "interval", interval=4) - hits(calls[:1], SWA, "interval", interval=4)
    assert second == 16  # the state at block 4; block 6 was no interval's


def test_a_tight_pool_evicts_and_the_bound_is_full_attentions_belady() -> None:
    calls = new_sessions(6)
    tight = simulate_hybrid(calls, 40, SWA, "checkpoint")["hit_tokens"]
    assert tight <= full_attention_bound(calls, 40, SWA)["hit_tokens"]
    with pytest.raises(CapacityError):
        simulate_hybrid(calls, 5, SWA, "lru")
    with pytest.raises(ValueError, match="policy"):
        simulate_hybrid(calls, 40, SWA, "belady")
    with pytest.raises(ValueError, match="sparse_kind"):
        HybridModel(block=4, sparse_kind="mla")


def test_the_hybrid_grid_never_computes_more_than_vanilla(tmp_path: Path) -> None:
    """``benchmarks/hybrid/hybrid_sim``'s grid on the synthetic trace in every format, three hybrid
    shapes: the plugin (release and the instructions' checkpoint) computes no more prompt tokens
    than vanilla in any cell, and no cell beats the full-attention Belady bound."""
    from benchmarks.hybrid.hybrid_sim import POOLS, grid
    from benchmarks.lifecycle.never_worse_sim import synthetic_traces

    rows = []
    for name, trace in synthetic_traces(tmp_path).items():
        rows += grid(name, trace, POOLS, per_block=1)
    assert len(rows) >= 20 and {r["shape"] for r in rows} == {"gpt-oss", "gemma3", "qwen3-next"}
    worse = [r for r in rows if r["checkpoint"] > r["lru"]]
    assert not worse, worse
    assert any(r["checkpoint"] < r["lru"] for r in rows)  # the grid tells the two apart
    policies = ("lru", "interval", "release", "checkpoint")
    assert all(r["bound"] <= min(r[p] for p in policies) for r in rows)
