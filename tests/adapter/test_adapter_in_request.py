"""In-request release on the real vLLM classes (no model): a new request of a session, hinted by
``X-KV-Release``, releases the session's previous blocks from the first block whose hash differs
from its own block-hash chain, before it allocates."""

from __future__ import annotations

from typing import Any

from vllm.sampling_params import SamplingParams
from vllm_parts import (
    BLOCK,
    generate,
    make_manager,
    make_request,
    run_prefill,
    state_of,
    tokens,
)

from vllm_affinity.core import first_divergent_block
from vllm_affinity.engine import HINT_KEY, apply_engine_patches

apply_engine_patches()

HINT = {HINT_KEY: "messages_released_index=3"}


def hinted(prompt: list[int], session: str, hint: bool = True) -> Any:
    params = SamplingParams(max_tokens=16, extra_args=dict(HINT) if hint else None)
    return make_request(prompt, session=session, sampling_params=params)


def finished_turn(manager: Any, prompt: list[int], session: str) -> list[int]:
    request = make_request(prompt, session=session)
    blocks = run_prefill(manager, request)
    generate(manager, request, 4)
    manager.free(request)
    return blocks


def test_first_divergent_block() -> None:
    assert first_divergent_block([1, 2, 3], [1, 2, 3, 4]) == 3
    assert first_divergent_block([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergent_block([1, None, 3], [1, 2, 3]) == 1
    assert first_divergent_block([1, 2, 3], [1]) == 1
    assert first_divergent_block([], [1]) == 0
    assert first_divergent_block([1], []) == 0


def test_hinted_request_releases_exactly_the_diverging_blocks() -> None:
    manager = make_manager(40)
    old = tokens(0, 8)
    old_blocks = finished_turn(manager, old, "A")
    state = state_of(manager)
    # the rewrite changes the prompt inside its 6th block (index 5)
    new = [*old[: 5 * BLOCK + 3], *range(9000, 9000 + 4 * BLOCK)]
    state.on_new_request(hinted(new, "A"), release_on_divergence=False)
    assert state.counters["releases_in_request"] == 1
    # blocks 5..7 of the prompt; the generated tokens sit in the partial tail (uncached)
    assert state.counters["block_released_in_request"] == 3
    released = {b.block_id for b in state.queue.get_all_free_blocks()} & set(old_blocks[5:])
    assert released == set(old_blocks[5:8])
    assert state.queue.segment_sizes()["released"] == 3


def test_released_blocks_serve_the_hinted_request_itself() -> None:
    """The pool holds A's old window and B's prefix, nothing else: the hinted request's new blocks
    come out of A's released ones, and B's prefix survives."""
    manager = make_manager(1 + 8 + 4)  # 12 usable blocks
    old = tokens(0, 8)
    old_blocks = finished_turn(manager, old, "A")
    b_blocks = finished_turn(manager, tokens(5000, 3), "B")
    state = state_of(manager)
    assert state.queue.segment_sizes()["free"] == 1 + 8 + 3 - 12 + 1  # partial tails: uncached
    new = [*old[: 2 * BLOCK], *range(9000, 9000 + 6 * BLOCK)]
    request = hinted(new, "A")
    state.on_new_request(request, release_on_divergence=False)
    new_blocks = run_prefill(manager, request)
    assert new_blocks[:2] == old_blocks[:2]  # the common prefix is hit
    assert set(new_blocks[2:]) & set(b_blocks) == set()
    assert state.queue.released_reused > 0
    b_again = make_request(tokens(5000, 3), session="B")
    assert manager.get_computed_blocks(b_again)[1] == 3 * BLOCK - BLOCK  # B still hits


def test_unhinted_request_releases_nothing_unless_the_server_says_so() -> None:
    manager = make_manager(40)
    old = tokens(0, 6)
    finished_turn(manager, old, "A")
    state = state_of(manager)
    new = [*old[:BLOCK], *range(9000, 9000 + 5 * BLOCK)]
    state.on_new_request(hinted(new, "A", hint=False), release_on_divergence=False)
    assert state.counters["releases"] == 0
    state.on_new_request(hinted(new, "A", hint=False), release_on_divergence=True)
    assert state.counters["releases_divergence"] == 1
    assert state.counters["block_released_divergence"] == 5


def test_pure_append_releases_nothing_even_with_a_hint() -> None:
    manager = make_manager(40)
    old = tokens(0, 4)
    finished_turn(manager, old, "A")
    state = state_of(manager)
    state.on_new_request(hinted([*old, *range(7000, 7000 + BLOCK)], "A"), False)
    assert state.counters["releases_in_request"] == 1
    assert state.counters["block_released_in_request"] == 0


def test_hint_without_session_or_for_an_unknown_session() -> None:
    manager = make_manager(40)
    state = state_of(manager)
    state.on_new_request(hinted(tokens(0, 2), "nobody"), False)
    assert state.counters["releases_unknown_session"] == 1
    params = SamplingParams(max_tokens=4, extra_args=dict(HINT))
    state.on_new_request(make_request(tokens(0, 2), sampling_params=params), False)
    assert state.counters["releases"] == 1


def test_shared_blocks_are_kept_for_the_other_session() -> None:
    manager = make_manager(40)
    shared = tokens(0, 4)
    finished_turn(manager, shared, "B")
    # A hits B's first 3 blocks (vLLM recomputes the last full block of a prompt: a new block)
    finished_turn(manager, shared, "A")
    state = state_of(manager)
    state.on_new_request(hinted([*shared[:BLOCK], *range(9000, 9000 + 3 * BLOCK)], "A"), False)
    assert state.counters["block_released_in_request"] == 1  # only A's own recomputed block
    assert state.queue.segment_sizes()["released"] == 1


def test_in_use_blocks_become_pending() -> None:
    manager = make_manager(40)
    old = tokens(0, 4)
    running = make_request(old, session="A")
    run_prefill(manager, running)
    state = state_of(manager)
    state.on_new_request(hinted([*old[:BLOCK], *range(9000, 9000 + 3 * BLOCK)], "A"), False)
    assert state.queue.num_pending == 3
    manager.free(running)
    assert state.queue.num_pending == 0
    assert state.queue.segment_sizes()["released"] == 3


def test_a_release_that_keeps_tokens_keeps_the_block_straddling_their_end() -> None:
    """``keep_tokens`` (a POST whose cut is the instructions alone): the block that holds the
    end of the kept tokens and the start of what followed stays cached."""
    manager = make_manager(40)
    old = tokens(0, 6)
    finished_turn(manager, old, "A")
    state = state_of(manager)
    cut = make_request(old[: 2 * BLOCK + 5], session="cut")  # 2 full blocks and 5 tokens
    kept = state.release_divergent("A", cut.block_hashes, "post", keep_tokens=2 * BLOCK + 5)
    assert (kept.first_stale_block, kept.block_released) == (3, 3)
    assert manager.get_computed_blocks(make_request(old, session="B"))[1] >= 3 * BLOCK


def test_a_chain_that_hits_the_whole_record_is_read_from_its_last_block() -> None:
    """The common case (an agent's next call extends its last one) is decided from the record's
    last hashed block; every other chain is walked. Both answer as the walk does: a full hit,
    the partial tail (no hash) as the first stale block, a change anywhere, a shorter chain, and
    a record whose middle block was reused since."""
    from vllm_affinity.core import first_stale_block

    manager = make_manager(40)
    old = tokens(0, 6)
    finished_turn(manager, [*old, *range(7000, 7005)], "A")  # a partial tail after 6 blocks
    state = state_of(manager)
    releases, group, table = state.releases, state.groups[0], state.tables[0]

    def both(prompt: list[int]) -> tuple[int | None, int]:
        chain = list(make_request(prompt).block_hashes)
        walked = first_stale_block(releases._entries(group, table, "A"), chain)
        return releases._all_hit(group, table, "A", chain), walked

    fast, walked = both([*old, *range(7000, 7005), *tokens(5000, 3)])
    assert fast == walked == 6  # the whole record hit; its partial tail is never hit
    for changed in ([*old[:-1], 1], [*old[: 2 * BLOCK], *range(8000, 8000 + 4 * BLOCK)]):
        fast, walked = both(changed)
        assert fast is None and walked < 6  # walked
    fast, walked = both(old[: 3 * BLOCK])
    assert fast is None and walked == 3
    table.unbind([table.latest["A"].block_ids[2]])  # its third block handed out again
    fast, walked = both([*old, *tokens(5000, 3)])
    assert fast is None  # the record no longer holds what it recorded: the walk decides
