"""The engine adapter on the real vLLM KVCacheManager / BlockPool classes (no model)."""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, FreeKVCacheBlockQueue, KVCacheBlock
from vllm_parts import (
    BLOCK,
    generate,
    make_manager,
    make_request,
    run_prefill,
    state_of,
    tokens,
)

from vllm_affinity import compat
from vllm_affinity.core import Segment, SegmentedFreeBlockQueue
from vllm_affinity.core.block_states import FEW_BLOCKS
from vllm_affinity.engine import apply_engine_patches

apply_engine_patches()


def assert_no_leak(manager: Any) -> None:
    """Every block except the null block is in use or in exactly one segment."""
    pool = manager.block_pool
    queue = state_of(manager).queue
    queued = [b.block_id for b in queue.get_all_free_blocks()]
    assert len(queued) == len(set(queued)) == queue.num_free_blocks
    for block in pool.blocks[1:]:
        in_queue = queue.segment_of(block) is not None
        assert in_queue == (block.block_id in queued)
        assert in_queue != (block.ref_cnt > 0), block


def test_queue_is_swapped_in() -> None:
    manager = make_manager(10)
    assert isinstance(manager.block_pool.free_block_queue, SegmentedFreeBlockQueue)
    assert state_of(manager).queue.segment_sizes() == {
        "free": 9,
        "released": 0,
        "idle": 0,
        "normal": 0,
        "protected": 0,
    }
    assert_no_leak(manager)


def test_release_moves_stale_blocks_including_generated_ones() -> None:
    manager = make_manager(20)
    request = make_request(tokens(0, 4), session="A")
    assert run_prefill(manager, request) == [1, 2, 3, 4]
    generate(manager, request, BLOCK + 4)  # one full block of generated tokens + a partial
    manager.free(request)
    state = state_of(manager)
    result = state.release("A", 2)
    assert result.model_dump() == {
        "status": "ok",
        "block_released": 3,
        "moved": 3,
        "pending": 0,
        "kept_shared": 0,
        "first_stale_block": 2,
        "prompt_tokens": 0,  # filled in by the hash-chain paths, which know the record
    }
    sizes = state.queue.segment_sizes()
    assert sizes["released"] == 3 and sizes["normal"] == 2
    assert_no_leak(manager)


def test_released_blocks_are_reused_before_other_sessions_prefix() -> None:
    manager = make_manager(13)  # 12 usable blocks
    a = make_request(tokens(0, 4), session="A")
    b = make_request(tokens(1000, 4), session="B")
    run_prefill(manager, b)
    manager.free(b)  # B's prefix: older in LRU
    a_blocks = run_prefill(manager, a)
    manager.free(a)
    state_of(manager).release("A", 1)
    c = make_request(tokens(5000, 7), session="C")  # needs 7: 4 free + 3 released
    c_blocks = run_prefill(manager, c)
    assert set(a_blocks[1:]) <= set(c_blocks)
    assert state_of(manager).queue.released_reused == 3
    b2 = make_request(tokens(1000, 4), session="B")
    _, hits = manager.get_computed_blocks(b2)[:2]
    assert hits == 3 * BLOCK  # B's prefix survived (vLLM always recomputes the last block)
    assert_no_leak(manager)


def test_vanilla_lru_would_evict_the_other_session() -> None:
    """Control for the test above: without a release, B's prefix is what gets evicted."""
    manager = make_manager(13)
    b = make_request(tokens(1000, 4), session="B")
    run_prefill(manager, b)
    manager.free(b)
    a = make_request(tokens(0, 4), session="A")
    run_prefill(manager, a)
    manager.free(a)
    run_prefill(manager, make_request(tokens(5000, 7), session="C"))
    hits = manager.get_computed_blocks(make_request(tokens(1000, 4), session="B"))[1]
    assert hits < 3 * BLOCK


def test_prefix_hit_on_a_released_block_makes_it_live() -> None:
    manager = make_manager(20)
    a = make_request(tokens(0, 4), session="A")
    run_prefill(manager, a)
    manager.free(a)
    state = state_of(manager)
    state.release("A", 0)
    assert state.queue.segment_sizes()["released"] == 4
    b = make_request(tokens(0, 4), session="B")  # same prompt: the released blocks still hit
    _, hits = manager.get_computed_blocks(b)[:2]
    assert hits == 3 * BLOCK
    run_prefill(manager, b)
    manager.free(b)
    # the three blocks B hit are live again; the last one (recomputed by B) stays released
    assert state.queue.segment_sizes()["released"] == 1
    assert_no_leak(manager)


def test_release_of_blocks_in_use_is_pending_until_freed() -> None:
    manager = make_manager(20)
    a = make_request(tokens(0, 4), session="A")
    run_prefill(manager, a)
    state = state_of(manager)
    result = state.release("A", 1)
    assert result.pending == 3 and result.moved == 0
    assert state.queue.num_pending == 3
    manager.free(a)
    assert state.queue.num_pending == 0
    assert state.queue.segment_sizes()["released"] == 3
    assert_no_leak(manager)


def test_shared_prefix_is_never_released_by_one_session() -> None:
    """Both sessions used the prefix: neither's release demotes it (LRU decides)."""
    manager = make_manager(20)
    shared = tokens(0, 2)
    a = make_request(shared + tokens(100, 2), session="A")
    b = make_request(shared + tokens(200, 2), session="B")
    run_prefill(manager, a)
    run_prefill(manager, b)
    manager.free(a)
    manager.free(b)
    state = state_of(manager)
    first = state.release("A", 0)
    assert first.block_released == 2 and first.kept_shared == 2
    second = state.release("B", 0)
    assert second.block_released == 2 and second.kept_shared == 2
    assert state.queue.segment_sizes()["released"] == 4  # A's own two, B's own two
    assert state.release("A", 0).block_released == 0
    assert state.release("B", 0).block_released == 0
    assert_no_leak(manager)


def squeeze(idle: bool) -> tuple[int, int]:
    """B (in a tool call) is older in LRU than A (waiting on its user, idled when ``idle``); D
    has one released block; C then needs every free, released and idle block. Returns the
    prompt tokens B and A would still hit."""
    manager = make_manager(14)  # 13 usable blocks
    system = tokens(0, 1)
    b = make_request(system + tokens(200, 3), session="B")
    a = make_request(system + tokens(100, 3), session="A")
    d = make_request(tokens(300, 2), session="D")
    for request in (b, a, d):  # LRU order: B's blocks, A's, D's
        run_prefill(manager, request)
    for request in (b, a, d):
        manager.free(request)
    state = state_of(manager)
    state.idle_guard = None  # the IDLE segment itself: every idle signal acted on
    state.release("D", 1)
    if idle:
        assert state.idle_session("A").model_dump() == {
            "status": "ok",
            "blocks_idled": 3,
            "kept_shared": 1,
        }
        sizes = {"free": 4, "released": 1, "idle": 3, "normal": 5, "protected": 0}
        assert state.queue.segment_sizes() == sizes
        assert state.idle_session("A").blocks_idled == 0  # already idle
    run_prefill(manager, make_request(tokens(900, 8), session="C"))  # 4 + 1 + 3 blocks
    assert state.queue.released_reused == 1
    b_hits = manager.get_computed_blocks(make_request(system + tokens(200, 3), session="B"))[1]
    a_hits = manager.get_computed_blocks(make_request(system + tokens(100, 3), session="A"))[1]
    assert_no_leak(manager)
    return b_hits, a_hits


def test_idle_session_is_evicted_before_a_live_one_and_after_released_blocks() -> None:
    """C's blocks come from the released block, then A's idle ones: B, in its tool call, keeps
    its whole prefix although it is older; A keeps only the system block B shares."""
    b_hits, a_hits = squeeze(idle=True)
    assert b_hits == 3 * BLOCK
    assert a_hits == BLOCK


def test_without_idle_lru_evicts_the_session_in_a_tool_call() -> None:
    """Control for the test above: plain LRU takes the older B's blocks."""
    b_hits, a_hits = squeeze(idle=False)
    assert b_hits < 3 * BLOCK
    assert a_hits == 3 * BLOCK


def serve(manager: Any, state: Any, session: str, start: int, n_blocks: int) -> None:
    """One finished call of ``session``: a prompt of ``n_blocks`` blocks from ``start``."""
    request = make_request(tokens(start, n_blocks), session=session)
    state.on_new_request(request, release_on_divergence=False)
    run_prefill(manager, request)
    manager.free(request)


def test_an_idle_is_not_repeated_for_a_session_that_came_back_within_lrus_reach() -> None:
    """The idle guard (``core/idle_guard.py``) on vLLM's own classes: the pool's eviction count
    while the session was away, against the cached blocks ahead of it when it left."""
    manager = make_manager(14)  # 13 usable blocks
    state = state_of(manager)

    call = functools.partial(serve, manager, state)
    call("A", 0, 3)
    assert state.idle_session("A").status == "returns_soon"  # nothing learned yet
    call("A", 0, 3)  # back before a single block was evicted
    before = state.queue.segment_sizes()
    again = state.idle_session("A")
    assert again.status == "returns_soon" and again.blocks_idled == 0
    assert state.queue.segment_sizes() == before and state.stats().idles_returns_soon == 2
    call("B", 500, 13)  # while A is away: every cached block is evicted
    call("A", 0, 3)
    last = state.idle_session("A")  # it stayed away past LRU's reach
    assert last.status == "ok" and last.blocks_idled > 0
    assert state.check(idle=True) == []
    assert_no_leak(manager)


def test_a_hinted_idle_is_judged_by_its_hint() -> None:
    """The idle guard weighs the agent's hint (``X-KV-Next-Use``): once a hinted absence has
    shown how many of LRU's reaches pass per hinted second, a long hint is acted on although
    the session's own last absence came back within LRU's reach, and a short one is not."""
    manager = make_manager(14)  # 13 usable blocks
    state = state_of(manager)

    call = functools.partial(serve, manager, state)
    call("B", 900, 3)
    assert state.idle_session("B", next_use=100.0).status == "returns_soon"  # nothing learned
    call("C", 500, 13)  # every cached block evicted while B is away: ~1 reach per 100 s
    call("B", 900, 3)
    call("A", 0, 3)
    state.idle_session("A")  # no hint
    call("A", 0, 3)  # back before a block was evicted: A's history says "returns soon"
    assert state.idle_session("A", next_use=20.0).status == "returns_soon"  # ~0.2 reaches
    call("A", 0, 3)
    hinted = state.idle_session("A", next_use=500.0)  # ~5 reaches: sure
    assert hinted.status == "ok" and hinted.blocks_idled > 0
    assert state.check(idle=True) == []
    assert_no_leak(manager)


def test_idle_does_nothing_to_a_running_or_unknown_session() -> None:
    manager = make_manager(10)
    a = make_request(tokens(0, 3), session="A")
    run_prefill(manager, a)
    state = state_of(manager)
    assert state.idle_session("A").model_dump() == {
        "status": "running",
        "blocks_idled": 0,
        "kept_shared": 0,
    }
    assert state.idle_session("nobody").status == "unknown_session"
    manager.free(a)
    assert state.queue.segment_sizes()["idle"] == 0
    assert state.stats().idles == 2 and state.stats().idles_running == 1
    assert_no_leak(manager)


def lead_and_subagent(parent: str | None) -> tuple[Any, Any, int, int]:
    """A lead's call ends in a tool call (it hands a task to a subagent), then another
    session's; the subagent's first call then needs more blocks than are free. Returns the
    manager, the subagent's request and the prompt tokens the lead and the other would hit."""
    manager = make_manager(13)  # 12 usable
    state_of(manager).protect_cap = 3  # VLLM_AFFINITY_PROTECT_SHARE=0.25 (off by default)
    state_of(manager).idle_guard = None  # every idle signal acted on
    lead = make_request(tokens(0, 4), session="lead")
    other = make_request(tokens(500, 4), session="other")
    for request in (lead, other):  # LRU order: the lead's blocks, then the other's
        run_prefill(manager, request)
        manager.free(request)
    extra = {"kv_parent": parent} if parent else None
    child = make_request(
        tokens(900, 7),
        session="sub",
        sampling_params=SamplingParams(max_tokens=8, extra_args=extra),
    )
    state_of(manager).on_new_request(child, release_on_divergence=False)
    run_prefill(manager, child)  # 4 free blocks, then 3 cached ones (vLLM frees tail first)
    lead_hits = manager.get_computed_blocks(make_request(tokens(0, 4), session="lead"))[1]
    other_hits = manager.get_computed_blocks(make_request(tokens(500, 4), session="other"))[1]
    return manager, child, lead_hits, other_hits


def test_a_parent_waiting_on_its_subagent_keeps_its_prefix_within_the_cap() -> None:
    manager, child, lead_hits, other_hits = lead_and_subagent(parent="lead")
    state = state_of(manager)
    assert lead_hits == 3 * BLOCK  # its first 3 blocks protected (the cap), the 4th reused
    assert other_hits == 2 * BLOCK  # the other's last two went instead
    assert state.queue.segment_sizes()["protected"] == 3
    assert state.stats().children == 1 and state.stats().blocks_protected == 3
    manager.free(child)
    ended = state.idle_session("sub")  # the subagent's task ended: its blocks are dead
    assert ended.status == "ok" and ended.blocks_idled == 0
    assert state.stats().block_released_child_end == 7
    sizes = state.queue.segment_sizes()
    assert sizes["protected"] == 0 and sizes["released"] == 7  # the lead is let go of
    assert state.stats().children == 0
    assert state.check(idle=True) == []
    assert_no_leak(manager)


def test_a_subagents_end_keeps_its_instructions_for_the_next_subagent() -> None:
    """The API server told the engine that the subagent's first 2 blocks (plus a few tokens)
    are its instructions: its end keeps those and the block that straddles their end (which
    holds the start of its first message, possibly shared with its siblings), releases the
    other 4; the next subagent of the agent hits the instructions. Without the length,
    everything went to RELEASED."""
    manager = make_manager(13)
    state = state_of(manager)
    extra = {"kv_parent": "lead", "kv_head": 2 * BLOCK + 3}
    params = SamplingParams(max_tokens=8, extra_args=extra)
    child = make_request(tokens(900, 7), session="sub", sampling_params=params)
    state.on_new_request(child, release_on_divergence=False)
    run_prefill(manager, child)
    manager.free(child)
    ended = state.idle_session("sub")
    assert ended.status == "ok"
    stats = state.stats()
    assert stats.block_released_child_end == 4 and stats.blocks_kept_instructions == 3
    assert state.queue.segment_sizes()["released"] == 4
    # the next subagent (same instructions, its own task) after pressure that takes all but 2 blocks
    run_prefill(manager, make_request(tokens(2000, 10), session="other"))
    following = make_request(tokens(900, 2) + tokens(3000, 2), session="sub-2")
    assert manager.get_computed_blocks(following)[1] == 2 * BLOCK
    assert state.check(idle=False) == []


def test_without_a_parent_lru_takes_the_older_lead() -> None:
    """Control for the test above."""
    manager, child, lead_hits, other_hits = lead_and_subagent(parent=None)
    assert lead_hits == BLOCK and other_hits == 3 * BLOCK  # a prompt hits all but its last token
    manager.free(child)
    assert state_of(manager).idle_session("sub").blocks_idled == 7  # no parent: idled
    assert_no_leak(manager)


def test_the_parent_calling_again_ends_its_protection() -> None:
    manager, child, _, _ = lead_and_subagent(parent="lead")
    state = state_of(manager)
    manager.free(child)  # the subagent never says it ended (its client left)
    state.on_new_request(make_request(tokens(0, 5), session="lead"), release_on_divergence=False)
    assert state.queue.segment_sizes()["protected"] == 0
    assert state.stats().children == 0
    assert state.idle_session("sub").blocks_idled == 7  # no longer a known child
    assert_no_leak(manager)


def test_reused_block_loses_its_owner() -> None:
    manager = make_manager(6)  # 5 usable
    a = make_request(tokens(0, 4), session="A")
    run_prefill(manager, a)
    manager.free(a)
    run_prefill(manager, make_request(tokens(900, 5), session="C"))  # evicts all of A's blocks
    assert state_of(manager).release("A", 0).block_released == 0
    assert_no_leak(manager)


def test_single_block_handouts_are_unbound_before_the_states_are_read() -> None:
    """A decode step's single-block handouts wait to be unbound together: whatever reads the
    tables next (a release here) finds the reused blocks no longer held."""
    manager = make_manager(6)  # 5 usable
    a = make_request(tokens(0, 4), session="A")
    run_prefill(manager, a)
    manager.free(a)
    state = state_of(manager)
    state.predict_returns(False)  # LRU's order: no picker reads the states at a pop
    pool = manager.block_pool
    reused = [pool.get_new_blocks(1)[0].block_id for _ in range(3)]  # FREE's one, then A's
    assert len(state.bindings._handed_one) == 3  # not unbound yet
    assert [state.tables[0].holders(b) for b in reused[1:]] == [0, 0]
    assert not state.bindings._handed_one
    assert state.release("A", 0).block_released == 2
    assert_no_leak(manager)
    for _ in range(1100):  # pops no read follows (requests with no session): a bounded wait
        pool.free_blocks(pool.get_new_blocks(1))
        assert len(state.bindings._handed_one) <= 1024
    assert_no_leak(manager)


def test_allocations_of_many_blocks_wait_for_their_bind_or_the_next_read() -> None:
    """An allocation of many blocks waits to be unbound by the bind of the step's output that
    holds it (``_step_ids``); one that no bind takes (a request with no session, here a bare
    pop) is unbound when the states are next read, and at most 1,024 wait."""
    manager = make_manager(64)  # 63 usable
    a = make_request(tokens(0, 30), session="A")
    run_prefill(manager, a)
    manager.free(a)
    state = state_of(manager)
    state.predict_returns(False)  # LRU's order: no picker reads the states at a pop
    pool = manager.block_pool
    own = set(np.frombuffer(state.sessions.latest["A"].block_ids, np.int32).tolist())
    taken = [block.block_id for block in pool.get_new_blocks(40)]  # FREE's 33, then A's 7
    reused = [b for b in taken if b in own]
    assert len(reused) == 7 and len(state.bindings._handed) == 1  # not unbound yet
    assert [state.tables[0].holders(b) for b in reused] == [0] * 7
    assert not state.bindings._handed
    assert state.release("A", 0).block_released == 23
    assert_no_leak(manager)
    big = make_manager(30_000)
    state, pool = state_of(big), big.block_pool
    for _ in range(3):  # the same blocks again: the earlier allocation is unbound at once
        pool.free_blocks(pool.get_new_blocks(FEW_BLOCKS + 1))
        assert len(state.bindings._handed) == 1
    held, waited = [], []
    for _ in range(1100):
        held.append(pool.get_new_blocks(FEW_BLOCKS + 1))
        waited.append(len(state.bindings._handed))
    assert max(waited) == 1024 and waited[-1] < 1024  # reached the bound, then settled
    for blocks in held:
        pool.free_blocks(blocks)
    assert_no_leak(big)


def test_unknown_session_and_record_mismatch() -> None:
    manager = make_manager(10)
    a = make_request(tokens(0, 2), session="A")
    run_prefill(manager, a)
    manager.free(a)
    state = state_of(manager)
    assert state.release("nobody", 0).status == "unknown_session"
    # a POSTed cut that shares not even the first block is another prompt, not a cut of A's
    other = make_request(tokens(500, 2)).block_hashes
    result = state.release_divergent("A", other, "post", require_common_prefix=True)
    assert result.status == "record_mismatch" and result.block_released == 0
    assert state.queue.segment_sizes()["released"] == 0


def test_cache_salt_is_the_session_when_no_session_id() -> None:
    manager = make_manager(10)
    a = make_request(tokens(0, 2), cache_salt="salty")
    run_prefill(manager, a)
    manager.free(a)
    assert state_of(manager).release("salty", 0).block_released == 2


# -- the segmented queue against vLLM's own queue: no release → identical behaviour ------------

ops = st.lists(
    st.tuples(st.sampled_from(["pop", "append", "prepend", "remove"]), st.integers(0, 3)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_same_order_as_vllm_queue_without_releases(sequence: list[tuple[str, int]]) -> None:
    n = 10
    vanilla_blocks = [KVCacheBlock(i) for i in range(n)]
    ours_blocks = [KVCacheBlock(i) for i in range(n)]
    vanilla = FreeKVCacheBlockQueue(vanilla_blocks)
    ours = SegmentedFreeBlockQueue(ours_blocks)
    out: list[int] = []  # popped, in pop order
    for op, k in sequence:
        if op == "pop" and vanilla.num_free_blocks:
            count = min(k + 1, vanilla.num_free_blocks)
            got = [b.block_id for b in vanilla.popleft_n(count)]
            assert got == [b.block_id for b in ours.popleft_n(count)]
            out.extend(got)
        elif op in ("append", "prepend") and out:
            chosen = out[: k + 1]
            del out[: k + 1]
            # BlockPool's rule: blocks with a hash are appended, blocks without one prepended
            for i in chosen:
                ours_blocks[i].reset_hash()
                if op == "append":
                    ours_blocks[i].set_block_hash(BlockHashWithGroupId(i.to_bytes(4, "big")))
            if op == "append":
                vanilla.append_n([vanilla_blocks[i] for i in chosen])
                ours.append_n([ours_blocks[i] for i in chosen])
            else:
                vanilla.prepend_n([vanilla_blocks[i] for i in chosen])
                ours.prepend_n([ours_blocks[i] for i in chosen])
        elif op == "remove" and any(b.block_hash for b in ours.get_all_free_blocks()):
            # a prefix hit: only a cached block (BlockPool never removes one without a hash)
            cached = [b.block_id for b in ours.get_all_free_blocks() if b.block_hash]
            victim = cached[k % len(cached)]
            vanilla.remove(vanilla_blocks[victim])
            ours.remove(ours_blocks[victim])
            out.append(victim)
        assert [b.block_id for b in vanilla.get_all_free_blocks()] == [
            b.block_id for b in ours.get_all_free_blocks()
        ]
        assert vanilla.num_free_blocks == ours.num_free_blocks
        cursor = vanilla.get_all_free_blocks()[:1]
        if cursor:
            assert [b.block_id for b in vanilla.iter_blocks_after(cursor[0])] == [
                b.block_id for b in ours.iter_blocks_after(ours_blocks[cursor[0].block_id])
            ]
    assert ours.segment_sizes()["released"] == 0
    assert all(ours.segment_of(b) in (Segment.FREE, Segment.NORMAL, None) for b in ours_blocks)


def test_unsupported_version_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.31.2")
    with pytest.raises(compat.UnsupportedVLLMError, match=r"0\.32\.x.*found 0\.31\.2"):
        compat.check_supported_vllm()


def test_installed_version_is_supported() -> None:
    """Every version in ``SUPPORTED`` is tested: ``make test`` runs this folder on the
    installed vLLM, then on the next version's Python sources with ``JIUWEN_EXPECT_VLLM`` set,
    so this fails if that run did not import the version it was meant to test."""
    import vllm

    found = compat.check_supported_vllm()
    assert found.startswith(compat.SUPPORTED)
    assert found.startswith(os.environ.get("JIUWEN_EXPECT_VLLM", ""))
    assert vllm.__version__.startswith(found.split("+")[0])


@pytest.mark.parametrize(
    ("table", "key", "missing"),
    [
        ("REQUIRED", "vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat", "_gone"),
        ("REQUIRED", "vllm.v1.core.block_pool.BlockPool", "get_new_blocks_v2"),
        ("REQUIRED_FUNCTIONS", "vllm.v1.core.kv_cache_utils", "get_block_hash_v2"),
    ],
)
def test_a_missing_vllm_name_fails_at_start_up_by_name(
    monkeypatch: pytest.MonkeyPatch, table: str, key: str, missing: str
) -> None:
    """A vLLM that renamed anything the plugin touches (private names included) is refused at
    start-up with the name, not mid-request."""
    required = dict(getattr(compat, table))
    required[key] = (*required[key], missing)
    monkeypatch.setattr(compat, table, required)
    with pytest.raises(compat.UnsupportedVLLMError, match=rf"lacks {key}\.{missing}"):
        compat.check_supported_vllm()


def test_siblings_ends_keep_the_start_their_first_prompts_share() -> None:
    """Claude Code's subagents one after the other: the same instructions (2 blocks and 3
    tokens), then the same context (to the end of block 4), then a task of their own (3
    blocks). Pressure reuses every released block between them. The first one's end keeps its
    instructions and the block straddling their end; from the second one on the engine knows
    the siblings share 4 blocks, so an end keeps those and the next sibling hits them all."""
    manager = make_manager(20)  # 19 usable blocks
    state = state_of(manager)
    start = [*tokens(900, 2), 1, 2, 3, *range(5000, 5000 + 2 * BLOCK - 3)]
    extra = {"kv_parent": "lead", "kv_head": 2 * BLOCK + 3}

    def sibling(n: int) -> tuple[int, int, int]:
        """(hit tokens, released blocks, kept blocks) of sibling ``n``'s one call and end."""
        params = SamplingParams(max_tokens=8, extra_args=extra)
        child = make_request(
            [*start, *tokens(10_000 * n, 3)], session=f"sub-{n}", sampling_params=params
        )
        state.on_new_request(child, release_on_divergence=False)
        hit = manager.get_computed_blocks(child)[1]
        run_prefill(manager, child)
        manager.free(child)
        before = state.stats()
        state.idle_session(f"sub-{n}")
        after = state.stats()
        released = after.block_released_child_end - before.block_released_child_end
        kept = after.blocks_kept_instructions - before.blocks_kept_instructions
        # other work takes every free and released block (not the kept ones)
        squeeze = manager.block_pool.free_block_queue.num_free_blocks - kept
        other = make_request(tokens(50_000 * n, squeeze), session=f"other-{n}")
        run_prefill(manager, other)
        manager.free(other)
        return hit, released, kept

    assert sibling(1) == (0, 4, 3)  # instructions and the straddling block kept
    assert sibling(2) == (3 * BLOCK, 3, 4)  # it recomputed block 4; its end keeps it
    assert sibling(3) == (4 * BLOCK, 3, 4)  # the whole shared start is hit
    assert state.check(idle=True) == []


def cycle_hits(predict: bool) -> tuple[int, Any]:
    """Four sessions calling in turn, each prompt a block longer every round, on a pool that
    holds about two of them: the prompt tokens hit over six rounds."""
    manager = make_manager(24)  # 23 usable blocks
    state = state_of(manager)
    state.predict_returns(predict)
    hit = 0
    for round_ in range(6):
        for s in range(4):
            request = make_request([*tokens(1000 * s, 3 + round_), 1], session=f"s{s}")
            state.on_new_request(request, release_on_divergence=False)
            hit += manager.get_computed_blocks(request)[1]
            run_prefill(manager, request)
            manager.free(request)
    assert_no_leak(manager)
    assert state.check(idle=False) == []
    return hit, state


def test_a_pop_of_one_block_takes_lrus_order() -> None:
    """A decoding request's next block is a pop of one: LRU's victim, the picker not asked (a
    pick there cost ~150 us for one block at full size); a pop of two swaps as before."""
    manager = make_manager(40)
    state = state_of(manager)
    state.predict_returns(True)
    for round_ in range(2):
        for session, start in (("a", 0), ("b", 5000), ("c", 9000)):
            request = make_request([*tokens(start, 3 + round_), 1], session=session)
            state.on_new_request(request, release_on_divergence=False)
            run_prefill(manager, request)
            manager.free(request)
    assert state.pick(1) == (1, [])
    lru, chosen = state.pick(2)  # c called last: due back last, its deepest blocks go first
    latest = state.sessions.latest["c"].block_ids.tolist()
    assert lru == 0 and len(chosen) == 2, (lru, chosen)
    assert all(block.block_id in latest for block in chosen)
    assert_no_leak(manager)


def one_by_one_pick(state: Any, take: int) -> list[int]:
    """The picker's rule asked block by block (``PoolAffinity.pick``'s definition): each of
    LRU's victims a session alone holds lets go first the candidates due back no sooner than
    it, in the candidates' order, up to the victim itself."""
    inf = float("inf")
    chunk = min(max(64, take), 1024)
    candidates: list[tuple[float, int]] = []
    for session in state.returns.back_last_first():
        due = state.returns.due(session)
        for table in state.tables:
            for batch in table.own_tail_chunks(session, chunk):
                run, _, in_use = state.queue.normal_until_in_use(batch, state.pool.blocks)
                candidates += [(due, block_id) for block_id in run]
                if in_use:
                    break

    def due_of(block_id: int) -> float:
        owners = [table.sole_holder(block_id) for table in state.tables]
        owner = next((o for o in owners if o), None)
        return inf if owner is None else state.returns.due(owner)

    picked: list[int] = []
    at = 0
    for victim in list(state.queue.normal_lru())[:take]:
        if len(picked) == take:
            break
        if victim.block_id in picked:
            continue
        due = due_of(victim.block_id)
        while due != inf and at < len(candidates) and len(picked) < take:
            run_due, block_id = candidates[at]
            if run_due < due:
                break
            at += 1
            if block_id not in picked:
                picked.append(block_id)
            if block_id == victim.block_id:
                break
        if len(picked) < take and victim.block_id not in picked:
            picked.append(victim.block_id)
    return picked


def test_the_picker_takes_what_asking_block_by_block_takes() -> None:
    """The picker takes LRU's victims and its candidate runs a slice at a time (and a victim
    that is the head run's next candidate without asking who holds it): on a real pool, every
    pop of sessions of many sizes calling in turn picks exactly the blocks the rule asked
    block by block picks."""
    manager = make_manager(40)
    state = state_of(manager)
    state.predict_returns(True)
    pops: list[int] = []

    def checked(take: int) -> tuple[int, list[Any]]:
        expected = one_by_one_pick(state, take)
        lru, chosen = state.pick(take)
        lrus_own = [block.block_id for block in state.queue.normal_lru()][:lru]
        assert [*lrus_own, *(block.block_id for block in chosen)] == expected, (lru, chosen)
        assert len(lrus_own) == lru
        pops.append(take)
        return lru, chosen

    state.queue.set_picker(checked)
    for round_ in range(8):
        for s in range(8):
            size = 3 + (s * 3 + round_) % 7  # and two blocks new to every call
            prompt = [*tokens(1000 * s, size), *tokens(100_000 + 100 * (8 * round_ + s), 2), 1]
            request = make_request(prompt, session=f"s{s}")
            state.on_new_request(request, release_on_divergence=False)
            manager.get_computed_blocks(request)
            run_prefill(manager, request)
            manager.free(request)
    assert len(pops) > 20 and max(pops) > 1 and state.stats().blocks_predicted > 0
    assert_no_leak(manager)


def test_predicted_return_keeps_the_sessions_lru_would_evict_next() -> None:
    """LRU evicts, at each call, the session that calls next; the picker evicts the one that
    just called (due back last) and the others' prefixes survive."""
    lru_hits, _ = cycle_hits(predict=False)
    hits, state = cycle_hits(predict=True)
    assert hits > lru_hits
    assert state.stats().blocks_predicted > 0
    assert cycle_hits(predict=False)[1].stats().blocks_predicted == 0


def test_the_picker_evicts_first_the_session_whose_hint_says_it_is_back_last() -> None:
    """The API server carries ``X-KV-Next-Use`` to the engine (``NEXT_USE_KEY``): once a hinted
    absence has shown how many requests pass per hinted second, a session that called last but
    said it is away long loses its blocks before an older one that said it is back soon."""
    from vllm_affinity.engine import NEXT_USE_KEY

    manager = make_manager(12)  # 11 usable
    state = state_of(manager)
    state.predict_returns(True)

    def call(session: str, start: int, n_blocks: int, hint: float | None = None) -> None:
        params = SamplingParams(max_tokens=16, extra_args={NEXT_USE_KEY: hint} if hint else None)
        request = make_request([*tokens(start, n_blocks), 1], session, sampling_params=params)
        state.on_new_request(request, release_on_divergence=False)
        run_prefill(manager, request)
        manager.free(request)

    call("teach", 0, 1, hint=2.0)
    call("teach", 0, 1)  # back 1 request after a 2-second hint: half a request per second
    call("soon", 100, 3, hint=1.0)  # LRU's oldest, back soon
    call("late", 500, 3, hint=600.0)  # the latest, back in ten minutes
    call("other", 900, 6)  # needs 7 blocks: 3 free, then 4 cached
    assert state.stats().blocks_predicted > 0
    soon = manager.get_computed_blocks(make_request([*tokens(100, 3), 1], "soon"))[1]
    late = manager.get_computed_blocks(make_request([*tokens(500, 3), 1], "late"))[1]
    assert (soon, late) == (3 * BLOCK, 0), (soon, late)
    assert_no_leak(manager)


def test_a_lead_waiting_on_its_subagent_goes_first_once_its_waits_outlast_lrus_reach() -> None:
    """With the picker on, a lead whose subagent starts gives its own blocks up first (IDLE)
    once an earlier wait of its outlasted LRU's reach (its wait guard's evidence), and takes
    them back when its subagent ends its task; its first wait, with no evidence, is not acted
    on. A hinted lead is left to the picker."""
    from vllm_affinity.engine import NEXT_USE_KEY, PARENT_KEY

    manager = make_manager(16)  # 15 usable
    state = state_of(manager)
    state.predict_returns(True)
    queue = manager.block_pool.free_block_queue

    def call(session: str, start: int, n_blocks: int, **extra: Any) -> None:
        params = SamplingParams(max_tokens=4, extra_args=extra or None)
        request = make_request([*tokens(start, n_blocks), 1], session, sampling_params=params)
        state.on_new_request(request, release_on_divergence=False)
        run_prefill(manager, request)
        manager.free(request)

    def wait(child: str, squeeze: int) -> tuple[int, int]:
        """The lead's subagent runs (``squeeze`` blocks of other work meanwhile) and ends:
        (the lead's blocks idled while it waited, IDLE blocks left after the end)."""
        call("lead", 0, 3)
        call(child, 5000, 1, **{PARENT_KEY: "lead"})
        idled = state.stats().blocks_idled_waiting
        call(f"work-{child}", 9000 + 100 * squeeze, squeeze)
        state.idle_session(child)  # its task ended
        return idled, queue.segment_sizes()["idle"]

    assert wait("first", 14) == (0, 0)  # no evidence yet: LRU's order
    assert state.stats().waits_idled == 0
    idled, left = wait("second", 2)  # its first wait outlasted LRU's reach
    assert (idled, left) == (3, 0), (idled, left)  # the lead's 3 own blocks, then back
    assert state.stats().waits_idled == 1
    call("lead", 0, 3, **{NEXT_USE_KEY: 30.0})  # the lead says when it is back
    call("third", 7000, 1, **{PARENT_KEY: "lead"})
    assert state.stats().waits_idled == 1 and queue.segment_sizes()["idle"] == 0
    assert state.check(idle=True) == []
    assert_no_leak(manager)


def test_the_picker_leaves_a_block_of_no_session_to_lru() -> None:
    """LRU's victim that no session alone holds (here: a request of no session) is taken as
    LRU takes it: the picker only reorders sessions' own blocks."""
    manager = make_manager(10)  # 9 usable
    state = state_of(manager)
    state.predict_returns(True)
    anonymous = make_request(tokens(0, 3))
    run_prefill(manager, anonymous)
    manager.free(anonymous)  # LRU's oldest: no session's
    for session, start in (("A", 100), ("A", 100), ("B", 500)):
        request = make_request([*tokens(start, 2), 1], session=session)
        state.on_new_request(request, release_on_divergence=False)
        run_prefill(manager, request)
        manager.free(request)
    run_prefill(manager, make_request(tokens(900, 3), session="C"))  # 2 free, then 1 cached
    assert state.stats().blocks_predicted == 0
    assert manager.get_computed_blocks(make_request([*tokens(0, 3), 1]))[1] < 3 * BLOCK
    assert_no_leak(manager)


def side_call(manager: Any, prompt: list[int], head: int = 0) -> list[int]:
    """One finished side request of session ``cc`` (``head``: its instruction length, as the
    API server told): its prompt's block ids."""
    from vllm_affinity.core.compaction import side_branch
    from vllm_affinity.engine import HEAD_KEY

    side = make_request(
        [*prompt, 1],
        session=side_branch("cc"),
        sampling_params=SamplingParams(max_tokens=4, extra_args={HEAD_KEY: head} if head else None),
    )
    state_of(manager).on_new_request(side, release_on_divergence=False)
    blocks = run_prefill(manager, side)[: len(prompt) // BLOCK]
    manager.free(side)
    return blocks


def rewrite_with_side_branch(
    side: list[int], side_head: int, kept: int, head: int = 2 * BLOCK
) -> tuple[Any, Any, list[int]]:
    """A main thread of 8 blocks (its first two its instructions, ``head`` tokens), a side
    request ``side`` (``side_head`` tokens of it instructions, as the API server told), then
    the main thread's compacted window told as a rewrite: its first ``kept`` blocks, then a
    summary of two blocks."""
    from vllm_affinity.engine import HEAD_KEY, REWRITE_KEY

    manager = make_manager(40)
    state = state_of(manager)
    main = make_request([*tokens(0, 8), 1], session="cc")
    run_prefill(manager, main)
    manager.free(main)
    side_ids = side_call(manager, side, side_head)
    params = SamplingParams(max_tokens=4, extra_args={REWRITE_KEY: "rewrite", HEAD_KEY: head})
    compacted = make_request(
        [*tokens(0, kept), *tokens(900, 2), 1], session="cc", sampling_params=params
    )
    state.on_new_request(compacted, release_on_divergence=False)
    return manager, state, side_ids


def segments_of(manager: Any, block_ids: list[int]) -> list[Segment]:
    state = state_of(manager)
    return [state.queue.segment_of(manager.block_pool.blocks[b]) for b in block_ids]


def test_a_rewrite_releases_a_side_prompts_copy_of_the_conversation_keeping_its_own() -> None:
    """opencode's summarizer, a memory extractor: a prompt of their own (2 blocks and 5
    tokens), then the conversation. The new window keeps only the main thread's instructions:
    at the rewrite, decided then, the side branch keeps its instructions (the block straddling
    their end included) and the rest goes with the main thread's dead blocks."""
    from vllm_affinity.core.compaction import side_branch

    side = [*tokens(5000, 2), *tokens(6000, 4)]
    manager, state, side_ids = rewrite_with_side_branch(side, 2 * BLOCK + 5, kept=2)
    assert segments_of(manager, side_ids) == [Segment.NORMAL] * 3 + [Segment.RELEASED] * 3
    stats = state.stats()
    assert stats.releases_compaction == 1 and stats.block_released_compaction == 6 + 3
    # the audit, by hash: every block no later prompt can hit (instructions aside) released
    assert (stats.compaction_blocks_dead, stats.compaction_dead_released) == (9, 9)
    assert side_branch("cc") not in state.sessions.latest
    # the summarizer's next request (its prompt, a new conversation) hits its instructions
    hit = manager.get_computed_blocks(make_request([*side[: 3 * BLOCK], *tokens(7000, 1), 1]))
    assert hit[1] == 3 * BLOCK and state.stats().released_hit == 0
    assert_no_leak(manager)


def test_a_rewrite_keeps_what_the_new_window_still_carries_of_a_side_requests_items() -> None:
    """The Codex CLI's compaction request: the developer prompt (the main thread's 2 blocks),
    then the environment and the user's first turn rendered without tools (one block of its
    own), then the rest of the conversation and the compaction prompt. Its compacted window
    keeps the environment and the user's turns (one block past the instructions), and its
    next compaction request sends them again: kept (one block more for the renderings'
    differences), the rest released, nothing released hit again."""
    side = [*tokens(0, 2), *tokens(6000, 1), *tokens(6100, 3)]
    manager, state, side_ids = rewrite_with_side_branch(side, 2 * BLOCK, kept=3)
    assert segments_of(manager, side_ids) == [Segment.NORMAL] * 4 + [Segment.RELEASED] * 2
    stats = state.stats()
    assert stats.block_released_compaction == 5 + 2
    # the audit reads by hash: the side's kept items are no hash of the new window (rendered
    # apart), so they count as dead and kept; what the side's next request hits of them says
    # they were not
    assert (stats.compaction_blocks_dead, stats.compaction_dead_released) == (5 + 4, 5 + 2)
    leading = side[: 3 * BLOCK]
    hit = manager.get_computed_blocks(make_request([*leading, *tokens(9000, 1), 1]))[1]
    assert hit == 3 * BLOCK and state.stats().released_hit == 0
    assert_no_leak(manager)


def test_a_side_branch_that_shares_only_the_instructions_is_not_the_conversation() -> None:
    """The Codex CLI's compaction request shares the main thread's developer prompt (190 of
    371 blocks: half of a short thread), then its own rendering (no tools): it did not carry
    the conversation, whatever the share. Released whole, its next request (which re-sends
    its leading items) would hit released blocks."""
    side = [*tokens(0, 5), *tokens(6000, 3)]
    manager, state, side_ids = rewrite_with_side_branch(side, 5 * BLOCK, kept=5, head=5 * BLOCK)
    assert segments_of(manager, side_ids) == [Segment.NORMAL] * 5 + [Segment.RELEASED] * 3
    assert state.stats().block_released_compaction == 3 + 3
    assert_no_leak(manager)


def test_a_side_branch_that_carried_the_conversation_dies_with_the_old_window() -> None:
    """A side request that starts with the main thread's window (Qwen Code's next-prompt
    suggestion: the conversation and one message) carried the old conversation: the rewrite
    releases it whole, but for the first block, which the new window still holds."""
    from vllm_affinity.core.compaction import side_branch
    from vllm_affinity.engine import REWRITE_KEY

    manager = make_manager(40)
    state = state_of(manager)
    main = make_request([*tokens(0, 8), 1], session="cc")
    run_prefill(manager, main)
    manager.free(main)
    side_ids = side_call(manager, [*tokens(0, 8), *tokens(6000, 2)], head=BLOCK)
    params = SamplingParams(max_tokens=4, extra_args={REWRITE_KEY: "rewrite"})
    compacted = make_request(
        [*tokens(0, 1), *tokens(900, 2), 1], session="cc", sampling_params=params
    )
    state.on_new_request(compacted, release_on_divergence=False)
    assert segments_of(manager, side_ids) == [Segment.NORMAL] + [Segment.RELEASED] * 9
    assert state.stats().block_released_compaction == 9  # the 7 shared with the main thread once
    assert side_branch("cc") not in state.sessions.latest
    assert_no_leak(manager)


def agent_call(manager: Any, prompt: list[int], key: str | None = None, head: int = 0) -> list[int]:
    """One finished call of session ``cc`` whose request carries the API server's ``key`` (a
    retry's or a rewrite's; ``head``: its instructions' tokens, as the API server tells a
    rewrite's), through the engine's request hook: its block ids."""
    from vllm_affinity.engine import HEAD_KEY

    extra: dict[str, Any] = {key: "x"} if key else {}
    if head:
        extra[HEAD_KEY] = head
    params = SamplingParams(max_tokens=4, extra_args=extra or None)
    request = make_request([*prompt, 1], session="cc", sampling_params=params)
    state_of(manager).on_new_request(request, release_on_divergence=False)
    blocks = run_prefill(manager, request)
    manager.free(request)
    return blocks


def test_a_retry_the_next_window_continues_from_releases_the_replaced_message() -> None:
    """Claude Code re-sends a turn whose answer was empty with its last user message changed
    (``retry``): nothing is released then; the next window goes on from the retry, and the
    replaced message's blocks are released, the shared prefix kept."""
    from vllm_affinity.engine import RETRY_KEY

    manager = make_manager(40)
    state = state_of(manager)
    prefix = tokens(0, 4)
    replaced = agent_call(manager, [*prefix, *tokens(100, 3)])[4:7]  # the last message: 3 blocks
    agent_call(manager, [*prefix, *tokens(200, 3)], RETRY_KEY)
    assert state.stats().releases_compaction == 0
    assert {state.queue.segment_of(manager.block_pool.blocks[b]) for b in replaced} == {
        Segment.NORMAL
    }
    agent_call(manager, [*prefix, *tokens(200, 3), *tokens(300, 2)])  # goes on from the retry
    stats = state.stats()
    assert stats.releases_compaction == 1 and stats.block_released_compaction == 3
    assert {state.queue.segment_of(manager.block_pool.blocks[b]) for b in replaced} == {
        Segment.RELEASED
    }
    assert state.check(idle=False) == []
    assert_no_leak(manager)


def test_a_rewrite_after_a_retry_releases_both_windows_in_one_release() -> None:
    """Claude Code sends its compaction request twice, the second changed (a retry); the window
    after the compaction (a rewrite) releases the main thread's and the replaced window's dead
    blocks, in one release."""
    from vllm_affinity.core.compaction import retried_branch
    from vllm_affinity.engine import RETRY_KEY, REWRITE_KEY

    manager = make_manager(40)
    state = state_of(manager)
    prefix = tokens(0, 2)
    first = agent_call(manager, [*prefix, *tokens(100, 4), *tokens(500, 1)])  # the summary
    second = agent_call(manager, [*prefix, *tokens(100, 4), *tokens(600, 1)], RETRY_KEY)
    agent_call(manager, [*prefix, *tokens(900, 2)], REWRITE_KEY)  # after the compaction
    stats = state.stats()
    assert stats.releases_compaction == 1
    dead = {*first[2:7], *second[2:7]}  # the history and both summary instructions
    assert stats.block_released_compaction == len(dead) == 6
    assert {state.queue.segment_of(manager.block_pool.blocks[b]) for b in dead} == {
        Segment.RELEASED
    }
    assert retried_branch("cc") not in state.sessions.latest
    assert_no_leak(manager)


def test_a_compaction_with_a_side_branch_and_a_retried_window_releases_every_dead_block() -> None:
    """Claude Code's usual compaction: a side request each turn, the compaction request sent
    twice (a retry), then the new window (a rewrite, its instructions the first 2 blocks). The
    rewrite releases the main thread's and the replaced window's dead blocks, and the side
    branch's copy of the old conversation (its own prompt kept). Every dead block ends in
    RELEASED and is counted once; none is hit again."""
    from vllm_affinity.engine import RETRY_KEY, REWRITE_KEY

    manager = make_manager(60)
    state = state_of(manager)
    prefix = tokens(0, 2)
    side = side_call(manager, [*tokens(5000, 1), *tokens(100, 3)], head=BLOCK)  # title request
    first = agent_call(manager, [*prefix, *tokens(100, 4), *tokens(500, 1)])
    second = agent_call(manager, [*prefix, *tokens(100, 4), *tokens(600, 1)], RETRY_KEY)
    agent_call(manager, [*prefix, *tokens(900, 2)], REWRITE_KEY, head=2 * BLOCK)
    stats = state.stats()
    dead = {*first[2:7], *second[2:7]}
    assert stats.block_released_compaction == len(dead) + 3 == 6 + 3
    assert set(segments_of(manager, sorted(dead))) == {Segment.RELEASED}
    assert segments_of(manager, side) == [Segment.NORMAL] + [Segment.RELEASED] * 3
    assert (stats.compaction_blocks_dead, stats.compaction_dead_released) == (9, 9)
    side_call(manager, [*tokens(5000, 1), *tokens(700, 1)], head=BLOCK)  # the next turn's
    stats = state.stats()
    assert stats.released_hit == 0
    assert state.check(idle=False) == []
    assert_no_leak(manager)


def test_a_bounded_check_walks_a_rotating_slice_and_finds_what_is_in_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``/affinity/check`` runs between two scheduler steps: on a pool larger than
    ``CHECK_BLOCKS`` each call walks the next slice (calls rotate over the pool), and the
    holder counts are left out past ``CHECK_RECORDS`` records; a fault is found by the call
    whose slice holds it. The unbounded check (the tests') walks everything."""
    from vllm_affinity.engine import pool_reports

    monkeypatch.setattr(pool_reports, "CHECK_BLOCKS", 100)
    manager = make_manager(250)
    state = state_of(manager)
    run_prefill(manager, make_request(tokens(0, 3 * BLOCK), session="A"))
    slices = []
    for _ in range(4):
        assert state.check(idle=False, bounded=True) == []
        slices.append(state.check_scope["blocks"])
    assert slices == [[0, 100], [100, 200], [200, 250], [0, 100]]
    assert state.check_scope["holders"] and state.check_scope["of"] == 250
    monkeypatch.setattr(pool_reports, "CHECK_RECORDS", 0)
    assert state.check(idle=False, bounded=True) == []  # [100, 200]
    assert not state.check_scope["holders"]  # A's record is not walked
    # a fault in the first slice: a free block that left the queue
    block = next(b for b in manager.block_pool.blocks[1:100] if b.ref_cnt == 0)
    fault = f"block {block.block_id}: ref_cnt 0, not in queue"
    state.queue.remove(block)
    assert state.check(idle=False, bounded=True) == []  # [200, 250]: not in it
    assert state.check(idle=False, bounded=True) == [fault]
    assert state.check_scope["blocks"] == [0, 100]
    assert fault in state.check(idle=False)
    state.queue.append(block)
