"""Pure core: the three-segment free-block queue (no vLLM import).

A drop-in for vLLM's ``FreeKVCacheBlockQueue``: same methods, same intrusive links
(``prev_free_block`` / ``next_free_block`` on the blocks themselves, so no allocation per
operation), but three segments popped in order:

    FREE      blocks without a cached hash (never hit again)      — head of the queue
    RELEASED  cached blocks a session declared stale, LRU order
    NORMAL    cached blocks, LRU order                             — tail of the queue

Invariants: every block in the queue is in exactly one segment; ``num_free_blocks`` is the sum
of the segment sizes; within a segment, order is insertion order (LRU). A released block keeps
its hash: it can still be hit until it is actually reused.

Where blocks go, mirroring how ``BlockPool`` uses the queue: ``prepend_n`` (freed blocks without
a hash) → head of FREE; ``append``/``append_n`` (freed cached blocks) → tail of NORMAL, or of
RELEASED when the block was marked pending by ``release`` while it was still in use.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from enum import IntEnum
from typing import Any, Protocol


class Block(Protocol):
    """What the queue needs of a block (vLLM's ``KVCacheBlock`` fits)."""

    block_id: int
    prev_free_block: Any
    next_free_block: Any


class Segment(IntEnum):
    FREE = 0
    RELEASED = 1
    NORMAL = 2


class ReleaseResult(IntEnum):
    MOVED = 0  # was NORMAL, now RELEASED
    PENDING = 1  # in use: goes to RELEASED when freed
    NOOP = 2  # already FREE or RELEASED (or already pending)


class _Sentinel:
    """Fake head/tail node: never handed out, ``block_id`` -1 like vLLM's fakes."""

    __slots__ = ("block_id", "next_free_block", "prev_free_block")

    def __init__(self) -> None:
        self.block_id = -1
        self.prev_free_block: Any = None
        self.next_free_block: Any = None


class SegmentedFreeBlockQueue:
    """Free-block queue with FREE > RELEASED > NORMAL eviction priority; O(1) per block."""

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._heads = [_Sentinel() for _ in Segment]
        self._tails = [_Sentinel() for _ in Segment]
        for head, tail in zip(self._heads, self._tails, strict=True):
            head.next_free_block, tail.prev_free_block = tail, head
        self._sizes = [0, 0, 0]
        self._segment_of: dict[int, Segment] = {}
        self._pending: set[int] = set()
        self.num_free_blocks = 0
        #: Released blocks handed out again (the point of releasing them).
        self.released_reused = 0
        for block in blocks:
            self._link_last(block, Segment.FREE)

    # -- vLLM's FreeKVCacheBlockQueue interface -----------------------------------------------
    def popleft(self) -> Block:
        for segment in Segment:
            if self._sizes[segment]:
                block = self._heads[segment].next_free_block
                self._unlink(block)
                if segment is Segment.RELEASED:
                    self.released_reused += 1
                return block
        raise ValueError("No free blocks available")

    def popleft_n(self, n: int) -> list[Block]:
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: Block) -> None:
        """Take a block out of the queue (a prefix hit): it is live again, not released."""
        if block.block_id not in self._segment_of:
            raise RuntimeError(f"remove() called on a block not in the queue: {block.block_id}")
        self._unlink(block)

    def append(self, block: Block) -> None:
        self._link_last(block, self._segment_for_cached(block))

    def append_n(self, blocks: Iterable[Block]) -> None:
        for block in blocks:
            self._link_last(block, self._segment_for_cached(block))

    def prepend_n(self, blocks: list[Block]) -> None:
        """Put blocks at the head of FREE, keeping their order (the first is popped first)."""
        for block in reversed(blocks):
            self._pending.discard(block.block_id)
            self._link_first(block, Segment.FREE)

    def get_all_free_blocks(self) -> list[Block]:
        return list(self.iter_blocks_after(None))

    def iter_blocks_after(self, cursor: Block | None) -> Iterator[Block]:
        """Free blocks in eviction order after ``cursor`` (from the start when ``None``; nothing
        when the cursor is no longer in the queue, as in vLLM)."""
        if cursor is None:
            first_segment, node = 0, self._heads[0].next_free_block
        else:
            segment = self._segment_of.get(cursor.block_id)
            if segment is None:
                return
            first_segment, node = segment, cursor.next_free_block
        for segment in range(first_segment, len(Segment)):
            if segment != first_segment:
                node = self._heads[segment].next_free_block
            tail = self._tails[segment]
            while node is not tail:
                yield node
                node = node.next_free_block

    # -- release ------------------------------------------------------------------------------
    def release(self, block: Block) -> ReleaseResult:
        """Make a block the next cached block to be reused (after the uncached ones)."""
        segment = self._segment_of.get(block.block_id)
        if segment is Segment.NORMAL:
            self._unlink(block)
            self._link_last(block, Segment.RELEASED)
            return ReleaseResult.MOVED
        if segment is not None or block.block_id in self._pending:
            return ReleaseResult.NOOP
        self._pending.add(block.block_id)
        return ReleaseResult.PENDING

    def cancel_pending(self, block_id: int) -> bool:
        """Another user took the block: when freed it goes back to NORMAL."""
        if block_id in self._pending:
            self._pending.discard(block_id)
            return True
        return False

    # -- introspection ------------------------------------------------------------------------
    def segment_of(self, block: Block) -> Segment | None:
        return self._segment_of.get(block.block_id)

    def segment_sizes(self) -> dict[str, int]:
        return {segment.name.lower(): self._sizes[segment] for segment in Segment}

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def segment_blocks(self, segment: Segment) -> list[Block]:
        out, node, tail = [], self._heads[segment].next_free_block, self._tails[segment]
        while node is not tail:
            out.append(node)
            node = node.next_free_block
        return out

    # -- links --------------------------------------------------------------------------------
    def _segment_for_cached(self, block: Block) -> Segment:
        if block.block_id in self._pending:
            self._pending.discard(block.block_id)
            return Segment.RELEASED
        return Segment.NORMAL

    def _link_last(self, block: Block, segment: Segment) -> None:
        tail = self._tails[segment]
        last = tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self._added(block, segment)

    def _link_first(self, block: Block, segment: Segment) -> None:
        head = self._heads[segment]
        first = head.next_free_block
        head.next_free_block = block
        block.prev_free_block = head
        block.next_free_block = first
        first.prev_free_block = block
        self._added(block, segment)

    def _added(self, block: Block, segment: Segment) -> None:
        self._segment_of[block.block_id] = segment
        self._sizes[segment] += 1
        self.num_free_blocks += 1

    def _unlink(self, block: Block) -> None:
        segment = self._segment_of.pop(block.block_id)
        prev, nxt = block.prev_free_block, block.next_free_block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self._sizes[segment] -= 1
        self.num_free_blocks -= 1
