"""The step binding on vLLM's real ``Scheduler`` (no model): each step's output binds the blocks it
hands the workers to the request's session, chunked prefills, decoded blocks and preemptions
alike."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus
from vllm_parts import BLOCK, make_request, state_of, tokens

from vllm_affinity.core import HOLE
from vllm_affinity.core.block_states import FEW_BLOCKS
from vllm_affinity.engine import apply_engine_patches
from vllm_affinity.testing.scheduling import scheduler, step

apply_engine_patches()


def full_attention(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )


def sliding_beside_full(num_blocks: int, window: int) -> KVCacheConfig:
    """gpt-oss's shape: a sliding window of ``window`` tokens (group 0) beside full attention."""
    kinds = dict(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    specs = [SlidingWindowSpec(sliding_window=window, **kinds), FullAttentionSpec(**kinds)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
    )


def decoding(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, ignore_eos=True)


def recorded(state: Any, session: str) -> list[int]:
    return np.frombuffer(state.sessions.latest[session].block_ids, np.int32).tolist()


def watch_unbinds(states: Any) -> list[int]:
    """How many blocks each of ``states``' unbinds takes from now on (appended as they come)."""
    sizes: list[int] = []
    unbind = states.unbind

    def counted(block_ids: Any) -> None:
        sizes.append(len(block_ids))
        unbind(block_ids)

    states.unbind = counted
    return sizes


def test_each_step_binds_what_it_hands_the_workers() -> None:
    """A prompt prefilled in chunks, then decoded past a block's end: after every prefill step
    the session's record is the request's block list, as the scheduler sees it; while it
    decodes, the record waits (its prefix), and its free binds the rest."""
    engine = scheduler(full_attention(64), max_num_seqs=4, max_num_batched_tokens=2 * BLOCK)
    state = state_of(engine.kv_cache_manager)
    request = make_request(tokens(0, 5), session="A", sampling_params=decoding(BLOCK + 4))
    engine.add_request(request)
    lengths = []
    while request.request_id in engine.requests:
        finished = step(engine)
        if request.request_id in finished:
            break
        ids = list(engine.kv_cache_manager.get_block_ids(request.request_id)[0])
        if len(lengths) < 3:
            assert recorded(state, "A") == ids
        else:  # decoding: the blocks it got after its prompt are bound when it frees them
            assert recorded(state, "A") == ids[:5]
        assert state.sessions.latest["A"].request_id == request.request_id
        lengths.append(len(ids))
    assert lengths[:3] == [2, 4, 5]  # three chunks
    assert max(lengths) == 7  # 80 prompt tokens and 20 decoded: two blocks more
    record = state.sessions.latest["A"]
    assert record.request_id is None and record.held == 7 == len(record.block_ids)
    assert not state.check(idle=True)


def test_a_prompt_after_a_hit_is_bound_from_its_handout_and_its_hit() -> None:
    """A session's next prompt hits the last one's blocks and gets many new ones in one step:
    its record is its whole block list, the hit held as it is and the new blocks unbound and
    held at the bind, in every group (a sliding window's skipped blocks are holes); so too a
    prompt with no hit, chunk after chunk."""
    for config in (full_attention(256), sliding_beside_full(512, 4 * BLOCK)):
        engine = scheduler(config, max_num_seqs=4, max_num_batched_tokens=64 * BLOCK)
        state = state_of(engine.kv_cache_manager)
        first = make_request(tokens(0, 8), session="A", sampling_params=decoding(1))
        engine.add_request(first)
        step(engine)
        full = next(g.index for g in state.groups if g.kind == "full_attention")
        hit = list(engine.kv_cache_manager.get_block_ids(first.request_id)[full])
        while first.request_id in engine.requests:
            step(engine)
        second = make_request(tokens(0, 48), session="A", sampling_params=decoding(4))
        engine.add_request(second)
        step(engine)
        lists = engine.kv_cache_manager.get_block_ids(second.request_id)
        assert lists[full][: len(hit)] == hit  # the hit: the first prompt's blocks
        for table, group in zip(state.tables, state.groups, strict=True):
            ids = [HOLE if i == 0 else i for i in lists[group.index]]
            assert np.frombuffer(table.latest["A"].block_ids, np.int32).tolist() == ids
        # no hit, in two chunks: the first bound whole, the second after it, from the handouts
        other = make_request(tokens(1000, 100), session="B", sampling_params=decoding(4))
        engine.add_request(other)
        for _ in range(2):
            step(engine)
            lists = engine.kv_cache_manager.get_block_ids(other.request_id)
            for table, group in zip(state.tables, state.groups, strict=True):
                ids = [HOLE if i == 0 else i for i in lists[group.index]]
                record = np.frombuffer(table.latest["B"].block_ids, np.int32).tolist()
                assert len(record) == len(ids)  # a window's dropped blocks stay in the record
                assert all(i in (HOLE, r) for i, r in zip(ids, record, strict=True))
        assert len(record) == 100
        assert not state.check(idle=False)


def test_every_new_prompt_of_a_step_takes_its_own_handed_tail() -> None:
    """Several new prompts scheduled in one step, each given many blocks: each one's are
    unbound and held at its own bind (``record``'s ``handed_from``), not unbound beforehand
    when another's bind reads the states; every record is its request's block list."""
    for config in (full_attention(512), sliding_beside_full(1024, 4 * BLOCK)):
        engine = scheduler(config, max_num_seqs=4, max_num_batched_tokens=256 * BLOCK)
        state = state_of(engine.kv_cache_manager)
        unbound = watch_unbinds(state.block_states)
        requests = [
            make_request(tokens(1000 * i, 40), session=f"S{i}", sampling_params=decoding(4))
            for i in range(3)
        ]
        for request in requests:
            engine.add_request(request)
        step(engine)
        assert not [n for n in unbound if n > FEW_BLOCKS], unbound
        for i, request in enumerate(requests):
            lists = engine.kv_cache_manager.get_block_ids(request.request_id)
            for table, group in zip(state.tables, state.groups, strict=True):
                ids = [HOLE if b == 0 else b for b in lists[group.index]]
                assert len(ids) == 40
                assert np.frombuffer(table.latest[f"S{i}"].block_ids, np.int32).tolist() == ids
        assert not state.check(idle=False)


def test_a_preempted_request_is_bound_afresh_when_it_resumes() -> None:
    """A pool too small for both requests: one is preempted and resumes with a new block list
    (the step output's ``resumed_req_ids``); every record still matches."""
    engine = scheduler(full_attention(12), max_num_seqs=4, max_num_batched_tokens=4 * BLOCK)
    state = state_of(engine.kv_cache_manager)
    first = make_request(tokens(0, 4), session="A", sampling_params=decoding(3 * BLOCK))
    engine.add_request(first)
    step(engine)
    second = make_request(tokens(5000, 4), session="B", sampling_params=decoding(3 * BLOCK))
    engine.add_request(second)
    preempted = False
    for _ in range(8 * BLOCK):
        finished = step(engine)
        preempted |= RequestStatus.PREEMPTED in (first.status, second.status)
        for request, session in ((first, "A"), (second, "B")):
            running = request.request_id in engine.requests and request in engine.running
            if running and request.request_id not in finished:
                ids = [HOLE if i == 0 else i for i in engine.kv_cache_manager.get_block_ids(
                    request.request_id)[0]]  # fmt: skip
                record = recorded(state, session)
                assert record == ids[: len(record)]  # all of it, but what it decoded since
                assert len(record) >= -(-request.num_prompt_tokens // BLOCK)
        if not engine.requests:
            break
    assert preempted, "the pool was meant to preempt a request"
    assert not engine.requests
    assert not state.check(idle=True)


def test_a_release_while_it_decodes_covers_what_it_decoded() -> None:
    """The decoded blocks wait for the request's free to be bound, but a release of its
    session while it decodes binds them first: they are released with the rest (pending). The
    rule for what happens next is the one for any release made while a request runs: it sticks
    only if no block comes after it; here one does, so the request is recorded whole again at
    its free and every pending release is cancelled (as before the decoded blocks waited)."""
    engine = scheduler(full_attention(64), max_num_seqs=4, max_num_batched_tokens=8 * BLOCK)
    state = state_of(engine.kv_cache_manager)
    request = make_request(tokens(0, 4), session="A", sampling_params=decoding(2 * BLOCK + 4))
    engine.add_request(request)
    for _ in range(BLOCK + 8):  # the prompt, then past its first decoded block's end
        step(engine)
    held = len(engine.kv_cache_manager.get_block_ids(request.request_id)[0])
    assert held == 6 and len(recorded(state, "A")) == 4  # two decoded blocks not bound yet
    result = state.release("A", 1)
    assert result.status == "ok" and result.pending == held - 1  # all but the first block
    assert len(recorded(state, "A")) == held
    while engine.requests:
        step(engine)
    assert len(recorded(state, "A")) == held + 1  # a block after the release: recorded whole
    assert state.queue.num_pending == 0
    assert state.queue.segment_sizes()["released"] == 0
    assert not state.check(idle=True)


def _group_records(state: Any, session: str) -> list[list[int]]:
    return [
        np.frombuffer(table.latest[session].block_ids, np.int32).tolist() for table in state.tables
    ]


def test_a_hybrid_request_decoding_inside_its_window_is_bound_at_its_free() -> None:
    """A sliding window wider than what the request decodes drops none of its decoded blocks
    before its free: they wait for it, in every group, as on a full-attention model."""
    engine = scheduler(sliding_beside_full(64, 8 * BLOCK), max_num_batched_tokens=8 * BLOCK)
    state = state_of(engine.kv_cache_manager)
    request = make_request(tokens(0, 5), session="A", sampling_params=decoding(2 * BLOCK + 4))
    engine.add_request(request)
    grew = False
    while engine.requests:
        finished = step(engine)
        if request.request_id in finished:
            break
        tables = engine.kv_cache_manager.get_block_ids(request.request_id)
        grew |= len(tables[1]) > 5
        assert [len(ids) for ids in _group_records(state, "A")] == [5, 5]  # the prompt's
    assert grew, "the request was meant to decode into new blocks"
    lengths = [len(ids) for ids in _group_records(state, "A")]
    assert lengths == [8, 8]  # 80 prompt tokens and 36 decoded, bound at the free
    assert HOLE not in _group_records(state, "A")[0]
    assert not state.check(idle=True)


def test_a_hybrid_request_decoding_past_its_window_keeps_every_block_it_dropped() -> None:
    """Decoding past the sliding window, vLLM drops the request's decoded blocks as the window
    passes them: its growth is bound before the first one goes, so its record still names
    every block the request held at each position (none is a hole), in both groups."""
    engine = scheduler(sliding_beside_full(64, 4 * BLOCK), max_num_batched_tokens=8 * BLOCK)
    state = state_of(engine.kv_cache_manager)
    request = make_request(tokens(0, 5), session="A", sampling_params=decoding(8 * BLOCK))
    engine.add_request(request)
    held: list[dict[int, int]] = [{}, {}]  # per group: position -> the block it held there
    while engine.requests:
        tables = [list(ids) for ids in engine.kv_cache_manager.get_block_ids(request.request_id)]
        for group, ids in enumerate(tables):
            held[group].update((at, block) for at, block in enumerate(ids) if block)
        if request.request_id in step(engine):
            break
    dropped = [at for at in held[0] if at >= 5]
    assert len(dropped) >= 4, "the window was meant to pass decoded blocks"
    records = _group_records(state, "A")
    for group in range(2):
        assert records[group] == [held[group][at] for at in range(len(records[group]))]
    assert len(records[1]) == 5 + 8  # 80 prompt tokens and 128 decoded
    assert not state.check(idle=True)


def test_the_divergence_rules_search_finds_what_a_walk_of_the_record_finds() -> None:
    """A full-attention group's first stale block is found by a binary search over the
    record's runs of blocks that still hold what it recorded (``Releases._dense_first_stale``):
    on a pool too small for four sessions, whose records lose blocks while they wait, it
    answers what the walk of every entry (``first_stale_block``) answers, for the session's
    next prompt, a compaction's cut and another prompt."""
    from vllm_affinity.core import first_stale_block

    core = scheduler(full_attention(40), max_model_len=1024, max_num_seqs=2)
    state = state_of(core.kv_cache_manager)
    releases, groups = state.releases, state._ctx.groups
    prompts = {s: tokens(1000 * (s + 1), 3) for s in range(4)}
    checked = evicted = 0
    for turn in range(5):
        for s, prompt in prompts.items():
            core.add_request(make_request(prompt, session=f"s{s}"))
            while core.has_requests():
                step(core)
            prompts[s] = [*prompt, *[7] * 16, *tokens(50_000 + 100 * turn + 10 * s, 1)]
        for s, prompt in prompts.items():
            session = f"s{s}"
            table = releases.tables[0]
            evicted += not table.unchanged(session)
            for chain in (prompt, prompt[: 2 * BLOCK], tokens(90_000 + turn, 4)):
                hashes = make_request(chain).block_hashes
                fast = releases._dense_first_stale(groups[0], table, session, hashes)
                walk = first_stale_block(releases._entries(groups[0], table, session), hashes)
                assert fast == walk, (turn, s, len(chain))
                checked += 1
    assert evicted > 0 and checked == 60  # records that lost blocks were among those searched
