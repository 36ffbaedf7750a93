"""Session binding (pure core) and the token/block math."""

from __future__ import annotations

import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from vllm_affinity.core import HOLE, SessionBlocks, common_prefix_length, first_stale_block
from vllm_affinity.core.block_states import BlockStates


def table_with(*sessions: tuple[str, list[int]]) -> SessionBlocks:
    table = SessionBlocks()
    for session, blocks in sessions:
        table.record(session, blocks, num_prompt_tokens=len(blocks) * 32)
    return table


def test_release_returns_blocks_from_the_index_on() -> None:
    table = table_with(("a", [10, 11, 12, 13]))
    selection = table.select_release("a", 2)
    assert selection.block_ids == [12, 13]
    assert selection.status == "ok"


def test_shared_blocks_are_never_released_by_one_session() -> None:
    table = table_with(("a", [1, 2, 3]), ("b", [1, 2, 4]))
    first = table.select_release("a", 0)
    assert first.block_ids == [3] and first.kept_shared == 2
    second = table.select_release("b", 0)  # the last holder: still content a used too
    assert second.block_ids == [4] and second.kept_shared == 2
    assert table.select_release("a", 0).block_ids == []  # a repeated release frees nothing
    assert table.select_release("b", 0).block_ids == []


def test_shared_across_time_is_kept_until_reused() -> None:
    """A subagent's system prompt: the first subagent ends (its release frees it: nobody else
    used it yet), the next one hits it, and from then on no session's end releases it."""
    table = table_with(("sub-1", [1, 2, 3]))
    assert table.select_release("sub-1", 0).block_ids == [1, 2, 3]
    table.record("sub-2", [1, 2, 5], 96, "r2")  # hits the prompt blocks 1 and 2
    table.request_finished("sub-2", "r2")
    assert table.select_idle("sub-2").block_ids == [5]  # shared ones stay out of IDLE too
    ended = table.select_release("sub-2", 0)
    assert ended.block_ids == [5] and ended.kept_shared == 2
    assert table.is_shared(1) and not table.is_shared(5)
    table.unbind([1])  # reused for new content: the mark goes with the old content
    assert not table.is_shared(1)
    table.record("sub-3", [1], 32)
    assert table.select_release("sub-3", 0).block_ids == [1]


def test_reused_block_is_not_released_by_its_old_session() -> None:
    table = table_with(("a", [1, 2]))
    table.unbind([2])  # block 2 reused for another request's new content
    table.record("c", [2], 32)
    assert table.select_release("a", 0).block_ids == [1]
    assert table.holders(2) == 1  # c's
    assert table.select_release("c", 0).block_ids == [2]


def test_unreused_names_the_released_blocks_still_holding_their_content() -> None:
    """What a prefetch can bring back: released or not, but not reused since."""
    table = table_with(("a", [1, 2, 3, 4]))
    assert table.select_release("a", 1).block_ids == [2, 3, 4]
    table.unbind([3])  # block 3 reused for new content
    assert table.unreused("a", 1) == [2, 4]
    assert table.unreused("a", 0) == [1, 2, 4]
    assert table.unreused("nobody", 0) == []


def test_unknown_session() -> None:
    table = table_with(("a", [1, 2]))
    assert table.select_release("zzz", 0).status == "unknown_session"
    assert table.select_release("a", 0).block_ids == [1, 2]


def test_session_table_is_bounded() -> None:
    table = SessionBlocks(max_sessions=2)
    for s in "abc":
        table.record(s, [1], 1)
    assert list(table.latest) == ["b", "c"]
    assert table.holders(1) == 2 and table.bindings == 2 and table.evicted == 1


def test_token_math() -> None:
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0


# -- the invariants, under any sequence of requests, reuse, releases, preemption and eviction ---

N_BLOCKS, MAX_SESSIONS = 12, 4


class SessionMachine(RuleBasedStateMachine):
    """Model: each session's latest request as (block, generation) pairs and how many of them it
    still holds; the holder counts are recomputed from it by brute force."""

    def __init__(self) -> None:
        super().__init__()
        self.table = SessionBlocks(max_sessions=MAX_SESSIONS)
        self.generation = [0] * N_BLOCKS
        self.model: dict[str, tuple[str, list[tuple[int, int]], int]] = {}  # request, pairs, held
        self.running: set[str] = set()  # sessions whose latest request still runs
        self.order: list[str] = []  # least recently recorded first
        self.requests = 0
        self.first_holder: dict[tuple[int, int], str] = {}  # (block, generation) → session
        self.shared: set[tuple[int, int]] = set()  # held by a second session at some time

    def _record(
        self, session: str, request: str, blocks: list[int], handed_from: int | None = None
    ) -> None:
        if handed_from is not None:  # the pool handed these out for new content just now
            for b in blocks[handed_from:]:
                self.generation[b] += 1
        self.table.record(session, blocks, len(blocks) * 32, request, handed_from=handed_from)
        self.running.add(session)
        for b in blocks:
            if b == HOLE:
                continue
            if self.first_holder.setdefault((b, self.generation[b]), session) != session:
                self.shared.add((b, self.generation[b]))
        pairs = [(b, 0 if b == HOLE else self.generation[b]) for b in blocks]
        self.model[session] = (request, pairs, len(blocks))
        if session in self.order:
            self.order.remove(session)
        self.order.append(session)
        while len(self.order) > MAX_SESSIONS:
            del self.model[self.order.pop(0)]

    def _holders(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for _, pairs, held in self.model.values():
            for block, generation in pairs[:held]:
                if block != HOLE and self.generation[block] == generation:
                    counts[block] = counts.get(block, 0) + 1
        return counts

    @rule(
        session=st.sampled_from("abcdef"),
        blocks=st.lists(st.integers(0, N_BLOCKS - 1), min_size=1, max_size=5, unique=True),
    )
    def new_request(self, session: str, blocks: list[int]) -> None:
        self.requests += 1
        self._record(session, f"r{self.requests}", blocks)

    @rule(data=st.data())
    def request_grows(self, data: st.DataObject) -> None:
        running = sorted(self.running & set(self.model))
        if not running:
            return
        session = data.draw(st.sampled_from(running))
        request, pairs, _ = self.model[session]
        current = [b for b, _ in pairs]
        extra = data.draw(st.lists(st.integers(0, N_BLOCKS - 1), max_size=3, unique=True))
        grown = [b for b in extra if b not in current]
        # the engine's path for a running request that grew: the new blocks alone
        if data.draw(st.booleans()) and self.table.grow(
            session, request, len(current), grown, (len(current) + len(grown)) * 32
        ):
            self.running.add(session)
            for b in grown:
                if self.first_holder.setdefault((b, self.generation[b]), session) != session:
                    self.shared.add((b, self.generation[b]))
            self.model[session] = (request, pairs + [(b, self.generation[b]) for b in grown],
                                   len(current) + len(grown))  # fmt: skip
            self.order.remove(session)
            self.order.append(session)
            return
        self._record(session, request, current + grown)

    @rule(data=st.data())
    def next_request_continues(self, data: st.DataObject) -> None:
        """A session's next request starts with some of its last one's blocks (an append, or a
        cut: a compaction), then blocks of its own."""
        if not self.model:
            return
        session = data.draw(st.sampled_from(sorted(self.model)))
        current = [b for b, _ in self.model[session][1]]
        keep = data.draw(st.integers(0, len(current)))
        extra = data.draw(st.lists(st.integers(0, N_BLOCKS - 1), max_size=3, unique=True))
        self.requests += 1
        blocks = current[:keep] + [b for b in extra if b not in current[:keep]]
        if blocks:
            self._record(session, f"r{self.requests}", blocks)

    def _free_blocks(self, data: st.DataObject, exclude: list[int]) -> list[int]:
        """Blocks the pool could hand out now: none a running request holds."""
        in_use = {b for s in self.running & set(self.model) for b, _ in self.model[s][1]}
        free = [b for b in range(N_BLOCKS) if b not in in_use and b not in exclude]
        return data.draw(st.lists(st.sampled_from(free), max_size=4, unique=True)) if free else []

    @rule(data=st.data())
    def next_request_with_a_handed_tail(self, data: st.DataObject) -> None:
        """A session's next request: some of its last one's blocks, then blocks the pool has
        just handed out for new content, unbound by the record itself (``handed_from``)."""
        if not self.model:
            return
        session = data.draw(st.sampled_from(sorted(self.model)))
        current = [b for b, _ in self.model[session][1]]
        head = current[: data.draw(st.integers(0, len(current)))]
        tail = self._free_blocks(data, head)
        if head or tail:
            self.requests += 1
            self._record(session, f"r{self.requests}", head + tail, handed_from=len(head))

    @rule(data=st.data())
    def request_grows_by_handed_blocks(self, data: st.DataObject) -> None:
        """A running request's chunk: blocks just handed out, unbound by the grow itself."""
        running = sorted(self.running & set(self.model))
        if not running:
            return
        session = data.draw(st.sampled_from(running))
        request, pairs, held = self.model[session]
        current = [b for b, _ in pairs]
        grown = self._free_blocks(data, current)
        if held != len(current) or not grown:
            return
        for b in grown:
            self.generation[b] += 1
        assert self.table.grow(session, request, held, grown, 32, handed=True)
        for b in grown:
            self.first_holder.setdefault((b, self.generation[b]), session)
        self.model[session] = (request, pairs + [(b, self.generation[b]) for b in grown],
                               held + len(grown))  # fmt: skip
        self.order.remove(session)
        self.order.append(session)

    @rule(data=st.data())
    def next_request_with_its_window_moved(self, data: st.DataObject) -> None:
        """A sliding window's next request: holes where the last one's window began (blocks
        before its window), then the rest of the last one's blocks and some of its own."""
        if not self.model:
            return
        session = data.draw(st.sampled_from(sorted(self.model)))
        current = [b for b, _ in self.model[session][1]]
        cut = data.draw(st.integers(0, len(current)))
        extra = data.draw(st.lists(st.integers(0, N_BLOCKS - 1), max_size=3, unique=True))
        blocks = [HOLE] * cut + current[cut:] + [b for b in extra if b not in current]
        if blocks:
            self.requests += 1
            self._record(session, f"r{self.requests}", blocks)

    @rule(data=st.data())
    def request_finishes(self, data: st.DataObject) -> None:
        """Finished, aborted or preempted: its blocks are freed and may be reused."""
        running = sorted(self.running & set(self.model))
        if not running:
            return
        session = data.draw(st.sampled_from(running))
        self.table.request_finished(session, self.model[session][0])
        self.running.discard(session)

    @rule(data=st.data())
    def preempted_request_resumes(self, data: st.DataObject) -> None:
        """A preempted request comes back under the same id, with the same or other blocks."""
        stopped = sorted(set(self.model) - self.running)
        if not stopped:
            return
        session = data.draw(st.sampled_from(stopped))
        request = self.model[session][0]
        blocks = data.draw(st.lists(st.integers(0, N_BLOCKS - 1), min_size=1, max_size=4))
        self._record(session, request, list(dict.fromkeys(blocks)))

    @rule(blocks=st.lists(st.integers(0, N_BLOCKS - 1), min_size=1, max_size=3, unique=True))
    def reused_for_new_content(self, blocks: list[int]) -> None:
        in_use = {b for s in self.running & set(self.model) for b, _ in self.model[s][1]}
        blocks = [b for b in blocks if b not in in_use]  # a running request's blocks stay put
        self.table.unbind(blocks)
        for b in blocks:
            self.generation[b] += 1

    @rule(session=st.sampled_from("abcdefz"), first=st.integers(0, 6))
    def release(self, session: str, first: int) -> None:
        before = self._holders()
        selection = self.table.select_release(session, first)
        if session not in self.model:
            assert selection.status == "unknown_session" and selection.block_ids == []
            return
        request, pairs, held = self.model[session]
        dropped = [b for b, g in pairs[first:held] if b != HOLE and self.generation[b] == g]
        self.model[session] = (request, pairs, min(held, first))
        after = self._holders()
        # released exactly the dropped blocks nobody else holds or ever held; the others kept
        kept = [b for b in dropped if b in after or (b, self.generation[b]) in self.shared]
        assert sorted(selection.block_ids) == sorted(set(dropped) - set(kept))
        assert selection.kept_shared == len(kept)
        assert all(before[b] >= 1 for b in dropped)

    @rule(session=st.sampled_from("abcdef"))
    def forget(self, session: str) -> None:
        self.table.forget(session)
        if session in self.model:
            del self.model[session]
            self.order.remove(session)
            self.running.discard(session)

    @invariant()
    def holder_counts_match_the_model(self) -> None:
        counts = self._holders()
        assert {b: self.table.holders(b) for b in range(N_BLOCKS) if self.table.holders(b)} == (
            counts
        )
        assert self.table.bindings == sum(counts.values())
        assert self.table.blocks.bindings() == self.table.bindings  # the stats' one pass
        assert len(self.table) == len(self.model) <= MAX_SESSIONS


TestSessionMachine = SessionMachine.TestCase
TestSessionMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


class VectorisedSessionMachine(SessionMachine):
    """The same model, every hold and unbind on the vectorised path (short lists otherwise go
    block by block)."""

    def __init__(self) -> None:
        super().__init__()
        self.table.few = 0


TestVectorisedSessionMachine = VectorisedSessionMachine.TestCase
TestVectorisedSessionMachine.settings = TestSessionMachine.settings


class RenumberedSessionMachine(SessionMachine):
    """The same model with the generation counter spent every third handout: the records are
    renumbered (``BlockStates.renumber``) over and over, and hold exactly what they held."""

    def __init__(self) -> None:
        super().__init__()
        self.table.blocks.epoch_limit = 3


TestRenumberedSessionMachine = RenumberedSessionMachine.TestCase
TestRenumberedSessionMachine.settings = TestSessionMachine.settings


def test_renumbering_keeps_what_every_record_holds() -> None:
    """Two tables over one block state: after a renumbering, an entry still holding its
    content (a hole aside) names generation 1, which every block has, the others 0; what each
    record holds, releases and carries over is unchanged, and the next handout's generation
    is 2."""
    blocks = BlockStates(16)
    full, window = SessionBlocks(blocks=blocks), SessionBlocks(blocks=blocks)
    full.record("a", [1, 2, 3], 96, "r1")
    window.record("a", [HOLE, 4, 5], 96, "r1")
    full.request_finished("a", "r1")
    window.request_finished("a", "r1")
    full.unbind([3, 5])  # reused: no record holds them any more
    before = (full.unreused("a", 0), window.unreused("a", 0), full.bindings, window.bindings)
    blocks.renumber()
    assert list(full.latest["a"].generations) == [1, 1, 0]
    assert list(window.latest["a"].generations) == [0, 1, 0]
    assert set(blocks.generation[:-1]) == {1} and blocks.generation[-1] == 0
    assert (full.unreused("a", 0), window.unreused("a", 0), full.bindings, window.bindings) == (
        before
    )
    full.unbind([2])
    assert blocks.generation[2] == 2 and full.unreused("a", 0) == [1]
    full.record("a", [1, 2, 6], 96, "r2")  # 1 carried over, 2 held afresh (reused since)
    assert [full.holders(b) for b in (1, 2, 6)] == [1, 1, 1] and full.check([window]) == []


def retained_bytes(table: SessionBlocks) -> int:
    """What the table keeps alive: its dicts, and per session the key, record and arrays."""
    size = sum(sys.getsizeof(d) for d in (table.latest, table._holders, table._generation))
    for key, record in table.latest.items():
        size += sys.getsizeof(key) + sys.getsizeof(record)
        size += sys.getsizeof(record.block_ids) + sys.getsizeof(record.generations)
        size += sys.getsizeof(record.request_id)
    return size


def test_a_quarter_million_sessions_stay_bounded() -> None:
    """250,000 sessions sharing an 8-block system prompt pass through a 10,000-session table:
    the shared blocks keep one counter each, and memory stays what 10,000 records need (the
    size after 50,000 sessions and after 250,000 is the same)."""
    shared = list(range(8))
    table = SessionBlocks(max_sessions=10_000)
    sizes = []
    for i in range(250_000):
        table.record(f"session-{i}", [*shared, 100 + i % 5000], 9 * 32, f"r{i}")
        if i + 1 in (50_000, 250_000):
            sizes.append(retained_bytes(table))
    assert len(table) == 10_000 and table.evicted == 240_000
    assert table.holders(0) == 10_000 and table.bindings == 90_000
    assert sizes[1] <= sizes[0] * 1.05  # nothing grows with the sessions churned through
    per_session = sizes[1] / len(table)
    print(f"retained {sizes[1]:,} bytes: {per_session:.0f} per tracked session (9 blocks)")
    assert per_session < 1_000


def test_holes_hold_nothing_and_keep_positions() -> None:
    table = SessionBlocks()
    table.record("A", [HOLE, HOLE, 7, 8], 64, "r1")
    assert table.bindings == 2
    assert table.select_release("A", 3).block_ids == [8]
    assert table.select_release("A", 0).block_ids == [7]
    assert not table.check()


def test_a_block_the_running_request_dropped_stays_the_sessions() -> None:
    """A sliding window's block leaves the window (vLLM puts its null block there): the
    record keeps it; once the block is reused for new content, it does not."""
    table = SessionBlocks()
    table.record("A", [1, 2, 3], 96, "r1")
    table.record("A", [HOLE, 2, 3, 4], 96, "r1")
    assert list(table.latest["A"].block_ids) == [1, 2, 3, 4]
    table.record("A", [HOLE, HOLE, 3, 4, 5], 96, "r1")
    assert list(table.latest["A"].block_ids) == [1, 2, 3, 4, 5]
    table.unbind([1])  # reused
    table.record("A", [HOLE, HOLE, HOLE, 4, 5, 6], 96, "r1")
    assert list(table.latest["A"].block_ids) == [HOLE, 2, 3, 4, 5, 6]
    assert table.bindings == 5
    assert not table.check()


def test_a_new_request_does_not_inherit_the_old_ones_blocks() -> None:
    table = SessionBlocks()
    table.record("A", [1, 2, 3], 96, "r1")
    table.request_finished("A", "r1")
    table.record("A", [HOLE, 2, 9], 96, "r2")
    assert list(table.latest["A"].block_ids) == [HOLE, 2, 9]
    assert table.holders(1) == 0
    assert not table.check()


def test_first_stale_block_skips_holes_and_reads_each_blocks_boundary() -> None:
    chain = ["h0", "h1", "h2", "h3", "h4", "h5"]
    # one hash block per block, as for a Llama-style model
    assert first_stale_block([("h0", 1), ("h1", 2), ("x", 3)], chain) == 2
    # holes (a sliding window's null blocks) are skipped, compared blocks decide
    assert first_stale_block([None, None, ("h2", 3), ("h3", 4)], chain) == 4
    assert first_stale_block([None, ("x", 2)], chain) == 1
    # blocks of two hash blocks each (a group with a larger block size)
    assert first_stale_block([("h1", 2), ("h3", 4), ("h5", 6)], chain) == 3
    assert first_stale_block([("h1", 2), ("h3", 4), ("h5", 6)], chain[:5]) == 2
    # a Mamba state cached at a finer boundary inside its block
    assert first_stale_block([None, ("h2", 3)], chain) == 2
    # an uncached block (the partial tail) is stale, as is anything past the chain
    assert first_stale_block([("h0", 1), (None, 2)], chain) == 1
    assert first_stale_block([], chain) == 0


def test_move_hands_a_finished_record_to_another_key_holding_the_same_blocks() -> None:
    table = SessionBlocks()
    table.record("a", [1, 2, 3], 48, "r1")
    assert not table.move("a", "a-old")  # still running
    table.request_finished("a", "r1")
    table.record("a-old", [9], 16, "r0")
    assert table.move("a", "a-old")
    assert "a" not in table.latest and list(table.latest["a-old"].block_ids) == [1, 2, 3]
    assert table.holders(1) == 1 and table.holders(9) == 0  # the replaced record let go
    assert not table.move("missing", "x")
    assert table.check() == []


def test_a_next_request_carries_the_shared_prefix_over_and_holds_reused_blocks_afresh() -> None:
    """A session's next request that starts with its last one's blocks keeps their counts (the
    prefix moves over); a block among them that was reused for new content meanwhile (the
    request hit it again with that content) is held afresh, not carried as stale."""
    table = SessionBlocks()
    table.record("a", [1, 2, 3, 4], 128, "r1")
    table.record("b", [3], 32, "q1")
    table.request_finished("a", "r1")
    table.record("a", [1, 2, 3, 5], 128, "r2")
    assert [table.holders(b) for b in (1, 2, 3, 4, 5)] == [1, 1, 2, 0, 1]
    table.request_finished("a", "r2")
    table.unbind([2])  # reused: new content, which the next request hits at the same index
    table.record("a", [1, 2, 3], 96, "r3")
    assert [table.holders(b) for b in (1, 2, 3, 5)] == [1, 1, 2, 0]
    assert table.check() == [] and table.bindings == 4


def test_a_running_request_grows_by_its_new_blocks() -> None:
    table = SessionBlocks()
    table.record("a", [1, 2], 64, "r1")
    assert table.grow("a", "r1", 2, [3, HOLE], 96)
    assert [table.holders(b) for b in (1, 2, 3)] == [1, 1, 1] and table.bindings == 3
    assert not table.grow("a", "r1", 3, [4], 128)  # recorded with 4 entries, not 3
    assert not table.grow("a", "r2", 4, [4], 128)  # another request's record
    table.request_finished("a", "r1")
    assert not table.grow("a", "r1", 4, [4], 128)  # finished: its blocks may be reused
    assert table.holders(4) == 0 and table.check() == []


def test_walkable_says_whether_the_pickers_walk_has_entries_to_read() -> None:
    """``walkable`` is true exactly when ``own_tail_chunks`` reads something: a finished
    request's record with entries below where its last walk ended; not an unknown session, a
    running request's record, or one whose walk found none of its own blocks down to its
    first entry."""
    table = SessionBlocks()
    assert not table.walkable("a")
    table.record("a", [1, 2, 3], 96, "r1")
    assert not table.walkable("a") and list(table.own_tail_chunks("a", 2)) == []
    table.request_finished("a", "r1")
    assert table.walkable("a") and [b for part in table.own_tail_chunks("a", 2) for b in part]
    table.record("b", [1, 2, 3], 96, "q1")  # every block shared now: the walk finds none
    assert list(table.own_tail_chunks("a", 2)) == [[], []]
    assert not table.walkable("a") and list(table.own_tail_chunks("a", 2)) == []


def test_owner_names_stay_bounded_and_keep_their_meaning() -> None:
    """Owners are kept by index; past ``2 * max_sessions + 1024`` names the table keeps only
    its sessions' owners. A block first held by a session that left still counts as another
    session's (shared when a new one holds it), and a live session still holds its own."""
    table = SessionBlocks(max_sessions=2)
    table.record("gone", [5], 0, "r0")
    for i in range(1100):
        table.record(f"s{i}", [1000 + i], 0, f"r{i}")
        table.record("live", [7], 0, "live")  # kept in the table, its record carried over
    assert len(table.blocks.owners) < 1100  # the names were forgotten once at least
    assert table.sole_holder(7) == "live"
    assert table.holders(5) == 0 and not table.is_shared(5)
    table.record("late", [5], 0, "late")  # "gone" held block 5's content first
    assert table.is_shared(5) and table.sole_holder(5) is None
    assert table.check() == []


def test_sole_holders_answers_by_session_the_positions_it_alone_holds() -> None:
    """``sole_holders`` gives, by session, the positions in the ids asked of the blocks
    ``sole_holder`` names (and only those), ascending, ids beyond the arrays too."""
    table = SessionBlocks()
    table.record("a", list(range(0, 40)), 0, "ra")
    table.record("b", list(range(30, 60)), 0, "rb")  # 30..39 shared with "a"
    table.record("c", [HOLE, 70, 71], 0, "rc")
    table.unbind([45])  # reused: nobody holds it any more
    asked = [75, 71, 5, 35, 45, 50, 70, 10**6, 39, 0] * 5
    expected: dict[str, list[int]] = {}
    for at, block_id in enumerate(asked):
        if owner := table.sole_holder(block_id):
            expected.setdefault(owner, []).append(at)
    answer = table.sole_holders(asked)
    assert {owner: positions.tolist() for owner, positions in answer.items()} == expected
    assert set(expected) == {"a", "b", "c"} and 3 not in expected["a"] + expected["b"]
    assert {o: p.tolist() for o, p in table.sole_holders([1, 2, 35, 3]).items()} == {"a": [0, 1, 3]}
    assert table.sole_holders([35, 45, 10**6]) == {}  # shared, reused, beyond


def test_the_tables_of_a_models_groups_share_one_block_state() -> None:
    """A block serves one KV-cache group at a time: the groups' tables share one
    ``BlockStates``, so a reused block is let go of once for all of them, each table still
    counts and selects its own records' blocks, and the holder counts check against the
    records of every table sharing them."""
    states = BlockStates()
    full, window = SessionBlocks(blocks=states), SessionBlocks(blocks=states)
    full.record("a", [1, 2, 3], 0, "r")
    window.record("a", [HOLE, 7, 8], 0, "r")
    full.record("b", [1, 4], 0, "q")
    assert full.check([window]) == []
    assert full.check() != []  # alone, the window's holds look like nobody's
    states.unbind([2, 7])  # once, whatever group they served
    assert full.unreused("a", 0) == [1, 3] and window.unreused("a", 0) == [8]
    assert (full.bindings, window.bindings) == (4, 1)
    assert states.bindings() == 5  # the pool's, over both groups' tables
    assert full.sole_holder(3) == window.sole_holder(8) == "a" and full.sole_holder(1) is None
    assert window.select_release("a", 0).block_ids == [8]
    assert full.check([window]) == []
    with pytest.raises(ValueError, match="shares no block state"):
        full.check([SessionBlocks()])


def test_a_hole_reads_the_spare_slot_as_no_block() -> None:
    """The per-block arrays keep one slot past every block id: a record's ``HOLE`` (-1) reads
    it, generation 0 and no holder, however the arrays grow and the blocks are reused."""
    table = SessionBlocks(dense=False, capacity=4)
    for round_ in range(3):
        top = 4 * (round_ + 1) + round_  # past the arrays at first, then growing them
        table.record("s", [HOLE, 1, HOLE, top], 10, f"r{round_}")
        table.unbind([1, top])  # reused: the handout's generation for both, none for the hole
        assert len(table.blocks.holders) > top + 1
        assert table.blocks.generation[-1] == 0 and table.blocks.holders[-1] == 0
        now = round_ + 1  # the round's handout
        assert table._generations_of(table._as_ids([HOLE, top, 1])).tolist() == [0, now, now]
    table.record("s", [HOLE, 2, HOLE], 10, "r")
    assert table.check() == [] and table.holders(2) == 1
