"""The segmented queue (pure core) against a plain reference model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm_affinity.core import IdleResult, ReleaseResult, Segment, SegmentedFreeBlockQueue


@dataclass(eq=False)
class FakeBlock:
    block_id: int
    prev_free_block: Any = None
    next_free_block: Any = None
    block_hash: Any = None


def cached(blocks: list[Any]) -> list[Any]:
    """Give blocks a hash, as vLLM has before it frees them with ``append_n`` (its rule: blocks
    with a hash are appended, blocks without one prepended)."""
    for block in blocks:
        block.block_hash = ("hash", block.block_id)
    return blocks


def uncached(blocks: list[Any]) -> list[Any]:
    for block in blocks:
        block.block_hash = None
    return blocks


def ids(blocks: list[Any]) -> list[int]:
    return [b.block_id for b in blocks]


def test_aged_blocks_come_out_first_each_segment_in_lru_order() -> None:
    """Prior art's scenario: six blocks, some popped and re-appended, some aged."""
    blocks = [FakeBlock(i) for i in range(6)]
    q = SegmentedFreeBlockQueue(blocks)
    popped = q.popleft_n(6)
    q.append_n(cached(popped))  # all six cached, LRU order 0..5
    assert q.release(blocks[4]) is ReleaseResult.MOVED
    assert q.release(blocks[1]) is ReleaseResult.MOVED
    assert q.release(blocks[1]) is ReleaseResult.NOOP
    assert ids(q.get_all_free_blocks()) == [4, 1, 0, 2, 3, 5]
    assert q.segment_sizes() == {"free": 0, "released": 2, "idle": 0, "normal": 4, "protected": 0}
    assert ids(q.popleft_n(3)) == [4, 1, 0]


def test_idle_blocks_go_after_released_and_before_live_ones() -> None:
    """A session waiting on its user: its blocks are reused after released ones and before any
    live session's, in the order they went idle; a hit makes one live again."""
    blocks = [FakeBlock(i) for i in range(6)]
    q = SegmentedFreeBlockQueue(blocks)
    q.append_n(cached(q.popleft_n(6)))  # NORMAL 0..5
    assert q.idle(blocks[3]) is IdleResult.MOVED
    assert q.idle(blocks[1]) is IdleResult.MOVED
    assert q.idle(blocks[1]) is IdleResult.NOOP
    assert q.release(blocks[5]) is ReleaseResult.MOVED
    assert q.release(blocks[3]) is ReleaseResult.MOVED  # from IDLE: released outranks idle
    assert ids(q.get_all_free_blocks()) == [5, 3, 1, 0, 2, 4]
    assert q.segment_sizes() == {"free": 0, "released": 2, "idle": 1, "normal": 3, "protected": 0}
    in_use = q.popleft_n(3)
    assert ids(in_use) == [5, 3, 1]
    assert q.idle(in_use[0]) is IdleResult.NOOP  # in use: nothing pending, unlike release
    assert q.released_reused == 2
    q.idle(blocks[2])
    q.remove(blocks[2])  # its session came back: a prefix hit
    q.append(blocks[2])
    assert q.segment_of(blocks[2]) is Segment.NORMAL
    assert q.segment_sizes() == {"free": 0, "released": 0, "idle": 0, "normal": 3, "protected": 0}


def test_protected_blocks_come_out_after_every_other_cached_block() -> None:
    """A parent waiting on its subagents: its blocks go last, and still serve an allocation
    when nothing else is left (they are free, not pinned)."""
    blocks = cached([FakeBlock(i) for i in range(5)])
    q = SegmentedFreeBlockQueue(capacity=5)
    q.append_n(blocks)
    assert q.protect(blocks[0]) and q.protect(blocks[1])
    assert not q.protect(blocks[1])  # already protected
    q.idle(blocks[2])
    assert q.protect(blocks[2])  # an idle parent's block is protected too
    assert q.segment_sizes()["protected"] == 3
    assert ids(q.popleft_n(2)) == [3, 4]  # NORMAL first
    assert ids(q.popleft_n(1)) == [0]  # then PROTECTED, in the order protected
    assert q.protected_reused == 1
    assert q.restore(blocks[1])  # the subagents are done: back to the MRU end of NORMAL
    assert q.segment_sizes() == {"free": 0, "released": 0, "idle": 0, "normal": 1, "protected": 1}
    assert q.release(blocks[2]) is ReleaseResult.MOVED  # a release outranks protection
    assert ids(q.get_all_free_blocks()) == [2, 1]


def test_uncached_blocks_are_reused_before_released_ones() -> None:
    blocks = [FakeBlock(i) for i in range(4)]
    q = SegmentedFreeBlockQueue(blocks)
    q.append_n(cached(q.popleft_n(2)))
    q.release(blocks[0])
    assert ids(q.get_all_free_blocks()) == [2, 3, 0, 1]
    fresh = q.popleft()
    q.prepend_n(uncached([fresh]))
    assert q.popleft() is fresh


def test_in_use_block_is_pending_until_freed() -> None:
    blocks = [FakeBlock(i) for i in range(3)]
    q = SegmentedFreeBlockQueue(blocks)
    in_use = q.popleft_n(3)
    assert q.release(in_use[1]) is ReleaseResult.PENDING
    assert q.num_pending == 1
    q.append_n(cached(in_use))
    assert q.segment_of(in_use[1]) is Segment.RELEASED
    assert q.num_pending == 0
    assert ids(q.get_all_free_blocks()) == [1, 0, 2]


def test_headed_for_names_where_a_block_is_or_goes_when_freed() -> None:
    """A release's audit reads it: a queued block's segment; one in use, the segment a
    release pending on it sends it to, or an offloader's parking back to; else None."""
    blocks = [FakeBlock(i) for i in range(4)]
    q = SegmentedFreeBlockQueue(blocks)
    q.append_n(cached(q.popleft_n(4)))
    q.release(blocks[0])
    assert q.headed_for(blocks[0]) is Segment.RELEASED
    assert q.headed_for(blocks[3]) is Segment.NORMAL
    in_use = q.popleft_n(3)  # 0 (released), then 1 and 2
    q.release(in_use[1])
    assert [q.headed_for(b) for b in in_use] == [None, Segment.RELEASED, None]
    q.idle(blocks[3])
    with q.offloading():  # a copy takes the idle block: parked, back to IDLE when done
        q.remove(blocks[3])
    assert q.headed_for(blocks[3]) is Segment.IDLE


def test_cancelled_pending_goes_back_to_normal() -> None:
    block = FakeBlock(0)
    q = SegmentedFreeBlockQueue([block])
    q.popleft()
    q.release(block)
    assert q.cancel_pending(0)
    q.append(cached([block])[0])
    assert q.segment_of(block) is Segment.NORMAL


def test_prefix_hit_on_released_block_makes_it_live_again() -> None:
    blocks = [FakeBlock(i) for i in range(2)]
    q = SegmentedFreeBlockQueue(blocks)
    q.append_n(cached(q.popleft_n(2)))
    q.release(blocks[0])
    q.remove(blocks[0])  # touched by a prefix hit
    q.append(blocks[0])  # freed again later
    assert q.segment_of(blocks[0]) is Segment.NORMAL


def test_iter_blocks_after_crosses_segments_and_leaves_released_out() -> None:
    """vLLM's one reader of this walk is an offloader copying what the GPU evicts next: a
    released block is dead, not worth a copy (``get_all_free_blocks`` lists every segment)."""
    blocks = [FakeBlock(i) for i in range(6)]
    q = SegmentedFreeBlockQueue(blocks)
    q.append_n(cached(q.popleft_n(4)))  # 4,5 FREE; 0,1,2,3 NORMAL
    q.release(blocks[2])  # 2 RELEASED
    q.idle(blocks[3])  # 3 IDLE
    assert ids(q.get_all_free_blocks()) == [4, 5, 2, 3, 0, 1]
    assert ids(q.iter_blocks_after(None)) == [4, 5, 3, 0, 1]
    assert ids(q.iter_blocks_after(blocks[5])) == [3, 0, 1]
    assert ids(q.iter_blocks_after(blocks[3])) == [0, 1]
    assert ids(q.iter_blocks_after(blocks[1])) == []
    q.release(blocks[0])  # the cursor released since the last walk: on from IDLE
    assert ids(q.iter_blocks_after(blocks[0])) == [3, 1]
    popped = q.popleft()
    assert ids(q.iter_blocks_after(popped)) == []


def test_an_offloaders_copy_parks_marked_blocks_where_it_found_them() -> None:
    """An offloader takes blocks out of the queue to copy them (vLLM's ``touch``) and frees them
    when the copy is done (``append_n``): under ``offloading`` a released, idle or protected
    block is no hit and goes back to the head of its segment, in its order; a NORMAL one goes
    to NORMAL's tail as in vLLM."""
    blocks = [FakeBlock(i) for i in range(8)]
    q = SegmentedFreeBlockQueue(blocks)
    q.append_n(cached(q.popleft_n(8)))  # NORMAL 0..7
    q.release(blocks[0])
    for b in (1, 2, 3):
        q.idle(blocks[b])
    q.protect(blocks[7])
    with q.offloading():  # the copy's hold, block by block as BlockPool.touch does
        for b in (0, 1, 2, 4, 7):
            q.remove(blocks[b])
    assert q.released_hit == 0
    assert q.num_pending == 4  # the marked ones wait to go back
    q.remove(blocks[3])  # a prompt's hit, outside the copy: live again
    q.append_n([blocks[b] for b in (0, 1, 2, 4, 7)])  # the copy done
    q.append(blocks[3])  # its request done
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 5, 6, 4, 3, 7]
    assert q.segment_sizes() == {"free": 0, "released": 1, "idle": 2, "normal": 4, "protected": 1}
    assert q.num_pending == 0


def test_a_parked_block_released_or_taken_meanwhile_goes_where_its_last_news_says() -> None:
    blocks = [FakeBlock(i) for i in range(4)]
    q = SegmentedFreeBlockQueue(blocks)
    q.append_n(cached(q.popleft_n(4)))
    q.idle(blocks[0])
    q.idle(blocks[1])
    with q.offloading():
        q.remove(blocks[0])
        q.remove(blocks[1])
    assert q.release(blocks[0]) is ReleaseResult.PENDING  # released while the copy runs
    q.cancel_pending_many([1])  # a request bound it: live
    q.append_n([blocks[0], blocks[1]])
    assert q.segment_of(blocks[0]) is Segment.RELEASED
    assert q.segment_of(blocks[1]) is Segment.NORMAL
    assert ids(q.get_all_free_blocks()) == [0, 2, 3, 1]


def test_without_an_offloader_a_released_blocks_hit_still_counts() -> None:
    blocks = [FakeBlock(i) for i in range(2)]
    q = SegmentedFreeBlockQueue(blocks)
    q.append_n(cached(q.popleft_n(2)))
    q.release(blocks[0])
    with q.offloading():
        pass
    q.remove(blocks[0])
    assert q.released_hit == 1
    assert q.num_pending == 0


def test_errors() -> None:
    q = SegmentedFreeBlockQueue([])
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft_n(1)
    with pytest.raises(RuntimeError):
        q.remove(FakeBlock(7))


class QueueMachine(RuleBasedStateMachine):
    """Random operation sequences shaped like BlockPool's use, against three plain lists."""

    N = 12

    def __init__(self) -> None:
        super().__init__()
        self.blocks = [FakeBlock(i) for i in range(self.N)]
        self.q = SegmentedFreeBlockQueue(self.blocks)
        # in pop order: FREE, RELEASED, IDLE, NORMAL, PROTECTED
        self.ref: list[list[int]] = [list(range(self.N)), [], [], [], []]
        self.pending: set[int] = set()
        self.cached_popped = 0  # blocks popped from any segment but FREE

    def in_queue(self) -> list[int]:
        return [b for seg in self.ref for b in seg]

    def cached_in_queue(self) -> list[int]:
        return [b for seg in self.ref[1:] for b in seg]

    def out_of_queue(self) -> list[int]:
        inside = set(self.in_queue())
        return [i for i in range(self.N) if i not in inside]

    def ref_pop(self) -> int:
        for index, seg in enumerate(self.ref):
            if seg:
                self.cached_popped += index > 0
                return seg.pop(0)
        raise AssertionError

    @precondition(lambda self: self.in_queue())
    @rule(n=st.integers(min_value=1, max_value=4))
    def popleft_n(self, n: int) -> None:
        n = min(n, len(self.in_queue()))
        expected = [self.ref_pop() for _ in range(n)]
        assert ids(self.q.popleft_n(n)) == expected

    @precondition(lambda self: self.cached_in_queue())
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        # a prefix hit: only a cached block (BlockPool never removes one without a hash)
        block_id = data.draw(st.sampled_from(self.cached_in_queue()))
        for seg in self.ref:
            if block_id in seg:
                seg.remove(block_id)
        self.q.remove(self.blocks[block_id])

    @precondition(lambda self: self.out_of_queue())
    @rule(data=st.data())
    def free_cached(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.out_of_queue()), unique=True, min_size=1))
        for block_id in chosen:
            seg = 1 if block_id in self.pending else 3
            self.pending.discard(block_id)
            self.ref[seg].append(block_id)
        self.q.append_n(cached([self.blocks[i] for i in chosen]))

    @precondition(lambda self: self.out_of_queue())
    @rule(data=st.data())
    def free_uncached(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.out_of_queue()), unique=True, min_size=1))
        self.ref[0][:0] = chosen
        self.pending.difference_update(chosen)
        self.q.prepend_n(uncached([self.blocks[i] for i in chosen]))

    @rule(block_id=st.integers(min_value=0, max_value=N - 1))
    def release(self, block_id: int) -> None:
        result = self.q.release(self.blocks[block_id])
        source = next((seg for seg in self.ref[2:] if block_id in seg), None)
        if source is not None:
            source.remove(block_id)
            self.ref[1].append(block_id)
            assert result is ReleaseResult.MOVED
        elif block_id in self.in_queue() or block_id in self.pending:
            assert result is ReleaseResult.NOOP
        else:
            self.pending.add(block_id)
            assert result is ReleaseResult.PENDING

    @rule(block_id=st.integers(min_value=0, max_value=N - 1))
    def idle(self, block_id: int) -> None:
        result = self.q.idle(self.blocks[block_id])
        if block_id in self.ref[3]:
            self.ref[3].remove(block_id)
            self.ref[2].append(block_id)
            assert result is IdleResult.MOVED
        else:
            assert result is IdleResult.NOOP

    @rule(block_id=st.integers(min_value=0, max_value=N - 1))
    def protect(self, block_id: int) -> None:
        result = self.q.protect(self.blocks[block_id])
        source = next((seg for seg in self.ref[2:4] if block_id in seg), None)
        if source is not None:
            source.remove(block_id)
            self.ref[4].append(block_id)
        assert result is (source is not None)

    @rule(block_id=st.integers(min_value=0, max_value=N - 1))
    def restore(self, block_id: int) -> None:
        result = self.q.restore(self.blocks[block_id])
        source = next((self.ref[i] for i in (1, 2, 4) if block_id in self.ref[i]), None)
        if source is not None:
            source.remove(block_id)
            self.ref[3].append(block_id)
            assert result is True
        elif block_id in self.pending:
            self.pending.discard(block_id)
            assert result is True
        else:
            assert result is False

    @rule(block_id=st.integers(min_value=0, max_value=N - 1))
    def refresh(self, block_id: int) -> None:
        result = self.q.refresh(self.blocks[block_id])
        source = next((seg for seg in self.ref[2:4] if block_id in seg), None)
        if source is not None:
            source.remove(block_id)
            self.ref[3].append(block_id)
        assert result is (source is not None)

    @invariant()
    def same_order_and_counts(self) -> None:
        assert ids(self.q.get_all_free_blocks()) == self.in_queue()
        assert self.q.num_free_blocks == len(self.in_queue())
        sizes = self.q.segment_sizes()
        names = ("free", "released", "idle", "normal", "protected")
        assert [sizes[name] for name in names] == [len(s) for s in self.ref]
        assert self.q.num_pending == len(self.pending)
        assert self.q.cached_reused == self.cached_popped
        assert self.q.num_cached == len(self.in_queue()) - len(self.ref[0])
        segments = (
            Segment.FREE,
            Segment.RELEASED,
            Segment.IDLE,
            Segment.NORMAL,
            Segment.PROTECTED,
        )
        for block in self.blocks:
            expected = next(
                (s for s, ref in zip(segments, self.ref, strict=True) if block.block_id in ref),
                None,
            )
            assert self.q.segment_of(block) is expected


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_block_leaves_the_middle_of_free() -> None:
    """vLLM never removes a FREE block (no hash, no hit), but the queue must still be right."""
    blocks = [FakeBlock(i) for i in range(4)]
    q = SegmentedFreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert ids(q.iter_blocks_after(blocks[0])) == [1, 3]
    assert q.segment_of(blocks[2]) is None
    assert ids(q.popleft_n(3)) == [0, 1, 3]


def test_capacity_covers_ids_not_given_at_construction() -> None:
    """vLLM pops the null block before the queue is built: its id must still fit."""
    q = SegmentedFreeBlockQueue([FakeBlock(3)], capacity=8)
    late = [FakeBlock(0), FakeBlock(7)]
    q.prepend_n(late[:1])
    q.append_n(cached(late[1:]))
    q.release(late[1])
    assert ids(q.get_all_free_blocks()) == [0, 3, 7]
    assert [q.segment_of(b) for b in late] == [Segment.FREE, Segment.RELEASED]
    beyond = cached([FakeBlock(8)])
    q.append_n(beyond)
    with pytest.raises(IndexError):
        q.release(beyond[0])


def test_counters_refuse_undeclared_names() -> None:
    from jiuwen_kv_protocol.models import COUNTER_NAMES, EngineStats, Segments
    from vllm_affinity.core.counters import Counters

    counters = Counters(COUNTER_NAMES)
    counters.add("releases_child_end")
    with pytest.raises(KeyError, match="undeclared"):
        counters.add("releases_childend")  # a typo fails where it is counted
    stats = EngineStats(
        segments=Segments(free=0, released=0, idle=0, normal=0, protected=0), pending=0,
        released_reused=0, protected_reused=0, children=0, sessions=0, bindings=0,
        sessions_evicted=0, num_blocks=1, **counters.as_dict(),
    )  # fmt: skip
    assert stats.counter("releases_child_end") == 1
    with pytest.raises(KeyError, match="undeclared"):
        stats.counter("block_released_childend")  # and where it is read


def test_a_picker_chooses_the_live_blocks_a_pop_takes() -> None:
    """The picker is asked once per pop that reaches NORMAL, for the NORMAL blocks it takes;
    what it names is taken in that order, anything it should not name (a block named twice,
    a RELEASED block, a block out of the queue) is skipped, and LRU's order fills the rest."""
    blocks = [FakeBlock(i) for i in range(8)]
    q = SegmentedFreeBlockQueue(blocks)
    q.append_n(cached(q.popleft_n(6)))  # FREE: 6, 7; NORMAL: 0..5 (LRU first)
    assert q.release(blocks[5]) is ReleaseResult.MOVED
    asked: list[tuple[int, list[int]]] = []

    def picker(take: int) -> tuple[int, list[Any]]:
        asked.append((take, ids(list(q.normal_lru()))))
        return 0, [blocks[4], blocks[4], blocks[5], blocks[6]]

    q.set_picker(picker)
    assert ids(q.popleft_n(2)) == [6, 7]  # FREE alone: never asked
    assert asked == []
    # RELEASED first (5), then three NORMAL blocks: LRU's 0 and 1 fill what the picker left
    # short, then its 4 (named twice, once taken; 5 is RELEASED, 6 out of the queue: skipped)
    assert ids(q.popleft_n(4)) == [5, 0, 1, 4]
    assert asked == [(3, [0, 1, 2, 3, 4])]
    assert q.segment_sizes() == {"free": 0, "released": 0, "idle": 0, "normal": 2, "protected": 0}
    assert ids(q.get_all_free_blocks()) == [2, 3]
    assert q.is_normal(blocks[2]) and not q.is_normal(blocks[4])
    q.set_picker(None)
    assert ids(q.popleft_n(2)) == [2, 3]


def test_the_handout_hook_hears_every_pop_once_its_blocks_are_out() -> None:
    """Every pop (FREE's fast path, a picker's choice, LRU's order through marked segments)
    calls the handout hook once with the blocks it returns, already out of the queue; a
    failed pop calls nothing, and ``None`` turns the hook off."""
    blocks = [FakeBlock(i) for i in range(8)]
    q = SegmentedFreeBlockQueue(blocks)
    heard: list[list[int]] = []

    def hook(out: list[Any]) -> None:
        assert all(b.prev_free_block is None and b.next_free_block is None for b in out)
        heard.append(ids(out))

    q.set_on_handout(hook)
    q.append_n(cached(q.popleft_n(6)))  # FREE: 6, 7; NORMAL: 0..5
    q.release(blocks[5])
    q.set_picker(lambda take: (0, [blocks[3]]))
    assert ids(q.popleft_n(1)) == [6]  # FREE alone
    assert ids(q.popleft_n(3)) == [7, 5, 3]  # FREE, RELEASED, then the picker's choice
    q.set_picker(None)
    assert ids(q.popleft_n(2)) == [0, 1]  # LRU's order
    with pytest.raises(ValueError):
        q.popleft_n(5)
    assert heard == [[0, 1, 2, 3, 4, 5], [6], [7, 5, 3], [0, 1]]
    q.set_on_handout(None)
    q.popleft_n(1)
    assert len(heard) == 4


def test_a_picker_answer_takes_lrus_own_first_victims_then_the_chosen_ones() -> None:
    """``(lru, chosen)``: the pop takes LRU's first ``lru`` victims from NORMAL's head, then
    the chosen blocks; one of those first victims chosen again is taken once, and LRU's order
    fills what that leaves short. ``(take, [])`` is LRU's own order, taken as it is."""
    blocks = [FakeBlock(i) for i in range(8)]
    q = SegmentedFreeBlockQueue(blocks)
    q.append_n(cached(q.popleft_n(8)))  # NORMAL: 0..7 (LRU first)
    q.set_picker(lambda take: (1, [blocks[5], blocks[6]]))
    assert ids(q.popleft_n(3)) == [0, 5, 6]
    assert ids(q.get_all_free_blocks()) == [1, 2, 3, 4, 7]
    q.set_picker(lambda take: (2, [blocks[4], blocks[1]]))  # 1 is LRU's own, chosen again
    assert sorted(ids(q.popleft_n(4))) == [1, 2, 3, 4]
    assert ids(q.get_all_free_blocks()) == [7]
    q.append_n(cached([blocks[0], blocks[5], blocks[6]]))  # NORMAL: 7, 0, 5, 6
    q.set_picker(lambda take: (take, []))  # LRU's own order: nothing moves
    assert ids(q.popleft_n(2)) == [7, 0]
    assert ids(q.get_all_free_blocks()) == [5, 6]
    assert q.segment_sizes()["normal"] == q.num_free_blocks == 2


def test_normal_lru_unheld_counts_victims_up_to_the_first_a_single_record_holds() -> None:
    """``normal_lru_unheld`` counts NORMAL's next victims (``n`` at most, other segments'
    never) up to the first one with one holder and an owner: a block held by two records, by
    a stale count (no first holder) or first held by a session that shared it does not stop
    it; the end of NORMAL does."""
    blocks = [FakeBlock(i) for i in range(10)]
    q = SegmentedFreeBlockQueue(blocks)
    q.append_n(cached(q.popleft_n(8)))  # FREE: 8, 9; NORMAL: 0..7 (LRU first)
    q.release(blocks[1])  # RELEASED: never a victim read here
    holders = [0] * 10
    first = [-1] * 10
    holders[0], first[0] = 2, 4  # two records
    holders[2], first[2] = 1, -1  # a stale count: nobody holds it
    holders[3], first[3] = 1, -3  # shared
    assert q.normal_lru_unheld(8, holders, first) == 7  # NORMAL ends after 0, 2..7
    assert q.normal_lru_unheld(3, holders, first) == 3
    holders[5], first[5] = 1, 0  # one record, owner 0
    assert q.normal_lru_unheld(8, holders, first) == 4  # 0, 2, 3, 4 come before it
    assert q.normal_lru_unheld(0, holders, first) == 0


def test_normal_lru_ids_reads_lrus_order_a_run_at_a_time() -> None:
    """``normal_lru_ids`` gives the ids of NORMAL's blocks in ``normal_lru``'s order, ``n`` at
    most, from the one after a block it named (``None``: the least recently used), never other
    segments'."""
    blocks = [FakeBlock(i) for i in range(10)]
    q = SegmentedFreeBlockQueue(blocks)
    q.append_n(cached(q.popleft_n(8)))  # FREE: 8, 9; NORMAL: 0..7 (LRU first)
    q.release(blocks[3])
    assert q.normal_lru_ids(None, 3) == [0, 1, 2] == ids(list(q.normal_lru())[:3])
    assert q.normal_lru_ids(blocks[2], 3) == [4, 5, 6]
    assert q.normal_lru_ids(blocks[6], 5) == [7]
    assert q.normal_lru_ids(blocks[7], 5) == [] and q.normal_lru_ids(None, 0) == []
