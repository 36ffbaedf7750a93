"""Hybrid models on the real vLLM classes (no model): several KV-cache groups in one pool, as
gpt-oss and Gemma 3 (sliding window beside full attention) and DeepSeek V3.2 (MLA beside its
sparse-attention indexer) have them. Every group's blocks are bound to the session, and every
path acts on every group from its own first stale block."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
)
from vllm_parts import (
    BLOCK,
    bind_as_scheduled,
    generate,
    group_block_ids,
    make_hybrid_manager,
    make_manager,
    make_request,
    run_prefill,
    state_of,
    tokens,
)

from vllm_affinity.core import HOLE, Segment
from vllm_affinity.engine import HINT_KEY, apply_engine_patches

apply_engine_patches()

WINDOW = 2 * BLOCK


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)


def sliding() -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=WINDOW
    )


def mla(head_size: int, role: SparseCacheRole = SparseCacheRole.SPARSE) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=head_size, dtype=torch.float32, cache_role=role
    )


def finished_turn(manager: Any, prompt: list[int], session: str, decode: int = 4) -> Any:
    request = make_request(prompt, session=session)
    run_prefill(manager, request)
    generate(manager, request, decode)
    manager.free(request)
    return request


def held(state: Any, session: str) -> list[list[int]]:
    """Per group, the block ids the session's record holds (holes left out)."""
    out = []
    for table in state.tables:
        record = table.latest[session]
        out.append([b for b in record.block_ids[: record.held] if b != HOLE])
    return out


def hinted(prompt: list[int], session: str) -> Any:
    params = SamplingParams(max_tokens=4, extra_args={HINT_KEY: "messages_released_index=1"})
    return make_request(prompt, session=session, sampling_params=params)


def test_the_groups_are_read_from_the_coordinator() -> None:
    state = state_of(make_hybrid_manager(64, [sliding(), full()]))
    assert [(g.index, g.kind, g.block_size) for g in state.groups] == [
        (0, "sliding_window", BLOCK),
        (1, "full_attention", BLOCK),
    ]
    assert [g.kind for g in state_of(make_manager(8)).groups] == ["full_attention"]


def test_the_picker_is_off_on_a_hybrid_model_unless_forced() -> None:
    """``VLLM_AFFINITY_PREDICT_RETURN=auto`` (the default): the predicted-return picker runs on a
    model with one KV-cache group and leaves a hybrid model's pool to LRU's order (a
    gpt-oss-shaped replay computed one block more than vanilla with it); ``true`` forces it."""
    from vllm_affinity.engine.pool_affinity import PoolAffinity
    from vllm_affinity.settings import Settings

    assert state_of(make_manager(8)).stats().predict_return
    hybrid = make_hybrid_manager(64, [sliding(), full()])
    assert not state_of(hybrid).stats().predict_return
    forced = PoolAffinity(hybrid.block_pool, Settings(predict_return=True))
    forced.attach_groups(state_of(hybrid).groups)
    assert forced.stats().predict_return
    assert not PoolAffinity(hybrid.block_pool, Settings(lifecycle=False)).stats().predict_return


def test_sliding_window_blocks_that_left_the_window_stay_the_sessions() -> None:
    """vLLM frees a sliding-window block once it leaves the window (still cached): the
    session's record keeps it, so a release or an idle reaches it."""
    manager = make_hybrid_manager(64, [sliding(), full()])
    finished_turn(manager, tokens(0, 8), "A")
    state = state_of(manager)
    sliding_held, full_held = held(state, "A")
    assert len(full_held) == 9  # 8 prompt blocks and the partial one of the answer
    assert len(sliding_held) == 9  # not only the window's last blocks
    assert not state.check(idle=True)


def test_a_compaction_releases_every_groups_stale_blocks_and_keeps_the_prefix() -> None:
    manager = make_hybrid_manager(64, [sliding(), full()])
    old = tokens(0, 8)
    finished_turn(manager, old, "A")
    state = state_of(manager)
    sliding_before, full_before = held(state, "A")
    new = [*old[: 3 * BLOCK + 5], *range(9000, 9000 + 2 * BLOCK)]  # diverges in block 3
    request = hinted(new, "A")
    state.on_new_request(request, release_on_divergence=False)
    # blocks 3..7 of the prompt in each group (the partial answer block is uncached: FREE)
    assert state.counters["block_released_in_request"] == 2 * 5
    released = {
        b.block_id
        for b in state.queue.get_all_free_blocks()
        if state.queue.segment_of(b) is Segment.RELEASED
    }
    assert released == set(sliding_before[3:8]) | set(full_before[3:8])
    assert [g.blocks_released for g in state.group_stats()] == [5, 5]
    # the kept prefix is still hit, in both groups (the window's blocks before the cut too)
    assert manager.get_computed_blocks(request)[1] == 3 * BLOCK
    run_prefill(manager, request)
    assert not state.check(idle=False)


def test_an_idle_session_idles_every_group() -> None:
    manager = make_hybrid_manager(64, [sliding(), full()])
    finished_turn(manager, tokens(0, 6), "A")
    state = state_of(manager)
    state.idle_guard = None  # the IDLE segment itself: every idle signal acted on
    result = state.idle_session("A")
    assert result.status == "ok"
    assert result.blocks_idled == 2 * 6  # the cached blocks of both groups
    assert [g.blocks_idled for g in state.group_stats()] == [6, 6]
    assert state.queue.segment_sizes()["idle"] == 12


def test_a_waiting_leads_idle_and_its_return_act_on_every_group() -> None:
    """With the picker forced on a hybrid model, a lead whose subagent starts idles its blocks
    in both groups (once its wait guard has seen a wait outlast LRU's reach), and its
    subagent's end puts them all back."""
    from vllm_affinity.engine import PARENT_KEY

    manager = make_hybrid_manager(64, [sliding(), full()])
    finished_turn(manager, tokens(0, 4), "lead")
    state = state_of(manager)
    state.predict_returns(True)
    assert state.wait_guard is not None
    state.wait_guard.went_idle("lead", 0, 1)
    state.wait_guard.came_back("lead", 5)  # its last wait: five times LRU's reach
    params = SamplingParams(max_tokens=4, extra_args={PARENT_KEY: "lead"})
    child = make_request(tokens(5000, 1), session="sub", sampling_params=params)
    state.on_new_request(child, release_on_divergence=False)
    assert [g.blocks_idled for g in state.group_stats()] == [4, 4]
    assert state.queue.segment_sizes()["idle"] == 8
    assert state.stats().blocks_idled_waiting == 8
    state.idle_session("sub")  # its task ended: the lead is due
    assert state.queue.segment_sizes()["idle"] == 0
    assert not state.check(idle=True)


def test_a_post_release_acts_on_every_group() -> None:
    manager = make_hybrid_manager(64, [sliding(), full()])
    old = tokens(0, 6)
    finished_turn(manager, old, "A")
    state = state_of(manager)
    probe = make_request(old[: 2 * BLOCK], session="probe")
    result = state.release_divergent("A", probe.block_hashes, "post", require_common_prefix=True)
    assert (result.status, result.block_released) == ("ok", 2 * 4)
    other = make_request(tokens(7000, 3), session="probe")
    mismatch = state.release_divergent("A", other.block_hashes, "post", True)
    assert mismatch.status == "record_mismatch"


def test_the_running_requests_sliding_blocks_are_released_when_freed() -> None:
    """A release while the request still runs: its blocks in the window are pending and move
    to RELEASED when vLLM frees them; the ones that already left the window move at once."""
    manager = make_hybrid_manager(64, [sliding(), full()])
    request = make_request(tokens(0, 6), session="A")
    run_prefill(manager, request)
    generate(manager, request, 2)
    state = state_of(manager)
    result = state.release("A", 1)
    assert result.moved > 0 and result.pending > 0
    manager.free(request)
    assert state.queue.num_pending == 0
    # all but the two partial answer blocks (one per group: no hash, so FREE)
    assert state.queue.segment_sizes()["released"] == result.moved + result.pending - 2
    assert not state.check(idle=True)


@pytest.mark.parametrize("groups", [[mla(576)], [mla(576), mla(132, SparseCacheRole.INDEXER)]])
def test_mla_and_its_sparse_attention_indexer(groups: list[Any]) -> None:
    """DeepSeek/Kimi-style MLA is one full-attention-like group; DeepSeek V3.2 adds its
    indexer's key cache as a group of its own: both are released together."""
    manager = make_hybrid_manager(64, groups) if len(groups) > 1 else make_manager_with(groups[0])
    state = state_of(manager)
    assert {g.kind for g in state.groups} == {"mla_attention"}
    old = tokens(0, 5)
    finished_turn(manager, old, "A")
    new = [*old[: 2 * BLOCK], *range(9000, 9000 + BLOCK)]
    state.on_new_request(hinted(new, "A"), release_on_divergence=False)
    assert state.counters["block_released_in_request"] == 3 * len(groups)


def make_manager_with(spec: Any) -> Any:
    return make_hybrid_manager(64, [spec])


def prefill_in_chunks(manager: Any, request: Any, chunk: int) -> None:
    """A cold prompt prefilled ``chunk`` tokens a step, as the scheduler splits it: a Mamba
    group in ``align`` mode keeps a state at each chunk's end and retires the older ones."""
    while request.num_computed_tokens < request.num_tokens:
        step = min(chunk, request.num_tokens - request.num_computed_tokens)
        blocks = manager.allocate_slots(request, step)
        assert blocks is not None
        bind_as_scheduled(manager, request, blocks, first=request.num_computed_tokens == 0)
        request.num_computed_tokens += step
        manager.cache_blocks(request, request.num_computed_tokens)


def test_mamba_states_past_the_cut_are_released_the_earlier_ones_kept() -> None:
    """Qwen3-Next-shaped: Mamba (``align``) beside full attention, 64-token blocks hashed at
    16. A state is hit only by a prompt that shares every token before it, so after a rewrite
    the states past the cut are dead and the ones before it are what the new window hits."""
    block = 64
    attention = FullAttentionSpec(
        block_size=block, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    mamba = MambaSpec(
        block_size=block, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )
    manager = make_hybrid_manager(200, [mamba, attention], hash_block_size=BLOCK)
    state = state_of(manager)
    assert [(g.kind, g.scale) for g in state.groups] == [("mamba", 4), ("full_attention", 4)]
    old = make_request(list(range(640)), session="A")
    assert manager.get_computed_blocks(old)[1] == 0
    prefill_in_chunks(manager, old, chunk=2 * block)
    manager.free(old)
    states, blocks = held(state, "A")
    assert len(states) == 5 and len(blocks) == 10  # a state per chunk (retired ones kept)
    new = make_request([*range(5 * block + 5), *range(9000, 9100)], session="A")
    result = state.release_divergent("A", new.block_hashes, "post")
    # the cut is inside block 5: the states ending at 384, 512 and 640 tokens, blocks 5..9
    assert (result.status, result.block_released) == ("ok", 3 + 5)
    assert [g.blocks_released for g in state.group_stats()] == [3, 5]
    # the state at 256 tokens was kept: the new window hits it (the one at 320 never existed)
    assert manager.get_computed_blocks(new)[1] == 4 * block
    assert not state.check(idle=True)


def test_groups_are_reported_with_prefix_caching_off(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's CPU build serves MLA models with prefix caching off on CPUs without AMX: the
    plugin reports the model's real groups and says it has nothing to release."""
    config = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], mla(576))],
    )
    with caplog.at_level("WARNING", logger="vllm_affinity"):
        manager = KVCacheManager(
            config, max_model_len=256, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
            enable_caching=False,
        )  # fmt: skip
    assert [g.kind for g in state_of(manager).groups] == ["mla_attention"]
    assert "prefix caching is off" in caplog.text


def test_a_model_with_no_cacheable_group_starts_all_the_same() -> None:
    """An attention-free model (no KV-cache group, prefix caching off): the engine starts; the
    plugin keeps its one default group and has nothing to bind."""
    config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[])
    manager = KVCacheManager(
        config, max_model_len=256, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
        enable_caching=False,
    )  # fmt: skip
    assert len(state_of(manager).groups) == 1


def test_a_rewrite_releases_the_side_branchs_conversation_in_every_group() -> None:
    """gpt-oss's shape (sliding window beside full attention): a coding agent's compaction,
    told by the rule (``kv_rewrite``, its instructions one block), releases the main thread's
    dead blocks and its side branch's past the side's own instructions (``kv_head``: 1.5
    blocks), in both groups, decided then; the blocks holding the side's instructions stay in
    both, and its next request of that kind hits them."""
    from vllm_affinity.core.compaction import side_branch
    from vllm_affinity.engine import HEAD_KEY, REWRITE_KEY

    manager = make_hybrid_manager(96, [sliding(), full()])
    finished_turn(manager, tokens(0, 8), "cc")
    state = state_of(manager)
    side_params = SamplingParams(max_tokens=4, extra_args={HEAD_KEY: BLOCK + BLOCK // 2})

    def side_request(prompt: list[int]) -> Any:
        side = make_request(prompt, session=side_branch("cc"), sampling_params=side_params)
        state.on_new_request(side, release_on_divergence=False)
        run_prefill(manager, side)
        generate(manager, side, 4)
        manager.free(side)

    side_request(tokens(5000, 6))
    side_held = held(state, side_branch("cc"))
    rewrite = SamplingParams(max_tokens=4, extra_args={REWRITE_KEY: "rewrite", HEAD_KEY: BLOCK})
    compacted = make_request(
        [*tokens(0, 1), *tokens(900, 2)], session="cc", sampling_params=rewrite
    )
    state.on_new_request(compacted, release_on_divergence=False)
    for group in side_held:  # 6 prompt blocks; the partial answer block is uncached (FREE)
        segments = [state.queue.segment_of(manager.block_pool.blocks[b]) for b in group[:6]]
        assert segments == [Segment.NORMAL] * 2 + [Segment.RELEASED] * 4
    # per group: the main thread's 7 dead prompt blocks and the side branch's 4
    assert [g.blocks_released for g in state.group_stats()] == [7 + 4, 7 + 4]
    side_request([*tokens(5000, 2), *tokens(7100, 1)])  # the same kind: its instructions hit
    assert state.stats().released_hit == 0
    assert not state.check(idle=True)


def scheduled(manager: Any, request: Any) -> int:
    """What the scheduler does with a new request's prefix lookup: the hit, and the junction
    it pins on the request (the sliding-window manager keeps the state there). Then the
    prefill, in one chunk."""
    computed, hit, request.shared_prefix_boundary = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, request.num_tokens - hit, hit, computed)
    assert blocks is not None
    bind_as_scheduled(manager, request, blocks, first=True)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_tokens)
    return int(hit)


def with_instructions(prompt: list[int], session: str, instructions: int | None) -> Any:
    from vllm_affinity.core.request_keys import CHECKPOINT_KEY

    extra = {CHECKPOINT_KEY: instructions} if instructions else None
    params = SamplingParams(max_tokens=4, extra_args=extra)
    return make_request(prompt, session=session, sampling_params=params)


@pytest.mark.parametrize("told", [False, True], ids=["vanilla", "instructions told"])
def test_a_new_sessions_first_call_hits_the_instructions_it_shares(told: bool) -> None:
    """vLLM's default retention (interval 0) keeps a sliding window's state at a prompt's end
    and at junctions only: told where A's instructions end, A's first call keeps the state
    there, and B's first call hits the instructions; not told, B recomputes them (vLLM pins
    its junction on B, for a third session)."""
    manager = make_hybrid_manager(64, [sliding(), full()], retention_interval=0)
    instructions = (5 * BLOCK + 3) if told else None  # floored to a block: 5 blocks
    a = with_instructions([*tokens(0, 5), *range(9000, 9000 + 6 * BLOCK)], "A", instructions)
    scheduled(manager, a)
    assert a.shared_prefix_boundary == (5 * BLOCK if told else 0)
    generate(manager, a, 4)
    manager.free(a)
    b = with_instructions([*tokens(0, 5), *range(7000, 7000 + 3 * BLOCK)], "B", instructions)
    state = state_of(manager)
    assert scheduled(manager, b) == (5 * BLOCK if told else 0)
    assert state.stats().checkpoints_marked == (1 if told else 0)
    assert not state.check(idle=False)


def test_a_later_turn_keeps_the_checkpoint_it_shares_recent() -> None:
    """A's second turn hits its own prompt's end, past the checkpoint: the checkpoint's
    sliding-window blocks, freed when they left the window, move to the most recently used
    end of the free queue, after the blocks of a session that ran since."""
    manager = make_hybrid_manager(64, [sliding(), full()], retention_interval=0)
    instructions = 4 * BLOCK
    first = [*tokens(0, 4), *range(9000, 9000 + 4 * BLOCK)]
    a = with_instructions(first, "A", instructions)
    scheduled(manager, a)
    manager.free(a)
    other = make_request(tokens(20000, 3), session="C")  # freed after A's: more recent
    scheduled(manager, other)
    c_blocks = {i for ids in group_block_ids(manager, other) for i in ids if i}
    manager.free(other)
    state = state_of(manager)
    checkpoint = state.checkpoints
    assert checkpoint is not None
    again = with_instructions([*first, *range(5000, 5000 + 2 * BLOCK)], "A", instructions)
    assert scheduled(manager, again) > instructions
    refreshed = state.stats().checkpoint_blocks_refreshed
    assert refreshed == WINDOW // BLOCK  # the window's blocks before the checkpoint
    kept = {b.block_id for b in checkpoint.known.blocks(again.block_hashes[3]) or []}
    assert len(kept) == refreshed
    order = [b.block_id for b in state.queue.get_all_free_blocks()]
    last_of_c = max(order.index(i) for i in c_blocks if i in order)
    assert min(order.index(i) for i in kept) > last_of_c, (kept, c_blocks, order)
    manager.free(again)
    assert not state.check(idle=True)


def test_a_one_group_model_has_no_checkpoints_and_a_setting_turns_them_off() -> None:
    from vllm_affinity.engine.pool_affinity import PoolAffinity
    from vllm_affinity.settings import Settings

    assert state_of(make_manager(16)).checkpoints is None
    hybrid = make_hybrid_manager(64, [sliding(), full()])
    assert state_of(hybrid).checkpoints is not None
    off = PoolAffinity(hybrid.block_pool, Settings.from_env({"VLLM_AFFINITY_CHECKPOINTS": "false"}))
    off.attach_groups(state_of(hybrid).groups)
    assert off.checkpoints is None
