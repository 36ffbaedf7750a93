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


_FREE, _RELEASED, _NORMAL, _OUT = 0, 1, 2, -1  # plain ints on the hot path; Segment outside


class SegmentedFreeBlockQueue:
    """Free-block queue with FREE > RELEASED > NORMAL eviction priority; O(1) per block.

    Hot-path notes: a block is in the queue exactly when its ``prev_free_block`` is set (vLLM's
    own convention); the segment it was last linked into is kept in a list indexed by block id
    (vLLM's ids are dense), written only when linking. Batch operations link whole runs at once,
    as vLLM's queue does, and the pending set is only consulted when it is not empty.
    """

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._heads = [_Sentinel() for _ in Segment]
        self._tails = [_Sentinel() for _ in Segment]
        for head, tail in zip(self._heads, self._tails, strict=True):
            head.next_free_block, tail.prev_free_block = tail, head
        self._sizes = [0, 0, 0]
        self._seg: list[int] = []
        self._pending: set[int] = set()
        self.num_free_blocks = 0
        #: Released blocks handed out again (the point of releasing them).
        self.released_reused = 0
        self._link_run(list(blocks), _FREE, False)

    # -- vLLM's FreeKVCacheBlockQueue interface -----------------------------------------------
    def popleft(self) -> Block:
        if not self.num_free_blocks:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Block]:
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} free")
        out: list[Block] = []
        sizes = self._sizes
        if n <= sizes[_FREE]:  # fast path: uncached blocks only (the common case)
            head = self._heads[_FREE]
            node = head.next_free_block
            for _ in range(n):
                out.append(node)
                nxt = node.next_free_block
                node.prev_free_block = node.next_free_block = None
                node = nxt
            head.next_free_block = node
            node.prev_free_block = head
            sizes[_FREE] -= n
            self.num_free_blocks -= n
            return out
        remaining = n
        heads = self._heads
        for segment in (_FREE, _RELEASED, _NORMAL):
            size = sizes[segment]
            if not size:
                continue
            take = size if size < remaining else remaining
            head = heads[segment]
            node = head.next_free_block
            for _ in range(take):
                out.append(node)
                nxt = node.next_free_block
                node.prev_free_block = node.next_free_block = None
                node = nxt
            head.next_free_block = node
            node.prev_free_block = head
            sizes[segment] = size - take
            if segment == _RELEASED:
                self.released_reused += take
            remaining -= take
            if not remaining:
                break
        self.num_free_blocks -= n
        return out

    def remove(self, block: Block) -> None:
        """Take a block out of the queue (a prefix hit): it is live again, not released."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on a block not in the queue: {block.block_id}")
        segment = self._seg[block.block_id]
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self._sizes[segment] -= 1
        self.num_free_blocks -= 1

    def append(self, block: Block) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[Block]) -> None:
        """Freed cached blocks: tail of NORMAL, or of RELEASED for blocks released in use."""
        if not blocks:
            return
        pending = self._pending
        if pending and any(b.block_id in pending for b in blocks):
            for block in blocks:
                if block.block_id in pending:
                    pending.discard(block.block_id)
                    self._link_run([block], _RELEASED, False)
                else:
                    self._link_run([block], _NORMAL, False)
            return
        # Inlined _link_run(blocks, _NORMAL, False): this is the hottest call of BlockPool.
        seg_of = self._seg
        tail = self._tails[_NORMAL]
        prev = tail.prev_free_block
        try:
            for block in blocks:
                seg_of[block.block_id] = _NORMAL
                block.prev_free_block = prev
                prev.next_free_block = block
                prev = block
        except IndexError:  # a block id never seen before: take the general path
            self._grow(max(b.block_id for b in blocks))
            tail.prev_free_block.next_free_block = tail  # undo the partial run's dangling link
            self._link_run(blocks, _NORMAL, False)
            return
        prev.next_free_block = tail
        tail.prev_free_block = prev
        self._sizes[_NORMAL] += len(blocks)
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[Block]) -> None:
        """Put blocks at the head of FREE, keeping their order (the first is popped first)."""
        if not blocks:
            return
        if self._pending:
            self._pending.difference_update(b.block_id for b in blocks)
        # Inlined _link_run(blocks, _FREE, True): called on every request free.
        seg_of = self._seg
        prev = self._heads[_FREE]
        after = prev.next_free_block
        try:
            for block in blocks:
                seg_of[block.block_id] = _FREE
                block.prev_free_block = prev
                prev.next_free_block = block
                prev = block
        except IndexError:  # a block id never seen before: take the general path
            self._grow(max(b.block_id for b in blocks))
            self._heads[_FREE].next_free_block = after  # undo the partial run's link
            self._link_run(blocks, _FREE, True)
            return
        prev.next_free_block = after
        after.prev_free_block = prev
        self._sizes[_FREE] += len(blocks)
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[Block]:
        return list(self.iter_blocks_after(None))

    def iter_blocks_after(self, cursor: Block | None) -> Iterator[Block]:
        """Free blocks in eviction order after ``cursor`` (from the start when ``None``; nothing
        when the cursor is no longer in the queue, as in vLLM)."""
        if cursor is None:
            first_segment, node = _FREE, self._heads[_FREE].next_free_block
        else:
            first_segment = self._segment_index(cursor)
            if first_segment == _OUT:
                return
            node = cursor.next_free_block
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
        segment = self._segment_index(block)
        if segment == _NORMAL:
            self._unlink(block)
            self._link_run([block], _RELEASED, False)
            return ReleaseResult.MOVED
        if segment != _OUT or block.block_id in self._pending:
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
        segment = self._segment_index(block)
        return None if segment == _OUT else Segment(segment)

    def segment_sizes(self) -> dict[str, int]:
        return {segment.name.lower(): self._sizes[segment] for segment in Segment}

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # -- links --------------------------------------------------------------------------------
    def _segment_index(self, block: Block) -> int:
        if block.prev_free_block is None:
            return _OUT
        return self._seg[block.block_id]

    def _link_run(self, blocks: list[Block], segment: int, at_head: bool) -> None:
        """Link ``blocks`` (in order) at the head or the tail of ``segment``."""
        if not blocks:
            return
        seg_of = self._seg
        if at_head:
            prev = self._heads[segment]
            after = prev.next_free_block
        else:
            after = self._tails[segment]
            prev = after.prev_free_block
        for block in blocks:
            try:
                seg_of[block.block_id] = segment
            except IndexError:  # a block id never seen: grow the membership list
                self._grow(block.block_id)
                seg_of[block.block_id] = segment
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = after
        after.prev_free_block = prev
        self._sizes[segment] += len(blocks)
        self.num_free_blocks += len(blocks)

    def _grow(self, block_id: int) -> None:
        self._seg.extend([_OUT] * (block_id + 1 - len(self._seg)))

    def _unlink(self, block: Block) -> None:
        segment = self._seg[block.block_id]
        prev, nxt = block.prev_free_block, block.next_free_block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self._sizes[segment] -= 1
        self.num_free_blocks -= 1
