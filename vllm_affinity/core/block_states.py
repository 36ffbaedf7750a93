"""Pure core: per KV block of the pool, who holds its current content (no vLLM import).

One ``BlockStates`` per ``BlockPool``, shared by the session tables of every KV-cache group
(``sessions.py``): vLLM's pool hands each block to one group at a time, so one set of arrays
serves them all, and a block handed out for new content is let go of once (``unbind``), whatever
group it served before. Per block of the pool: 12 bytes.

Per block, by block id (vLLM's ids are dense, fixed at start-up: ``capacity``, grown on demand
past it): how many records hold its current content, its generation (the handout that last
gave it new content: a record that names it with another one holds nothing there), and the
owner index of its first holder, or ``SHARED`` once a second session held that content. The
owners are session names without their branch (``core/compaction.py``), indexed once.

A block handed out again (``unbind``) gets the handout's generation (one counter for the pool,
so a handout of many blocks writes one value, not a read, an add and a write per block) and no
first holder (``NOBODY``), and nothing else is written: its holder count means something only
while it has a first holder (a hold of fresh content sets it), so a reused block costs two
writes, not four. Before the counter would pass a ``uint32``, every record's entries are
renumbered (``renumber``): those still holding their content name generation 1, which every
block then has, the others 0.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

#: ``first_holder`` marks: no record has held the block's content; its first holder's owner
#: left the tables (another session, as far as a new holder is concerned); a second session
#: held it (its content is not one session's to declare dead).
NOBODY, GONE, SHARED = -1, -2, -3
#: Up to this many blocks, a hold or unbind goes block by block (numpy's set-up costs more).
FEW_BLOCKS = 24
#: The last generation ``unbind`` hands out before it renumbers (``BlockStates.renumber``).
EPOCH_LIMIT = 2**32 - 1
#: Bytes per block id in an index array (``id_array``; records keep theirs in 4).
INDEX_SIZE = struct.calcsize("n")


def id_array(block_ids: Sequence[int]) -> np.ndarray:
    """Block ids as a (writable) array of numpy's index type (``intp``): numpy gathers and
    scatters by an ``int32`` index array at 2-3x the cost, converting it each time (0.73
    against 0.19 µs to gather 96 blocks' generations), and a record's bind does several. A
    list (vLLM's) is packed by ``struct``: about 2.4x faster than numpy's conversion of Python
    ints, and the scheduler's path converts every block id a request binds or reuses."""
    if isinstance(block_ids, np.ndarray):
        return block_ids.astype(np.intp, copy=False)
    count = len(block_ids)
    packed = bytearray(INDEX_SIZE * count)
    struct.pack_into(f"{count}n", packed, 0, *block_ids)
    return np.frombuffer(packed, np.intp)


@dataclass(frozen=True, slots=True)
class BlockViews:
    """numpy views of the per-block arrays (by block id)."""

    holders: np.ndarray
    generation: np.ndarray
    first_holder: np.ndarray


class BlockStates:
    """The per-block arrays (``array`` for a few Python steps, numpy views for many) and the
    owner names. The arrays grow in place, so a table may keep a reference to them; a numpy
    view pins its array's size, so none outlives a call but ``views`` (remade as they grow)."""

    def __init__(self, capacity: int = 0, fixed: bool = False) -> None:
        """``fixed``: no block id will reach ``capacity`` (a vLLM pool's: its ids are dense
        and fixed at start-up), so ids are used without a bound check (``as_ids``)."""
        self.fixed = fixed
        self.holders = array("i")  # block id → records holding its current content
        self.generation = array("I")  # block id → the handout that gave it its content
        self.first_holder = array("i")  # block id → owner index of its first holder, or a mark
        self.owner_index: dict[str, int] = {}
        self.owners: list[str] = []
        #: The last generation handed out (``unbind``), and the last before a renumbering.
        self.epoch = 0
        self.epoch_limit = EPOCH_LIMIT
        #: Per table over these arrays: its records' (block ids, generations), for ``renumber``.
        self.record_sources: list[Callable[[], Iterable[tuple[array[int], array[int]]]]] = []
        self._views: BlockViews | None = None
        self.ensure(capacity)

    @property
    def nbytes(self) -> int:
        """What the per-block arrays and the owner names take."""
        arrays = (self.holders, self.generation, self.first_holder)
        size = sum(a.itemsize * len(a) for a in arrays)
        return size + sys.getsizeof(self.owner_index) + sys.getsizeof(self.owners)

    @property
    def views(self) -> BlockViews:
        """numpy views of the per-block arrays (made when they last grew)."""
        if self._views is None:
            self.ensure(1)
        assert self._views is not None
        return self._views

    def ensure(self, size: int) -> None:
        """Room for block ids below ``size`` (at least doubling: amortised), and one spare slot
        after them: the arrays' last entry is no block's, so a record's ``HOLE`` (-1) reads
        it as generation 0 and no holder, and a gather needs no mask for holes."""
        have = len(self.holders)
        if size < have:
            return
        extra = max(size + 1 - have, have)
        self._views = None  # a view pins its array's size: none while they grow
        self.holders.frombytes(bytes(4 * extra))
        self.generation.frombytes(bytes(4 * extra))
        self.first_holder.frombytes(array("i", [NOBODY]).tobytes() * extra)
        self._views = BlockViews(
            np.frombuffer(self.holders, np.int32),
            np.frombuffer(self.generation, np.uint32),
            np.frombuffer(self.first_holder, np.int32),
        )

    def as_ids(self, block_ids: Sequence[int]) -> np.ndarray:
        """Block ids as an index array (``id_array``), the arrays large enough for them
        (``fixed``: they are already)."""
        ids = id_array(block_ids)
        if ids.size and not self.fixed:
            top = int(ids.max())
            if top >= len(self.holders) - 1:  # the last slot is the spare
                self.ensure(top + 1)
        return ids

    def bindings(self) -> int:
        """(record, block) pairs held, over every table sharing these states: the holder
        counts of the blocks that have a first holder (``check``'s own reading of them). One
        numpy pass over the pool (about 1.4 ms at 400k blocks here), whatever the number of
        records: the stats' figure, read every few seconds."""
        views = self.views
        return int(np.where(views.first_holder == NOBODY, 0, views.holders).sum(dtype=np.int64))

    def holders_of(self, block_id: int) -> int:
        """How many records hold the block's current content."""
        if not 0 <= block_id < len(self.holders) or self.first_holder[block_id] == NOBODY:
            return 0
        return self.holders[block_id]

    def unbind(self, block_ids: Sequence[int]) -> None:
        """These blocks are being reused for new content: no record holds them any more (their
        counts are left stale: the next hold writes them afresh)."""
        if len(block_ids) <= FEW_BLOCKS:
            self._unbind_few(block_ids)
            return
        ids = self.as_ids(block_ids)  # vLLM's ids: never negative, never repeated in one call
        views = self.views
        # A block no record held since it was last handed out (FREE's, mostly) needs no new
        # generation (no record names its current one), but one costs less than finding it.
        views.generation[ids] = self._next_generation()
        views.first_holder[ids] = NOBODY

    def renew(self, block_ids: np.ndarray) -> int:
        """``unbind`` for blocks a record holds right away (``SessionBlocks.record``'s
        ``handed_from``): only their new generation is written, and returned; the hold writes
        their first holder and count (a new prompt's tail, at the cost of one write per block)."""
        generation = self._next_generation()
        self.views.generation[block_ids] = generation
        return generation

    def _unbind_few(self, block_ids: Sequence[int]) -> None:
        """``unbind`` block by block."""
        first, size = self.first_holder, len(self.first_holder)
        generation = 0
        for block_id in block_ids:
            if 0 <= block_id < size and first[block_id] != NOBODY:
                generation = generation or self._next_generation()
                self.generation[block_id] = generation
                first[block_id] = NOBODY

    def _next_generation(self) -> int:
        """A generation no record names yet (renumbering first when the counter is spent)."""
        if self.epoch >= self.epoch_limit:
            self.renumber()
        self.epoch += 1
        return self.epoch

    def renumber(self) -> None:
        """Restart the generations: every record's entry that still holds its content (the
        block's generation unchanged since it was recorded; not a hole) names generation 1,
        every other entry 0, and every block gets generation 1 (the spare slot keeps 0, which
        a hole reads): which entries hold what is unchanged."""
        if not len(self.generation):
            return
        generation = self.views.generation
        for source in self.record_sources:
            for block_ids, generations in source():
                ids = np.frombuffer(block_ids, np.int32).astype(np.intp)
                recorded = np.frombuffer(generations, np.uint32)
                recorded[:] = (generation[ids] == recorded) & (ids >= 0)
                del ids, recorded  # no view outlives the call: the record may grow
        generation[:-1] = 1
        self.epoch = 1
