"""Pure core: a session record's holds on the pool's blocks, the arithmetic under the session
table (no vLLM import).

``SessionBlocks`` (``sessions.py``) says which records there are and when they change; this base
keeps the per-block counts true to them. Its one invariant, which ``SessionBlocks.check`` tests:
a block's holder count is the number of records whose held prefix names it with its current
generation (a block with no first holder, ``NOBODY``, has a stale count that means nothing).
Holding and letting go come in two forms with the same effect: vectorised over numpy views of
the shared arrays (a prompt's thousands of blocks) and block by block (a decode step's one or
two, where numpy's set-up costs more).
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .block_states import FEW_BLOCKS, GONE, NOBODY, SHARED, BlockStates, BlockViews
from .compaction import owner_of

#: A record index where the request holds no block (vLLM's null block).
HOLE = -1


@dataclass(slots=True)
class SessionRecord:
    """A session's latest request: its blocks (with the generation each had when recorded) and
    how many of them, from the start, the record still holds."""

    request_id: str | None  # None once the request finished (or was preempted)
    block_ids: array[int]
    generations: array[int]
    num_prompt_tokens: int
    held: int = 0
    #: Where the picker's walk starts: the entries from here on held none of the session's
    #: own blocks when it last walked them (a block other sessions held stays shared until
    #: reused, a reused one never comes back; one a side branch of the session also held may
    #: become its own again when the branch lets go, and is then left to LRU's order).
    own_end: int = sys.maxsize


class RecordHolds:
    """The session table's records and their holds on the shared per-block state: the
    primitives ``SessionBlocks`` builds its operations from (every name here is internal)."""

    def __init__(
        self,
        max_sessions: int = 100_000,
        capacity: int = 0,
        dense: bool = False,
        blocks: BlockStates | None = None,
    ) -> None:
        """``dense``: a full-attention group's table, whose records never have a ``HOLE``.
        ``blocks``: the per-block state it shares with other tables (else its own)."""
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.latest: OrderedDict[str, SessionRecord] = OrderedDict()
        self.blocks = blocks or BlockStates(capacity)
        self.blocks.ensure(capacity)
        self.blocks.record_sources.append(self._recorded)
        # the shared arrays themselves (they grow in place), for the block-by-block paths
        self._holders = self.blocks.holders
        self._generation = self.blocks.generation
        self._first_holder = self.blocks.first_holder
        self._max_sessions = max_sessions
        self.evicted = 0
        #: Up to this many blocks, a hold or unbind goes block by block (0: always vectorised).
        self.few = FEW_BLOCKS
        self._dense = dense

    def _recorded(self) -> Iterator[tuple[array[int], array[int]]]:
        """Every record's (block ids, generations), for ``BlockStates.renumber``."""
        for record in self.latest.values():
            yield record.block_ids, record.generations

    def _ensure(self, size: int) -> None:
        self.blocks.ensure(size)

    @property
    def _v(self) -> BlockViews:
        return self.blocks.views

    def _as_ids(self, block_ids: Sequence[int]) -> np.ndarray:
        return self.blocks.as_ids(block_ids)

    def _fitted(self, block_ids: list[int]) -> list[int]:
        """A few block ids as they are, the per-block arrays large enough for them."""
        if block_ids:
            top = max(block_ids)
            if top >= len(self._holders) - 1:  # the last slot is the spare (``ensure``)
                self._ensure(top + 1)
        return block_ids

    def _generations_of(self, ids: np.ndarray) -> np.ndarray:
        """The blocks' generations now (0 at a ``HOLE``: it reads the arrays' spare last slot,
        ``BlockStates.ensure``)."""
        now: np.ndarray = self._v.generation[ids]
        return now

    def _live(self, record: SessionRecord, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The record's ids in ``[start, end)`` (an index array, ``id_array``) and which of
        them still hold the content it recorded."""
        ids = np.frombuffer(record.block_ids, np.int32)[start:end].astype(np.intp)
        recorded = np.frombuffer(record.generations, np.uint32)[start:end]
        if self._dense:
            return ids, self._generations_of(ids) == recorded
        return ids, (ids != HOLE) & (self._generations_of(ids) == recorded)

    def still_recorded(self, session: str) -> np.ndarray | None:
        """Per entry of ``session``'s latest record, whether its block still holds what the
        record recorded (not a hole, not handed out since). A sliding window or a Mamba group
        drops blocks while the request runs, and vLLM hands them out again while the record
        keeps their ids: such an entry says nothing of the session's prompt."""
        record = self.latest.get(session)
        if record is None:
            return None
        return self._live(record, 0, len(record.block_ids))[1]

    def _alone(self, ids: np.ndarray) -> np.ndarray:
        """Which blocks one record alone holds and no other session ever did."""
        holders = self._v.holders[ids]  # a hole reads the spare slot: no holder
        alone: np.ndarray = (holders == 1) & (self._v.first_holder[ids] != SHARED)
        return alone

    def _owner(self, session: str) -> int:
        """The index of ``session``'s owner (a side branch shares its own session's blocks)."""
        owner_index = self.blocks.owner_index
        index = owner_index.get(session)  # a plain session, its own owner: no split
        if index is not None:
            return index
        owner = owner_of(session)
        index = owner_index.get(owner)
        if index is None:
            owners = self.blocks.owners
            if len(owners) >= 2 * self._max_sessions + 1024:
                self._forget_owners()
            index = owner_index[owner] = len(owners)
            owners.append(owner)
        return index

    def _forget_owners(self) -> None:
        """Keep the owner names of the sessions in the table (every table sharing its
        ``BlockStates`` knows the same sessions); blocks first held by the others keep a mark
        that matches no owner (``GONE``: another session held them)."""
        owners, owner_index = self.blocks.owners, self.blocks.owner_index
        keep = list(dict.fromkeys(owner_of(session) for session in self.latest))
        remap = np.full(len(owners), GONE, np.int32)
        for new, owner in enumerate(keep):
            remap[owner_index[owner]] = new
        first = self._v.first_holder
        known = first >= 0
        first[known] = remap[first[known]]
        owners[:] = keep  # in place: shared
        owner_index.clear()
        owner_index.update((owner, i) for i, owner in enumerate(keep))

    def _hold(
        self,
        session: str,
        record: SessionRecord,
        ids: np.ndarray | list[int],
        generations: np.ndarray | None = None,
        fresh_from: int | None = None,
    ) -> None:
        """The record holds ``ids`` after its entries (``generations``: theirs now, if read
        already). ``fresh_from``: from there on they are renewed blocks (``BlockStates.renew``)
        no record holds: their state is written, not read (never a hole)."""
        owner = self._owner(session)
        if isinstance(ids, list):
            self._hold_few(owner, record, ids)
        elif ids.size <= self.few and fresh_from is None:  # a decode step's block: a few
            self._hold_few(owner, record, ids.tolist())  # Python steps beat numpy's set-up
        else:
            views = self._v
            if generations is None:
                generations = views.generation[ids]  # 0 at a hole (``_generations_of``)
            record.block_ids.frombytes(ids.astype(np.int32, copy=False).tobytes())
            record.generations.frombytes(generations.tobytes())
            if fresh_from is not None and fresh_from < ids.size:
                handed = ids[fresh_from:]
                views.holders[handed] = 1
                views.first_holder[handed] = owner
                ids = ids[:fresh_from]
            if ids.size:
                holes = not self._dense and bool(ids.min() < 0)
                self._count_holds(owner, ids[ids != HOLE] if holes else ids)
        record.held = len(record.block_ids)

    def _count_holds(self, owner: int, held: np.ndarray) -> None:
        """One more record (of ``owner``) holds each of the blocks ``held`` (no hole)."""
        views = self._v
        was = views.first_holder[held]
        if (was == NOBODY).all():  # new content, the usual case: no one else held it
            views.holders[held] = 1  # no first holder: no holder (a stale count)
            views.first_holder[held] = owner
        else:
            fresh = was == NOBODY
            views.holders[held[~fresh]] += 1  # a request names a block once
            views.holders[held[fresh]] = 1
            views.first_holder[held[fresh]] = owner
            views.first_holder[held[~fresh & (was != owner)]] = SHARED

    def _hold_few(self, owner: int, record: SessionRecord, ids: list[int]) -> None:
        """``_hold`` block by block."""
        holders, generation, first = self._holders, self._generation, self._first_holder
        for block_id in ids:
            record.block_ids.append(block_id)
            if block_id == HOLE:
                record.generations.append(0)
                continue
            record.generations.append(generation[block_id])
            was = first[block_id]
            if was == NOBODY:  # fresh content: its count is stale
                holders[block_id] = 1
                first[block_id] = owner
                continue
            holders[block_id] += 1
            if was != owner:
                first[block_id] = SHARED

    def _let_go(
        self, record: SessionRecord, first: int, answer: bool = True
    ) -> tuple[list[int], int]:
        """The record stops holding its blocks from index ``first`` on; returns (``answer``) the
        blocks no record holds any more and no other session has held, and how many are kept
        for others."""
        if record.held - first <= self.few:  # mostly the old record's last block or two
            return self._let_go_few(record, first, answer)
        released: list[int] = []
        kept = 0
        if first < record.held:
            ids, live = self._live(record, first, record.held)
            held = ids[live]  # not a hole, not reused since: this record holds their content
            if held.size:
                holders = self._v.holders
                counts = holders[held] - 1
                holders[held] = counts
                if not answer:
                    record.held = min(record.held, first)
                    return released, kept
                dead = (counts == 0) & (self._v.first_holder[held] != SHARED)  # no one, ever
                released = held[dead].tolist()
                kept = int(held.size) - len(released)
        record.held = min(record.held, first)
        return released, kept

    def _let_go_few(self, record: SessionRecord, first: int, answer: bool) -> tuple[list[int], int]:
        """``_let_go`` block by block."""
        released: list[int] = []
        kept = 0
        holders, generation, first_holder = self._holders, self._generation, self._first_holder
        block_ids, generations = record.block_ids, record.generations
        for index in range(first, record.held):
            block_id = block_ids[index]
            if block_id == HOLE or generation[block_id] != generations[index]:
                continue  # no block there, or reused since: the record holds nothing there
            holders[block_id] -= 1
            if not answer:
                continue
            if holders[block_id] or first_holder[block_id] == SHARED:
                kept += 1
            else:
                released.append(block_id)
        record.held = min(record.held, first)
        return released, kept
