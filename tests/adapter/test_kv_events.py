"""vLLM's KV events stay exact with the plugin: a subscriber that replays them (``BlockStored``
adds a block's hash to its group's set, ``BlockRemoved`` takes it out, ``AllBlocksCleared``
empties every set) agrees with the engine's prefix cache after whatever the plugin does to the
free queue: releases, idles, a child's end, rewrites with side branches and retries, the
picker's swaps (it hands vLLM another victim than LRU's), on one group and on a hybrid model.
A KV-aware router (vllm-router's ``kv_aware``, Dynamo's, llm-d's) builds its view of each
replica from these events: the plugin reorders evictions, and vLLM's own eviction path still
reports each one."""

from __future__ import annotations

import os
from typing import Any

import torch
from hypothesis import settings
from hypothesis.stateful import invariant
from test_adapter_churn import ChurnMachine
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request
from vllm_parts import BLOCK, generate, make_request, run_prefill, state_of, tokens

from benchmarks.fleet.vllm_router import apply_kv_events
from vllm_affinity.core.compaction import side_branch
from vllm_affinity.engine import (
    PARENT_KEY,
    RETRY_KEY,
    REWRITE_KEY,
    apply_engine_patches,
    cached_block_hashes,
)

apply_engine_patches()


def manager_with_events(num_blocks: int, specs: list[Any]) -> KVCacheManager:
    """vLLM's ``KVCacheManager`` with KV events on (``--kv-events-config``)."""
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
    )
    return KVCacheManager(
        config,
        max_model_len=4096,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=True,
        enable_kv_cache_events=True,
    )


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)


def sliding() -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=64
    )


class Subscriber:
    """What a router holds: per group, the block hashes the events say are cached (replayed as
    ``benchmarks/fleet/vllm_router.py`` replays a live replica's, against the same engine listing
    ``/affinity/check?blocks=true`` serves)."""

    def __init__(self) -> None:
        self.cached: dict[int, set[str]] = {}

    def agrees_with(self, manager: KVCacheManager, exact: bool = True) -> None:
        """The events' view is the engine's (``exact``), or at least never holds a block the
        engine does not (a router never counts on a cache that is gone)."""
        apply_kv_events(self.cached, manager.block_pool.take_events())
        engine = {int(g): set(h) for g, h in cached_block_hashes(manager.block_pool).items()}
        for group in set(engine) | set(self.cached):
            seen, held = self.cached.get(group, set()), engine.get(group, set())
            phantom = seen - held
            assert not phantom, f"group {group}: {len(phantom)} blocks the events say are cached"
            if not exact:
                continue
            assert seen == held, (
                f"group {group}: the events say {len(seen)} blocks are cached, the engine holds "
                f"{len(held)}; only in the events: {len(seen - held)}, only in the engine: "
                f"{len(held - seen)}"
            )


class EventsChurn(ChurnMachine):
    """The churn machine (requests, decoding, preemption, releases, idles, the picker's swaps
    under pool pressure) with a subscriber checked after every step: never a block the engine
    does not hold. Not exact here: vLLM does not deduplicate blocks (``block_pool.py``, NOTE
    #1), and two requests that decode the same tokens after one prefix, or a resumed request
    that recomputes past a block evicted before the next one, cache one hash twice; the
    ``BlockRemoved`` of one copy hides the other from the events (an under-count: a router
    misses a hit, never counts on a gone one)."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = manager_with_events(24, [full()])
        self.state = state_of(self.manager)
        self.state.sessions._max_sessions = 3
        self.subscriber = Subscriber()

    @invariant()
    def events_agree(self) -> None:
        self.subscriber.agrees_with(self.manager, exact=False)


TestEventsChurn = EventsChurn.TestCase
TestEventsChurn.settings = settings(
    max_examples=int(os.environ.get("JIUWEN_CHURN_EXAMPLES", "150")) // 2,
    stateful_step_count=40,
    deadline=None,
)


def call(
    manager: KVCacheManager, prompt: list[int], session: str, key: str | None = None, **extra: Any
) -> Request:
    """One finished call of ``session`` through the engine's request hook."""
    params = SamplingParams(max_tokens=4, extra_args={**({key: key} if key else {}), **extra})
    request = make_request(prompt, session=session, sampling_params=params)
    state_of(manager).on_new_request(request, release_on_divergence=False)
    run_prefill(manager, request)
    generate(manager, request, 4)
    manager.free(request)
    return request


def test_events_agree_on_a_hybrid_model_through_every_plugin_path() -> None:
    """gpt-oss's shape (sliding window beside full attention), a pool too small for the
    traffic: sessions with side branches, a retry and a rewrite (its side branch set apart,
    then settled), idles, a subagent's end, and enough new prompts that every segment is
    reused; the picker on. The subscriber agrees with the engine after every call."""
    manager = manager_with_events(48, [sliding(), full()])
    state = state_of(manager)
    state.idle_guard = None  # every idle acted on
    state.predict_returns(True)  # the picker too (off by default on a hybrid model)
    subscriber = Subscriber()
    for round_ in range(4):
        base = 10_000 * (round_ + 1)
        call(manager, tokens(base, 5), "cc")
        call(manager, [*tokens(base + 5000, 1), *tokens(base + 100, 2)], side_branch("cc"))
        call(manager, [*tokens(base, 5), *tokens(base + 200, 1)], "cc")
        call(manager, [*tokens(base, 5), *tokens(base + 300, 1)], "cc", RETRY_KEY)
        subscriber.agrees_with(manager)
        call(manager, [*tokens(base, 1), *tokens(base + 400, 2)], "cc", REWRITE_KEY)
        call(manager, [*tokens(base + 5000, 1), *tokens(base + 500, 1)], side_branch("cc"))
        subscriber.agrees_with(manager)
        call(manager, tokens(base + 600, 3), f"child{round_}", **{PARENT_KEY: "cc"})
        state.idle_session(f"child{round_}")  # its task ended: released past its siblings'
        state.idle_session("cc")
        subscriber.agrees_with(manager)
        for other in range(3):  # pressure: new sessions reuse released, idle, normal blocks
            call(manager, tokens(base + 700 + 50 * other, 4), f"s{round_}{other}")
        subscriber.agrees_with(manager)
    stats = state.stats()
    assert stats.block_released_compaction > 0 and stats.blocks_idled > 0
    assert stats.block_released_child_end > 0
    assert manager.block_pool.get_usage() == 0.0


def test_the_plugin_counts_its_own_time_on_the_scheduler_path() -> None:
    """``engine_us`` grows with the plugin's work on the scheduler's path (binding a session's
    blocks, its frees, new blocks' unbinding), as ``/metrics`` shows it."""
    manager = manager_with_events(48, [full()])
    state = state_of(manager)
    assert state.engine_ns == 0 and state.stats().counter("engine_us") == 0
    call(manager, tokens(1000, 4), "s1")
    first = state.engine_ns
    assert first > 0
    for n in range(20):  # a thousand ns at least: the counter reads whole microseconds
        call(manager, tokens(2000 + 100 * n, 4), f"s{n + 2}")
    assert state.engine_ns > first
    assert state.queue.picker_ns > 0  # a pool too small for them: the picker chose victims
    total = (state.engine_ns + state.queue.picker_ns) // 1000
    assert state.stats().counter("engine_us") == total > 0
