"""The predicted-return picker (``ReturnPicker``): which blocks a pop of the queue takes when
the sessions due back last hold blocks of their own.

The queue asks it once per pop (``core/queue.py``' ``Picker``); its work per pop is bounded
(``_VICTIM_CHUNK`` victims read at a time, ``_CANDIDATE_CHUNKS`` chunks of records at most).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .bindings import OverBindings

#: LRU victims the picker reads at a time (all a pop takes, mostly): who holds a block is asked
#: of a chunk at once, at about the same cost for 1,024 as for 64.
_VICTIM_CHUNK = 1024
#: Up to this many victims, who holds them is asked block by block: Python's steps beat numpy's
#: set-up (about 2 against 5 µs for 24 blocks no session alone holds; even at about 150).
_FEW_VICTIMS = 128
#: The fewest record entries of a candidate the picker reads at a time (of up to 1,024).
_FEWEST_ENTRIES = 64
#: Record chunks the picker reads per pop at most (of up to 1,024 entries each).
_CANDIDATE_CHUNKS = 16
#: Pops of fewer live blocks take LRU's order. A decoding request's next block is a pop of
#: one: at full size most picks, each ~150 µs (a walk of the candidates' records) for one
#: block, 4,367 of 5,317 picks choosing 0.75% of the blocks picks chose (the study-sized
#: trace on the 8B H100 pool, first 500 calls: benchmarks.engine.trace_engine).
_FEWEST_TAKE = 2


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading entries the two lists share (compared a slice at a time, in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Picks:
    """A pick's answer as it grows (the queue's ``Picker`` answer): LRU's own victims while
    they come in its order, counted and never listed (a pop mostly takes LRU's order whole),
    then, from the first block taken ahead of its turn, every block listed."""

    __slots__ = ("_blocks", "_in_order", "chosen", "count", "lru", "taken")

    def __init__(self, blocks: Sequence[Any]) -> None:
        self._blocks = blocks
        self._in_order: list[list[int]] = []  # LRU's victims counted in ``lru``, in runs
        self.lru = 0
        self.chosen: list[Any] = []
        self.count = 0
        #: The ids picked, kept from the first block taken ahead of its turn on.
        self.taken: set[int] | None = None

    def has(self, block_id: int) -> bool:
        return self.taken is not None and block_id in self.taken

    def in_order(self, ids: list[int]) -> None:
        """LRU's next victims (those picked already, as candidates, are skipped)."""
        if self.taken is None:
            self._in_order.append(ids)
            self.lru += len(ids)
            self.count += len(ids)
            return
        if not self.taken.isdisjoint(ids):
            ids = [b for b in ids if b not in self.taken]
        self.chosen.extend(map(self._blocks.__getitem__, ids))
        self.taken.update(ids)
        self.count += len(ids)

    def ahead(self, ids: list[int], victim_id: int) -> int:
        """Candidates taken ahead of LRU's next victim ``victim_id`` (which may end them);
        how many were new."""
        if self.taken is None:
            if ids == [victim_id]:  # the victim itself: still LRU's order
                self.in_order(ids)
                return 1
            self.taken = {b for run in self._in_order for b in run}
        before = self.count
        self.in_order(ids)
        return self.count - before


class ReturnPicker(OverBindings):
    """The queue's picker while the predicted-return picker is on (``ctx.returns`` set)."""

    def pick(self, take: int) -> tuple[int, list[Any]]:
        """The queue's picker (``core/returns.py``), once per pop, for its ``take`` live blocks:
        LRU's victims in order, except that where one is a block a single session alone holds,
        the deepest own live blocks of the sessions predicted back last go first, as long as
        each is due back no sooner than the victim's session (``swap_for``). Answered as the
        queue's ``Picker`` asks: LRU's own first victims counted, the rest listed (``_Picks``).

        The candidates come due-ordered (latest first), so the ones that go before a victim
        are a run from the head of what is left: taken a run at a time, not asked block by
        block. Where LRU's next victims are the head run's next candidates themselves (vLLM
        frees a request's blocks tail first, the order the run has), they are taken at once,
        without asking who holds them; victims no session alone holds (no swap) go a run at a
        time up to the next one a session holds."""
        assert self._ctx.returns is not None
        if take < _FEWEST_TAKE:
            return take, []
        states = self._bindings.raw_states  # as it stands: a block handed out is no queued victim
        if self.queue.normal_lru_unheld(take, states.holders, states.first_holder) == take:
            return take, []  # most pops: no victim a single record holds, found in one walk
        # LRU's victims read so far, a chunk at a time (never more than the pop takes)
        ids = self.queue.normal_lru_ids(None, min(_VICTIM_CHUNK, take))
        read = len(ids)
        positions, dues = self._dues_of(ids)  # the chunk's, by position
        if not positions and read == take:  # held alone by sessions not due back (``inf``)
            return take, []
        inf = float("inf")
        picks = _Picks(self.pool.blocks)
        runs: Iterator[tuple[float, list[int]]] | None = None
        run: list[int] = []  # the head run of candidates (one session's, due ``run_due``)
        run_due, at, exhausted = inf, 0, False
        swapped = 0
        held = iter(positions)  # where a session alone holds the block, in order
        next_held = next(held, len(ids))
        i = 0
        while picks.count < take:
            if i == len(ids):
                size = min(_VICTIM_CHUNK, take - read)
                after = self.pool.blocks[ids[-1]] if ids else None
                ids = self.queue.normal_lru_ids(after, size)
                if not ids:
                    break
                read += len(ids)
                positions, dues = self._dues_of(ids)
                held = iter(positions)
                next_held = next(held, len(ids))
                i = 0
            victim_id = ids[i]
            if at < len(run) and run[at] == victim_id:
                # in step: each would be taken as the run's next candidate up to itself
                most = min(len(ids) - i, take - picks.count)
                step = _common_prefix(ids[i : i + most], run[at : at + most])
                picks.in_order(ids[i : i + step])
                i += step
                at += step
                continue
            while next_held < i:
                next_held = next(held, len(ids))
            if next_held > i:
                # LRU's own victims up to the next one a session alone holds: no swap
                end = min(next_held, i + take - picks.count)
                picks.in_order(ids[i:end])
                i = end
                continue
            due = dues[i]
            i += 1
            if picks.has(victim_id):
                continue  # taken already, as a candidate
            reached = False  # the victim itself taken, as the run's candidate
            # gone or not known (``inf``): no swap (``swap_for``), no stream
            while due != inf and not exhausted and picks.count < take:
                if run_due < due:  # ``swap_for`` of a finite due: the candidates are back sooner
                    break
                if at == len(run):  # a session's due comes before its record is read
                    if runs is None:
                        runs = self._candidate_runs(take)
                    head = next(runs, None)
                    exhausted = head is None
                    run_due, run = head or (inf, [])
                    at = 0
                    continue
                # the run's next candidates, up to the victim itself (then it is taken)
                room = take - picks.count
                while at < len(run) and room and not reached:
                    part = run[at : at + room]
                    if victim_id in part:
                        part = part[: part.index(victim_id) + 1]
                        reached = True
                    at += len(part)
                    new = picks.ahead(part, victim_id)
                    room -= new
                    swapped += new - reached
                if reached:
                    break
            if picks.count < take and not reached:
                picks.in_order([victim_id])
        if swapped:
            self.counters.add("blocks_predicted", swapped)
        return picks.lru, picks.chosen

    def _dues_of(self, block_ids: list[int]) -> tuple[list[int], list[float] | dict[int, float]]:
        """The positions, ascending, of the blocks a session alone holds and is due back from
        (a due: the others, ``inf``, take no swap, as if held by none), and the due by position.
        Who holds a block is the pool's ``BlockStates``: every group's table answers alike."""
        assert self._ctx.returns is not None
        table, due_of, inf = self.tables[0], self._ctx.returns.due, float("inf")
        if len(block_ids) <= _FEW_VICTIMS:  # most pops: block by block
            found: dict[int, float] = {}
            by_owner: dict[int, float] = {}  # victims come in runs of one session's blocks
            holders, first = table.blocks.holders, table.blocks.first_holder
            for at, block_id in enumerate(block_ids):  # ``sole_holder``, inlined
                if holders[block_id] == 1:
                    owner = first[block_id]
                    if owner >= 0:
                        due = by_owner.get(owner)
                        if due is None:
                            due = by_owner[owner] = due_of(table.blocks.owners[owner])
                        found[at] = due
            return [at for at, due in found.items() if due != inf], found
        held = table.sole_holders(block_ids)
        if not held:  # mostly, once a 16k-token pool is full
            return [], {}
        dues = np.full(len(block_ids), inf)
        for owner, positions in held.items():
            dues[positions] = due_of(owner)
        return np.flatnonzero(dues != inf).tolist(), dues.tolist()

    def _candidate_runs(self, take: int) -> Iterator[tuple[float, list[int]]]:
        """(due, block ids): the candidates' own queued NORMAL blocks, the session due back
        last first (each announced by its due and no blocks, before its record is read; one
        running or with nothing left to read is passed over), each
        session's tail first (every group), a run at a time. Bounded work per
        pop, whatever the sessions hold: at most ``_CANDIDATE_CHUNKS`` chunks of records are
        read (sessions whose blocks are idle, shared or in use offer none), then LRU's order
        decides the rest."""
        assert self._ctx.returns is not None
        blocks = self.pool.blocks
        chunk = min(max(_FEWEST_ENTRIES, take), 1024)
        reads = _CANDIDATE_CHUNKS
        tables = self.tables
        for session in self._ctx.returns.back_last_first():
            if not any(table.walkable(session) for table in tables):
                # running, or nothing left to walk (mostly the sessions that called last):
                # its due need not come first either, as the next one's is no later
                continue
            due = self._ctx.returns.due(session)
            yield due, []  # its due first: a pick that goes no further reads no record
            for table in tables:
                for batch in table.own_tail_chunks(session, chunk):
                    # a run of at most ``take`` at a time: a pop mostly takes a few of them
                    run, at, in_use = self.queue.normal_until_in_use(batch, blocks, 0, take)
                    while run:
                        yield due, run
                        if at == len(batch) or in_use:
                            break
                        run, at, in_use = self.queue.normal_until_in_use(batch, blocks, at, take)
                    reads -= 1
                    if not reads:
                        self.counters.add("picker_reads_capped", 1)
                        return
                    if in_use:
                        # a running request hit the record up to here, and prefix hits are
                        # prefix-closed, so every block before it is in use too (the session
                        # allocating now: it called last, so it is walked first)
                        break
