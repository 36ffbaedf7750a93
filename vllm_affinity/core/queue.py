"""Pure core: the segmented free-block queue (no vLLM import).

A drop-in for vLLM's ``FreeKVCacheBlockQueue``: same methods, same intrusive links
(``prev_free_block`` / ``next_free_block`` on the blocks themselves, so no allocation per
operation), but five segments popped in order:

    FREE       blocks without a cached hash (never hit again)      — popped first
    RELEASED   cached blocks a session declared stale, LRU order
    IDLE       cached blocks of sessions waiting on their user, in the order they went idle
    NORMAL     cached blocks, LRU order
    PROTECTED  cached blocks of parents waiting on running subagents — popped last

Where blocks go, mirroring how ``BlockPool`` uses the queue:

- ``prepend_n`` (freed blocks without a hash) → head of FREE, so FREE is last-in first-out,
  as vLLM's own queue is for these blocks;
- ``append`` / ``append_n`` (freed cached blocks) → tail of NORMAL, or of RELEASED for a block
  that ``release`` marked pending while it was still in use;
- ``release`` of a queued NORMAL or IDLE block → tail of RELEASED;
- ``idle`` of a queued NORMAL block → tail of IDLE (a block in use is in use: no pending idle);
- ``refresh`` of a queued NORMAL or IDLE block → tail of NORMAL (a shared state a live request
  relied on without a hit: ``checkpoints.py``);
- ``protect`` of a queued NORMAL or IDLE block → tail of PROTECTED (the caller bounds how many:
  PROTECTED is still free, so it never starves an allocation, it only comes last).

A picker (``set_picker``; ``PoolAffinity.pick`` with ``VLLM_AFFINITY_PREDICT_RETURN``) may
choose which NORMAL blocks a pop takes instead of LRU's: asked once per pop that reaches NORMAL,
for all the live blocks it takes (``normal_lru_ids`` gives it LRU's order); what it chooses out
of that order leaves NORMAL at once, and the pop takes it after the rest.

Invariants: every block in the queue is in exactly one segment; ``num_free_blocks`` is the sum of
the segment sizes; RELEASED, IDLE and NORMAL keep insertion order (least recently freed first). A
released or idle block keeps its hash: it can still be hit until it is actually reused.

Precondition, ``BlockPool``'s own rule: ``prepend_n`` gets blocks without a hash, and
``remove`` (the prefix hit) only blocks with one, since a block without a hash is never hit. The
queue reads ``block_hash`` only where it must tell a FREE block from a NORMAL one outside the
hot loops (``release``, ``idle``, a picker's answer), so ``prepend_n``, ``remove`` and popping
FREE write no mark and read no hash.

The parts: this module pops, picks and marks; ``queue_links.py`` keeps the links, the marks and
the counts (what a block's segment is, and how one goes in or out).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from time import perf_counter_ns

from .queue_links import (
    _FREE,
    _IDLE,
    _MARKED,
    _NORMAL,
    _OUT,
    _PROTECTED,
    _RELEASED,
    Block,
    IdleResult,
    Picker,
    ReleaseResult,
    Segment,
    SegmentLinks,
    _Sentinel,
)

__all__ = ["Block", "IdleResult", "Picker", "ReleaseResult", "Segment", "SegmentedFreeBlockQueue"]


class SegmentedFreeBlockQueue(SegmentLinks):
    """Free-block queue with FREE > RELEASED > IDLE > NORMAL > PROTECTED eviction priority;
    O(1) per block: the pops, the picker and the marking verbs over ``SegmentLinks``' lists
    (which says how a block's segment is known without a cost on vLLM's hot calls)."""

    # -- vLLM's FreeKVCacheBlockQueue interface -----------------------------------------------
    def popleft(self) -> Block:
        if not self.num_free_blocks:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Block]:
        """vLLM's pool hands blocks out for new content through this call alone
        (``BlockPool.get_new_blocks``): the handout hook hears of them here, at the cost of a
        call, not a wrap of vLLM's method."""
        out = self._popleft_n(n)
        if self._on_handout is not None:
            try:
                self._on_handout(out)
            except Exception as exc:  # the blocks are out of the queue all the same
                self._hook_failed("handout", exc)
        return out

    def _popleft_n(self, n: int) -> list[Block]:
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} free")
        self.num_free_blocks -= n
        out: list[Block] = []
        num_free = self._num_free
        if num_free >= n:  # FREE alone (a decode step's one block, mostly)
            head = self._free_head
            node = head.next_free_block
            for _ in range(n):
                out.append(node)
                nxt = node.next_free_block
                node.prev_free_block = node.next_free_block = None
                node = nxt
            head.next_free_block = node
            node.prev_free_block = head
            self._num_free = num_free - n
            return out
        if self._picker is not None:
            start = perf_counter_ns()
            picked = self._repick(n)
            self.picker_ns += perf_counter_ns() - start
            if picked:  # out of NORMAL already: the rest is popped as usual, then these
                out = self._pop_in_order(n - len(picked), out)
                out += picked
                self.cached_reused += len(picked)
                return out
        return self._pop_in_order(n, out)

    def _pop_in_order(self, n: int, out: list[Block]) -> list[Block]:
        """Pop ``n`` blocks onto ``out`` in the segments' order (``num_free_blocks`` is already
        net of them); FREE alone does not hold them."""
        if self._num_marked:
            return self._pop_through_marked(n, out)
        num_free = self._num_free
        # What FREE holds, then NORMAL, in vLLM's one loop: FREE's last block is linked to
        # NORMAL's first and FREE is emptied first.
        normal = self._normal_head
        node = normal.next_free_block
        if num_free:
            head, tail = self._free_head, self._free_tail
            tail.prev_free_block.next_free_block = node
            node = head.next_free_block
            head.next_free_block, tail.prev_free_block = tail, head
            self._num_free = 0
        for _ in range(n):
            out.append(node)
            nxt = node.next_free_block
            node.prev_free_block = node.next_free_block = None
            node = nxt
        normal.next_free_block = node
        node.prev_free_block = normal
        self.cached_reused += n - num_free
        return out

    def _pop_through_marked(self, n: int, out: list[Block]) -> list[Block]:
        """``popleft_n`` when RELEASED, IDLE or PROTECTED hold blocks: each segment in turn, its
        count settled once, not per block; the first one alone when it has enough."""
        num_idle, num_protected = self._num_idle, self._num_protected
        released = self._num_marked - num_idle - num_protected
        if not self._num_free:  # the usual case: the first segment alone has enough
            if released >= n:
                self._take(_RELEASED, n, out)
                return out
            if not released and num_idle >= n:
                self._take(_IDLE, n, out)
                return out
        # num_free_blocks is already net of the n popped
        normal = self.num_free_blocks + n - self._num_free - self._num_marked
        for segment, size in (
            (_FREE, self._num_free),
            (_RELEASED, released),
            (_IDLE, num_idle),
            (_NORMAL, normal),
            (_PROTECTED, num_protected),
        ):
            take = size if size < n else n
            if take:
                self._take(segment, take, out)
                n -= take
                if not n:
                    break
        return out

    def _take(self, segment: int, take: int, out: list[Block]) -> None:
        """Unlink the first ``take`` blocks of ``segment`` (they exist) onto ``out``."""
        head = self._heads[segment]
        node = head.next_free_block
        if segment in (_FREE, _NORMAL):  # unmarked
            for _ in range(take):
                out.append(node)
                nxt = node.next_free_block
                node.prev_free_block = node.next_free_block = None
                node = nxt
        else:  # each block's mark is cleared as it leaves: one walk, not two
            mark = self._mark
            for _ in range(take):
                out.append(node)
                mark[node.block_id] = _NORMAL
                nxt = node.next_free_block
                node.prev_free_block = node.next_free_block = None
                node = nxt
        head.next_free_block = node
        node.prev_free_block = head
        if segment == _FREE:
            self._num_free -= take
            return
        self.cached_reused += take
        if segment != _NORMAL:
            self._num_marked -= take
            if segment == _IDLE:
                self._num_idle -= take
            elif segment == _PROTECTED:
                self._num_protected -= take
                self.protected_reused += take
            else:
                self.released_reused += take

    # -- the picker ---------------------------------------------------------------------------
    def set_picker(self, picker: Picker | None) -> None:
        """Let ``picker`` choose the live (NORMAL) blocks a pop takes; ``None``: LRU's."""
        self._picker = picker

    def set_on_hook_error(self, hook: Callable[[str, Exception], None] | None) -> None:
        """Where a failure of the picker or the handout hook goes (``"picker"`` or
        ``"handout"``, the exception): the pop goes on as if the hook were absent. ``None``:
        the failure is raised (a bug the caller's tests must see)."""
        self._on_hook_error = hook

    def _hook_failed(self, hook: str, exc: Exception) -> None:
        if self._on_hook_error is None:
            raise exc
        self._on_hook_error(hook, exc)

    def set_on_handout(self, hook: Callable[[list[Block]], None] | None) -> None:
        """Call ``hook`` with every pop's blocks, once they are out of the queue (the pool
        hands them out for new content); ``None``: no call."""
        self._on_handout = hook

    def _repick(self, n: int) -> list[Block]:
        """Before a pop of ``n``: the NORMAL blocks the picker chose out of LRU's order, asked at
        once, taken out of the queue in that order (the pop adds them after the rest); LRU's
        own first ones, and any it leaves short, the pop takes from NORMAL's head as usual."""
        before = self._num_free + self._num_marked - self._num_protected
        # num_free_blocks is already net of the n popped
        normal = self.num_free_blocks + n - self._num_free - self._num_marked
        take = min(normal, n - before)
        if take <= 0:
            return []
        assert self._picker is not None
        try:
            lru, chosen = self._picker(take)
        except Exception as exc:  # nothing moved yet: LRU's order takes the pop
            self._hook_failed("picker", exc)
            return []
        picked: list[Block] = []
        mark = self._mark
        for block in chosen[: take - min(lru, take)]:
            if block.prev_free_block is None or mark[block.block_id] or block.block_hash is None:
                continue  # not a queued NORMAL block (``is_normal``), or named twice
            left, right = block.prev_free_block, block.next_free_block
            left.next_free_block = right
            right.prev_free_block = left
            block.prev_free_block = block.next_free_block = None
            picked.append(block)
        return picked

    def normal_lru_ids(self, after: Block | None, n: int) -> list[int]:
        """The ids of up to ``n`` NORMAL blocks in LRU's order, from the one after ``after``
        (``None``: from the least recently used): a picker reads its victims a run at a time."""
        node, tail = (after or self._normal_head).next_free_block, self._normal_tail
        out: list[int] = []
        append = out.append
        for _ in range(n):
            if node is tail:
                break
            append(node.block_id)
            node = node.next_free_block
        return out

    def normal_lru_unheld(self, n: int, holders: Sequence[int], first_holder: Sequence[int]) -> int:
        """How many of LRU's next ``n`` NORMAL victims come before the first one a single
        record holds (``holders`` 1 and an owner, not a mark, in ``first_holder``: the pool's
        per-block arrays) or the end of NORMAL: ``n`` answers a picker's pop with no swap to
        consider in one walk, without listing the victims (most pops, once a pool is full)."""
        node, tail = self._normal_head.next_free_block, self._normal_tail
        for count in range(n):
            if node is tail:
                return count
            block_id = node.block_id
            if holders[block_id] == 1 and first_holder[block_id] >= 0:
                return count
            node = node.next_free_block
        return n

    def normal_lru(self) -> Iterator[Block]:
        """The NORMAL blocks, least recently used first (a picker's reading of LRU's order)."""
        node = self._normal_head.next_free_block
        while not isinstance(node, _Sentinel):
            yield node
            node = node.next_free_block

    def normal_until_in_use(
        self,
        block_ids: Sequence[int],
        blocks: Sequence[Block],
        start: int = 0,
        most: int | None = None,
    ) -> tuple[list[int], int, bool]:
        """The ids of the queued NORMAL ones of ``block_ids[start:]`` (``blocks``: every block
        by id), in order, up to the first not queued at all (in use) or the ``most``-th found;
        where the reading stopped (the index after the last one read); and whether it stopped
        at a block in use. A picker needs no more than its pop takes: it reads the rest, if
        ever, from where this stopped."""
        mark, out = self._mark, list[int]()
        end = len(block_ids)
        if most is None:
            most = end
        for at in range(start, end):
            block_id = block_ids[at]
            block = blocks[block_id]
            if block.prev_free_block is None:
                return out, at, True
            if not mark[block_id] and block.block_hash is not None:
                out.append(block_id)
                if len(out) == most:
                    return out, at + 1, False
        return out, end, False

    def is_normal(self, block: Block) -> bool:
        """Whether the block is queued in NORMAL (``segment_of`` without the enum, for loops)."""
        return (
            block.prev_free_block is not None
            and not self._mark[block.block_id]
            and block.block_hash is not None
        )

    # -- release ------------------------------------------------------------------------------
    def release(self, block: Block) -> ReleaseResult:
        """Make a block the next cached block to be reused (after the uncached ones)."""
        segment = self._segment_index(block)
        if segment in (_NORMAL, _IDLE, _PROTECTED):
            self.remove(block)
            self._link_run([block], _RELEASED)
            return ReleaseResult.MOVED
        if segment != _OUT or self._pending.get(block.block_id) == _RELEASED:
            return ReleaseResult.NOOP
        self._pending[block.block_id] = _RELEASED  # parked by a copy, too: released now
        return ReleaseResult.PENDING

    def idle(self, block: Block) -> IdleResult:
        """Its session waits on a user: a queued NORMAL block goes to the tail of IDLE, reused
        after the released blocks and before every live session's. A block in use (another
        session's, or its own session came back) stays as it is."""
        if self._segment_index(block) != _NORMAL:
            return IdleResult.NOOP
        self.remove(block)
        self._link_run([block], _IDLE)
        return IdleResult.MOVED

    def protect(self, block: Block) -> bool:
        """Its session waits on running subagents: a queued NORMAL or IDLE block goes to the
        tail of PROTECTED, reused after every other cached block. False when it was neither."""
        if self._segment_index(block) not in (_NORMAL, _IDLE):
            return False
        self.remove(block)
        self._link_run([block], _PROTECTED)
        return True

    def refresh(self, block: Block) -> bool:
        """A queued NORMAL or IDLE block goes to NORMAL's most-recently-used end, as a prefix
        hit and its free would put it (a shared state a live request relied on without touching
        it). False when the block was neither."""
        if self._segment_index(block) not in (_NORMAL, _IDLE):
            return False
        self.remove(block)
        self.append_n([block])
        return True

    def restore(self, block: Block) -> bool:
        """Undo ``release``, ``idle`` or ``protect``: a RELEASED, IDLE or PROTECTED block goes to
        the most-recently-used end of NORMAL, a pending one will go to NORMAL when freed. False
        when the block was none of these."""
        if self._segment_index(block) in _MARKED:
            self.remove(block)
            self.append_n([block])
            return True
        return self.cancel_pending(block.block_id)

    def cancel_pending(self, block_id: int) -> bool:
        """Another user took the block: when freed it goes back to NORMAL."""
        return self._pending.pop(block_id, None) is not None

    def pending_ids(self) -> list[int]:
        """The blocks that go to a marked segment when freed (``num_pending``)."""
        return list(self._pending)

    def cancel_pending_many(self, block_ids: Iterable[int]) -> None:
        """``cancel_pending`` for each of ``block_ids``."""
        pending = self._pending
        if pending:
            for block_id in block_ids:
                pending.pop(block_id, None)

    @contextmanager
    def offloading(self) -> Iterator[None]:
        """An offloader copies the blocks it takes out of the queue meanwhile (its hold, vLLM's
        ``BlockPool.touch``): a RELEASED, IDLE or PROTECTED one is parked, not used: no
        ``released_hit``, and when the copy frees it, it goes back to the head of its segment,
        where the offloader's walk (eviction order) found it. A block a request binds meanwhile
        is live again (``cancel_pending``): NORMAL's tail when freed, as any other."""
        self._parking = True
        try:
            yield
        finally:
            self._parking = False
