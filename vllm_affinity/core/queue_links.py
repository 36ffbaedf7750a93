"""Pure core: the segmented free-block queue's links and marks (no vLLM import).

The storage under ``SegmentedFreeBlockQueue`` (``queue.py``): one doubly linked list per segment
through the blocks' own ``prev_free_block`` / ``next_free_block`` (vLLM's intrusive links, no
allocation per operation), a mark per block id for the rare segments, and the segment sizes as
counts. Here are the calls that put a block in or take one out by its links, with the counts kept
true (``remove``, ``append_n``, ``prepend_n``, ``_link_run``), the reading of a block's segment
and the walk in eviction order; the queue adds popping, the picker and the marking verbs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from enum import IntEnum
from typing import Any, Protocol


class Block(Protocol):
    """What the queue needs of a block (vLLM's ``KVCacheBlock`` fits)."""

    block_id: int
    prev_free_block: Any
    next_free_block: Any

    @property
    def block_hash(self) -> Any: ...


#: Asked once per pop that reaches NORMAL: the ``take`` live blocks to pop, in place of LRU's
#: (the first ``take`` of ``normal_lru``), as ``(lru, chosen)``: LRU's own first ``lru``
#: victims, then the ``chosen`` blocks in order. Mostly the whole answer is LRU's own order
#: (``(take, [])``), said without naming a block. What ``chosen`` names that is not a queued
#: NORMAL block, or is named twice, is skipped; LRU's order fills what it leaves short.
#: ``PoolAffinity.pick``: the sessions predicted back last give up their blocks first.
Picker = Callable[[int], tuple[int, list[Block]]]


class Segment(IntEnum):
    """A segment of the queue; iteration order is pop order. The values are the hot path's
    marks: NORMAL is 0, so a block needs no mark to be NORMAL (see ``SegmentedFreeBlockQueue``)."""

    FREE = 1
    RELEASED = 2
    IDLE = 3
    NORMAL = 0
    PROTECTED = 4


class ReleaseResult(IntEnum):
    MOVED = 0  # was NORMAL, now RELEASED
    PENDING = 1  # in use: goes to RELEASED when freed
    NOOP = 2  # already FREE or RELEASED (or already pending)


class IdleResult(IntEnum):
    MOVED = 0  # was NORMAL, now IDLE
    NOOP = 1  # in use, or already FREE, RELEASED or IDLE


class _Sentinel:
    """Fake head/tail node: never handed out, ``block_id`` -1 like vLLM's fakes."""

    __slots__ = ("block_id", "next_free_block", "prev_free_block")

    def __init__(self) -> None:
        self.block_id = -1
        self.prev_free_block: Any = None
        self.next_free_block: Any = None


_NORMAL, _FREE, _RELEASED, _IDLE, _PROTECTED, _OUT = 0, 1, 2, 3, 4, -1  # plain ints: hot path
_POP_ORDER = (_FREE, _RELEASED, _IDLE, _NORMAL, _PROTECTED)
_MARKED = (_RELEASED, _IDLE, _PROTECTED)
#: A pending block's target past this: back to the *head* of segment ``target - _PARKED`` (an
#: offloader's copy took it out of its place there), not the tail.
_PARKED = 8


class SegmentLinks:
    """Free-block queue with FREE > RELEASED > IDLE > NORMAL > PROTECTED eviction priority;
    O(1) per block.

    How a block's segment is known without paying for it on vLLM's hot calls: a block is in
    the queue exactly when its ``prev_free_block`` is set (vLLM's own convention); a list
    indexed by block id marks the RELEASED, IDLE and PROTECTED blocks (the rare segments) while
    they are in them; a queued block that is not marked is FREE when it has no hash, else
    NORMAL. One count of the marked blocks guards the hot calls, so without releases, idle
    sessions or waiting parents ``append_n`` and ``prepend_n`` (every block ``BlockPool``
    frees) and popping FREE or NORMAL do the same work per block as vLLM's queue. The NORMAL
    size is the remainder of the total.
    """

    def __init__(self, blocks: Iterable[Block] = (), capacity: int | None = None) -> None:
        """``blocks`` start in FREE, in order. ``capacity`` bounds the block ids the queue will
        ever see (vLLM's ids are dense and fixed at start-up); by default, the largest id given
        plus one."""
        blocks = list(blocks)
        if capacity is None:
            capacity = max((b.block_id for b in blocks), default=-1) + 1
        self._heads = [_Sentinel() for _ in Segment]
        self._tails = [_Sentinel() for _ in Segment]
        for head, tail in zip(self._heads, self._tails, strict=True):
            head.next_free_block, tail.prev_free_block = tail, head
        # The hot paths' sentinels, by name (a list index costs more than it looks there).
        self._free_head, self._free_tail = self._heads[_FREE], self._tails[_FREE]
        self._normal_head, self._normal_tail = self._heads[_NORMAL], self._tails[_NORMAL]
        self._mark = [_NORMAL] * capacity
        self._num_free = 0  # size of FREE
        self._num_marked = 0  # size of RELEASED + IDLE + PROTECTED: the hot paths' one check
        self._num_idle = 0  # size of IDLE
        self._num_protected = 0  # size of PROTECTED
        #: Blocks out of the queue that go to a marked segment when freed, by id: RELEASED's
        #: tail (released in use), or ``_PARKED + segment``, the head of the segment an
        #: offloader's copy took them from (``offloading``). Unlisted: NORMAL's tail.
        self._pending: dict[int, int] = {}
        self._parking = False  # an offloader is copying: a block taken out is parked
        self._picker: Picker | None = None
        self._on_handout: Callable[[list[Block]], None] | None = None
        self._on_hook_error: Callable[[str, Exception], None] | None = None
        self.num_free_blocks = 0
        #: Released blocks handed out again (the point of releasing them).
        self.released_reused = 0
        self.released_hit = 0  # released blocks a prompt hit again before they were reused
        #: Protected blocks handed out all the same (nothing else was left).
        self.protected_reused = 0
        #: Cached blocks (any segment but FREE) handed out: the pool's eviction clock.
        self.cached_reused = 0
        #: Marked blocks an offloader's copy took out and was to put back (``offloading``).
        self.parked = 0
        #: Nanoseconds the picker took choosing victims (part of the plugin's time per step).
        self.picker_ns = 0
        self._link_run(blocks, _FREE)

    # -- links: in and out of the queue (vLLM's interface) -------------------------------------
    def remove(self, block: Block) -> None:
        """Take a cached block out of the queue (a prefix hit): it is live again, not released.
        Never a FREE block (the module's precondition): vLLM's hot call reads no hash here."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on a block not in the queue: {block.block_id}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        if self._num_marked and self._mark[block.block_id]:  # RELEASED, IDLE or PROTECTED
            mark = self._mark[block.block_id]
            if mark == _IDLE:
                self._num_idle -= 1
            elif mark == _PROTECTED:
                self._num_protected -= 1
            elif not self._parking:  # a prompt needed a released block: the release was wrong
                self.released_hit += 1
            if self._parking:  # a copy, not a use: back to its place when the copy is done
                self._pending[block.block_id] = _PARKED + mark
                self.parked += 1
            self._mark[block.block_id] = _NORMAL
            self._num_marked -= 1

    def append(self, block: Block) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[Block]) -> None:
        """Freed cached blocks: tail of NORMAL; a pending block where it waits to go (the tail of
        RELEASED, or its place back after an offloader's copy)."""
        if not blocks:
            return
        pending = self._pending
        if pending and any(b.block_id in pending for b in blocks):
            self._append_pending(blocks)
            return
        # vLLM's own append_n loop: NORMAL needs no mark. This is BlockPool's hottest call.
        tail = self._normal_tail
        prev = tail.prev_free_block
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = tail
        tail.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def _append_pending(self, blocks: list[Block]) -> None:
        """``append_n`` of blocks some of which are pending, each segment's run in order."""
        runs: dict[int, list[Block]] = {}
        pop = self._pending.pop
        for block in blocks:
            runs.setdefault(pop(block.block_id, _NORMAL), []).append(block)
        for target, run in runs.items():
            if target >= _PARKED:
                self._link_run(run, target - _PARKED, first=True)
            else:
                self._link_run(run, target)

    def prepend_n(self, blocks: list[Block]) -> None:
        """Put blocks at the head of FREE, keeping their order (the first is popped first)."""
        if not blocks:
            return
        if self._pending:
            for block in blocks:
                self._pending.pop(block.block_id, None)
        prev: Any = self._free_head
        after = prev.next_free_block
        for block in blocks:  # vLLM's own prepend_n loop: FREE needs no mark
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = after
        after.prev_free_block = prev
        self._num_free += len(blocks)
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[Block]:
        """Every queued block, in eviction order (every segment)."""
        return list(self._walk(self._heads[_FREE].next_free_block, ()))

    def iter_blocks_after(self, cursor: Block | None) -> Iterator[Block]:
        """Free blocks in eviction order after ``cursor`` (from the start when ``None``; nothing
        when the cursor is no longer in the queue, as in vLLM), RELEASED left out.

        vLLM's one caller is an offloader's walk (the simple CPU offloader's lazy mode), which
        copies the blocks it reads to its CPU tier before the GPU evicts them: a released
        block's content is dead, not worth a copy, and the copy's hold would undo its release.
        """
        if cursor is None:
            node = self._heads[_FREE].next_free_block
        elif cursor.prev_free_block is None:
            return
        elif self._num_marked and self._mark[cursor.block_id] == _RELEASED:
            node = self._heads[_IDLE].next_free_block  # released since the last walk
        else:
            node = cursor.next_free_block
        yield from self._walk(node, (_RELEASED,))

    def _walk(self, node: Any, skip: tuple[int, ...]) -> Iterator[Block]:
        """The blocks from ``node`` to the end of its segment, then the later segments' but
        ``skip``'s, in pop order."""
        tails = self._tails
        while True:
            while not isinstance(node, _Sentinel):
                yield node
                node = node.next_free_block
            later = _POP_ORDER.index(tails.index(node)) + 1
            while later < len(_POP_ORDER) and _POP_ORDER[later] in skip:
                later += 1
            if later == len(_POP_ORDER):
                return
            node = self._heads[_POP_ORDER[later]].next_free_block

    # -- introspection ------------------------------------------------------------------------
    def holds(self, block: Block) -> bool:
        """Whether ``block`` is in the queue (in any segment), by its own links."""
        return block.prev_free_block is not None

    def segment_of(self, block: Block) -> Segment | None:
        segment = self._segment_index(block)
        return None if segment == _OUT else Segment(segment)

    def headed_for(self, block: Block) -> Segment | None:
        """The block's segment; out of the queue, the one it goes to when freed (a release
        or an offloader's parking pending on it), else None."""
        segment = self._segment_index(block)
        if segment == _OUT:
            segment = self._pending.get(block.block_id, _OUT)
            segment = segment - _PARKED if segment >= _PARKED else segment
        return None if segment == _OUT else Segment(segment)

    @property
    def num_cached(self) -> int:
        """Cached blocks in the queue (every segment but FREE)."""
        return self.num_free_blocks - self._num_free

    def segment_sizes(self) -> dict[str, int]:
        released = self._num_marked - self._num_idle - self._num_protected
        normal = self.num_free_blocks - self._num_free - self._num_marked
        return {
            "free": self._num_free,
            "released": released,
            "idle": self._num_idle,
            "normal": normal,
            "protected": self._num_protected,
        }

    @property
    def num_pending(self) -> int:
        """Blocks out of the queue that go to a marked segment when freed (released in use, or
        parked by an offloader's copy)."""
        return len(self._pending)

    # -- links --------------------------------------------------------------------------------
    def _segment_index(self, block: Block) -> int:
        if block.prev_free_block is None:
            return _OUT
        mark = self._mark[block.block_id]
        if mark:
            return mark
        return _FREE if block.block_hash is None else _NORMAL

    def _link_run(self, blocks: list[Block], segment: int, first: bool = False) -> None:
        """Link ``blocks`` (in order) at the tail of ``segment`` (``first``: at its head); mark
        them if RELEASED, IDLE or PROTECTED."""
        if not blocks:
            return
        mark = self._mark
        prev: Any
        if first:
            prev = self._heads[segment]
            after = prev.next_free_block
        else:
            after = self._tails[segment]
            prev = after.prev_free_block
        marked = segment in _MARKED
        for block in blocks:
            if marked:
                mark[block.block_id] = segment
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = after
        after.prev_free_block = prev
        if segment == _FREE:
            self._num_free += len(blocks)
        elif marked:
            self._num_marked += len(blocks)
            if segment == _IDLE:
                self._num_idle += len(blocks)
            elif segment == _PROTECTED:
                self._num_protected += len(blocks)
        self.num_free_blocks += len(blocks)
