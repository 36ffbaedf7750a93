"""Pure core: which sessions hold which KV blocks, in bounded memory (no vLLM import).

Each tracked session has one record: the block ids of its latest request, in token order (prompt
blocks, generated-token blocks and the partial tail alike), with that request's prompt length.
The record *holds* its blocks while they keep the content they had: a block reused for new
content gets a new generation, and records that name it with the old one no longer hold it.

Per block only a count of holding records is kept, so a prefix shared by many sessions costs one
counter, not one entry per session: memory is O(blocks) for the counters plus 8 bytes per block
of the latest request per tracked session, and the table keeps at most ``max_sessions`` sessions
(least recently recorded first out; a session that leaves stops holding its blocks).

A release by session S from block index b: S's record stops holding its blocks from b on (what
a record holds is always a prefix of it); a block no other record holds is returned for release,
one still held by another session is kept (``kept_shared``).

Shared across time: a block whose current content more than one session has held (a session's
side branch, ``core/compaction.py``, counts as the session itself) (at once or
one after the other: a subagent's system prompt that the next subagent hit) is never returned
for release or idling, even when no record holds it any more. A session's release says its own
context is dead; content other sessions have used is not its to declare dead, and the queue's LRU
order decides for it. The mark lasts until the block is reused for new content.

Holes: a record is positional (index i covers the same tokens in every request of its KV-cache
group), and vLLM leaves a null block where a request holds none (a sliding window's blocks
before the window, the Mamba states it keeps no copy of). Those indices are ``HOLE`` in the
record and hold nothing. A block that a *running* request's table drops for a null one (it left
the sliding window, or a newer Mamba state retired it) is freed early by vLLM with its hash: it
stays the session's in the record, since a later prompt can still hit it.

The parts: this module is the table's operations (record, release, idle, the picker's walk,
check); ``record_holds.py`` keeps the per-block counts true to the records.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .block_states import FEW_BLOCKS, NOBODY, SHARED, id_array
from .record_holds import HOLE, RecordHolds, SessionRecord

__all__ = ["FEW_BLOCKS", "HOLE", "ReleaseSelection", "SessionBlocks", "SessionRecord"]

#: ``running``: an idle selection of a session whose request runs (nothing selected).
SelectionStatus = Literal["ok", "unknown_session", "record_mismatch", "running"]


@dataclass(frozen=True, slots=True)
class ReleaseSelection:
    """Outcome of a release (or idle) request on the session table."""

    block_ids: list[int] = field(default_factory=list)  # nobody else holds them: release
    kept_shared: int = 0  # still held by another session
    status: SelectionStatus = "ok"


class SessionBlocks(RecordHolds):
    """Bounded session → latest-request blocks table with a holder count per block.

    The per-block state lives in flat arrays indexed by block id (``block_states.py``), so a
    request's blocks are held, let go and checked in a few vectorised steps (numpy views of the
    arrays) rather than a Python step per block: at GPU scale a request brings thousands. The
    tables of a model's KV-cache groups share one ``BlockStates`` (a block serves one group at
    a time): a reused block is let go of once for all of them."""

    def __len__(self) -> int:
        return len(self.latest)

    @property
    def bindings(self) -> int:
        """(session, block) pairs this table's records hold (counted when asked, not kept up on
        the scheduler's path)."""
        return sum(int(self._live(r, 0, r.held)[1].sum()) for r in self.latest.values())

    def holders(self, block_id: int) -> int:
        return self.blocks.holders_of(block_id)

    @property
    def block_state_bytes(self) -> int:
        """What the per-block arrays and the owner names take (shared with other tables over
        the same ``BlockStates``)."""
        return self.blocks.nbytes

    def record(
        self,
        session: str,
        block_ids: Sequence[int],
        num_prompt_tokens: int,
        request_id: str = "",
        handed_from: int | None = None,
    ) -> None:
        """The session's latest request (``request_id``) now holds exactly ``block_ids``. A
        request that only grew since it was last recorded (still running: none of its blocks can
        have been reused) costs only its new blocks. ``HOLE`` marks an index without a block;
        where the same running request held one there before, the record keeps it (see the
        module's docstring).

        ``handed_from``: the entries from there on are blocks the pool has just handed out for
        new content, not unbound yet (a new prompt's blocks after its hit): unbound and held
        here, as ``unbind`` then ``record`` would, without reading what they held before."""
        ids = self._as_ids(block_ids)
        fresh = len(ids) if handed_from is None else handed_from
        if fresh < len(ids):
            self.blocks.renew(ids[fresh:])
        old = self.latest.get(session)
        running = old is not None and old.request_id is not None and old.request_id == request_id
        if running and not self._dense and (ids == HOLE).any():
            assert old is not None
            ids = self._kept_where_dropped(old, ids)
        if (
            running
            and old is not None
            and old.held == len(old.block_ids)
            and fresh >= old.held
            and np.array_equal(np.frombuffer(old.block_ids, np.int32), ids[: old.held])
        ):
            self._hold(session, old, ids[old.held :], fresh_from=fresh - old.held)
            old.num_prompt_tokens = num_prompt_tokens
            self.latest.move_to_end(session)
            return
        if old is None:
            new = SessionRecord(request_id, array("i"), array("I"), num_prompt_tokens)
            self._hold(session, new, ids, fresh_from=fresh)
            self.latest[session] = new
            while len(self.latest) > self._max_sessions:
                _, evicted = self.latest.popitem(last=False)
                self._let_go(evicted, 0, answer=False)
                self.evicted += 1
            return
        # the session's record becomes the new request's, in place: the prefix it shares with
        # the last one stays as it is (counts unchanged), the rest is let go of, then the new
        # blocks held (in either order a block in both ends with the same count)
        now = self._generations_of(ids)  # for the comparison and the hold alike
        if self._dense:
            kept = self._carried_over(old, ids, now, fresh)
            self._let_go(old, kept, answer=False)
            del old.block_ids[kept:], old.generations[kept:]
            self._hold(session, old, ids[kept:], now[kept:], fresh_from=fresh - kept)
        else:
            self._replace_by_index(session, old, ids, now, fresh)
        old.request_id, old.num_prompt_tokens, old.own_end = (
            request_id, num_prompt_tokens, sys.maxsize,
        )  # fmt: skip
        self.latest.move_to_end(session)

    def _replace_by_index(
        self, session: str, old: SessionRecord, ids: np.ndarray, now: np.ndarray, fresh: int
    ) -> None:
        """``record``'s replacement in a table with holes, index by index rather than by prefix:
        a sliding window moves on, so the new request has holes where the old one's window
        began, and after them the blocks of the old window it still covers, which the record
        holds as they are (not let go of and held again). ``now``: the generations of ``ids``;
        from ``fresh`` on, renewed blocks."""
        views = self._v
        held = old.held
        common = min(held, fresh)
        before = np.frombuffer(old.block_ids, np.int32)[:held].astype(np.intp)
        recorded = np.frombuffer(old.generations, np.uint32)[:held]
        # the same block with the same content at an index (or a hole in both): unchanged
        same = (before[:common] == ids[:common]) & (recorded[:common] == now[:common])
        live = (before != HOLE) & (views.generation[before] == recorded)
        live[:common] &= ~same
        gone = before[live]
        if gone.size:
            views.holders[gone] -= 1
        old.block_ids, old.generations = array("i"), array("I")
        old.block_ids.frombytes(ids.astype(np.int32).tobytes())
        old.generations.frombytes(now.tobytes())
        old.held = len(ids)
        owner = self._owner(session)
        new = ids[:fresh] != HOLE
        new[:common] &= ~same
        if new.any():
            self._count_holds(owner, ids[:fresh][new])
        if fresh < len(ids):
            handed = ids[fresh:]
            views.holders[handed] = 1
            views.first_holder[handed] = owner

    def _carried_over(
        self, old: SessionRecord, ids: np.ndarray, now: np.ndarray, fresh: int
    ) -> int:
        """How many leading entries of ``old`` the new record holds as they are: the same block
        at each index, its content unchanged since ``old`` recorded it (``now``: the
        generations of ``ids``; none from ``fresh`` on, new content). A session's next request
        mostly starts with its last one's blocks: found by comparing arrays, not by letting go
        of and holding again every block."""
        n = min(old.held, fresh)
        if n == 0 or old.block_ids[0] != ids[0]:
            return 0
        # the first index whose block differs (never 0: the first ids agree), then the first
        # before it whose content does
        differ = np.frombuffer(old.block_ids, np.int32)[:n] != ids[:n]
        first = int(differ.argmax())
        if differ[first]:
            n = first
        differ = np.frombuffer(old.generations, np.uint32)[:n] != now[:n]
        first = int(differ.argmax())
        return first if differ[first] else n

    def grow(
        self,
        session: str,
        request_id: str,
        held: int,
        new_ids: Sequence[int],
        prompt: int,
        handed: bool = False,
    ) -> bool:
        """The running request ``request_id``, recorded with ``held`` blocks, got ``new_ids``
        after them: recorded at the cost of the new blocks alone. Earlier entries are kept as
        they are: a running request's earlier blocks only ever drop out of a sliding window,
        where the record keeps them anyway (see ``record``). False (nothing changes) when the
        session's latest record is not that request's, as recorded: call ``record``.
        ``handed``: ``new_ids`` were just handed out, not unbound yet (``record``'s
        ``handed_from``): unbound and held here, if True is returned."""
        old = self.latest.get(session)
        if (
            old is None
            or old.request_id is None
            or old.request_id != request_id
            or old.held != held
            or len(old.block_ids) != held
        ):
            return False
        if handed:
            ids = self._as_ids(new_ids)
            self.blocks.renew(ids)
            self._hold(session, old, ids, fresh_from=0)
        elif isinstance(new_ids, list) and len(new_ids) <= self.few:
            self._hold(session, old, self._fitted(new_ids))
        else:
            self._hold(session, old, self._as_ids(new_ids))
        old.num_prompt_tokens = prompt
        self.latest.move_to_end(session)
        return True

    def _kept_where_dropped(self, old: SessionRecord, ids: np.ndarray) -> np.ndarray:
        """``ids`` with each hole the running request had a block at (still unreused) filled
        with that block."""
        merged = ids.copy()
        n = min(old.held, len(merged))
        before = np.frombuffer(old.block_ids, np.int32)[:n].astype(np.intp)
        dropped = (merged[:n] == HOLE) & (before != HOLE)
        dropped &= self._generations_of(before) == np.frombuffer(old.generations, np.uint32)[:n]
        merged[:n][dropped] = before[dropped]
        return merged

    def request_finished(self, session: str, request_id: str) -> None:
        """The request freed its blocks (finished, aborted or preempted): they may be reused, so
        a later record under the same id (a preempted request resuming) starts afresh."""
        record = self.latest.get(session)
        if record is not None and record.request_id == request_id:
            record.request_id = None

    def move(self, session: str, to: str) -> bool:
        """``session``'s finished latest record becomes ``to``'s (whose own record is let go),
        holding the same blocks; False (nothing changes) when there is none or it runs."""
        record = self.latest.get(session)
        if record is None or record.request_id is not None:
            return False
        self.forget(to)
        self.latest[to] = self.latest.pop(session)
        return True

    def forget(self, session: str) -> None:
        """The session leaves the table: it holds nothing any more."""
        record = self.latest.pop(session, None)
        if record is not None:
            self._let_go(record, 0, answer=False)

    def unbind(self, block_ids: Sequence[int]) -> None:
        """These blocks are being reused for new content: no record holds them any more (in
        any table sharing this one's ``BlockStates``)."""
        self.blocks.unbind(block_ids)

    def sole_holder(self, block_id: int) -> str | None:
        """The session whose record alone holds the block's content and no other session
        ever held (side branches count as their session); ``None`` otherwise."""
        if block_id >= len(self._holders) or self._holders[block_id] != 1:
            return None
        first = self._first_holder[block_id]  # none (a stale count), shared or gone: < 0
        return None if first < 0 else self.blocks.owners[first]

    def sole_holders(self, block_ids: Sequence[int]) -> dict[str, np.ndarray]:
        """By session (owner), the positions in ``block_ids`` of the blocks it alone holds
        (``sole_holder``), ascending: a picker's victims are mostly held by none, or by a few
        sessions each holding a run of them."""
        ids = id_array(block_ids)
        size = len(self._holders)
        beyond = None
        if ids.size and int(ids.max()) >= size:  # beyond the arrays: held by nobody
            beyond = ids >= size
            ids = np.where(beyond, 0, ids)
        sole = self._v.holders[ids] == 1
        if beyond is not None:
            sole &= ~beyond
        if not sole.any():  # mostly: a picker's victims are let go of, or shared
            return {}
        first = self._v.first_holder[ids]
        sole &= first >= 0  # not shared, gone, or a stale count of a reused block
        positions = np.flatnonzero(sole)
        if not positions.size:
            return {}
        indices = first[positions]
        low, high = int(indices.min()), int(indices.max())
        owners = self.blocks.owners
        if low == high:  # one session holds them all
            return {owners[low]: positions}
        return {owners[index]: positions[indices == index] for index in set(indices.tolist())}

    def is_shared(self, block_id: int) -> bool:
        """Whether more than one session has held the block's current content."""
        return 0 <= block_id < len(self._first_holder) and self._first_holder[block_id] == SHARED

    def select_release(self, session: str, first_block: int) -> ReleaseSelection:
        """Blocks to release for ``session`` from block index ``first_block`` of its latest
        request."""
        record = self.latest.get(session)
        if record is None:
            return ReleaseSelection(status="unknown_session")
        released, kept = self._let_go(record, first_block)
        return ReleaseSelection(released, kept)

    def select_idle(self, session: str, first_block: int = 0) -> ReleaseSelection:
        """The blocks of ``session``'s latest request, from block index ``first_block`` on, that
        it alone holds, tail first (the order LRU gives them up in): the ones to reuse early
        while it waits on its user. Unlike a release, the session keeps holding them. Status
        ``running`` while its request runs."""
        record = self.latest.get(session)
        if record is None:
            return ReleaseSelection(status="unknown_session")
        if record.request_id is not None:
            return ReleaseSelection(status="running")
        ids, live = self._live(record, min(first_block, record.held), record.held)
        alone = self._alone(ids)
        own = ids[live & alone][::-1].tolist()
        return ReleaseSelection(own, int((live & ~alone).sum()))

    def walkable(self, session: str) -> bool:
        """Whether ``own_tail_chunks`` has entries to read for ``session`` (a finished request's
        record, with entries below where its last walk found none of its own)."""
        record = self.latest.get(session)
        return record is not None and record.request_id is None and record.own_end > 0 < record.held

    def own_tail_chunks(self, session: str, chunk: int = 256) -> Iterator[list[int]]:
        """``select_idle``'s blocks, lazily, a list per ``chunk`` entries of the record read
        (empty where they hold none of its own): a caller that needs the first few of a long
        record (the predicted-return picker) reads only those."""
        if not self.walkable(session):
            return
        record = self.latest[session]
        end = min(record.held, record.own_end)
        tail = True  # no own block found yet from the end
        while end > 0:
            start = max(0, end - chunk)
            part, live = self._live(record, start, end)
            if end == record.held and not live[-1]:
                # a tail that holds nothing any more (reused: never again) is cut off: the
                # picker walks it once per pop; the chunks start again at the new tail
                alive = np.flatnonzero(live)
                end = record.held = start + int(alive[-1]) + 1 if alive.size else start
                continue
            part = part[live]
            own = part[self._alone(part)]
            batch = own[::-1].tolist()
            del part, live, own  # no view of the record outlives a step: the record may grow
            tail = tail and not batch
            if tail:
                record.own_end = start  # the next walk starts below
            end = start
            yield batch  # empty too: the caller counts what it read

    def unchanged(self, session: str) -> bool:
        """Whether every block of ``session``'s latest request (holes aside) still holds the
        content it recorded: then its hashes are the ones its request cached."""
        record = self.latest.get(session)
        if record is None:
            return False
        ids, live = self._live(record, 0, len(record.block_ids))
        return bool(live[ids != HOLE].all())

    def unreused(self, session: str, first_block: int) -> list[int]:
        """The blocks of ``session``'s latest request from ``first_block`` on that still hold the
        content it recorded (not reused since), released or not."""
        record = self.latest.get(session)
        if record is None:
            return []
        ids, live = self._live(record, first_block, len(record.block_ids))
        return list(ids[live].tolist())

    def check(self, sharing: Sequence[SessionBlocks] = ()) -> list[str]:
        """Invariant violations (empty when consistent): every holder count equals the number
        of records holding the block's current content, in this table and the ``sharing``
        tables over the same ``BlockStates`` (whose records count too)."""
        counts = np.zeros(len(self._holders), np.int64)
        for table in (self, *sharing):
            if table.blocks is not self.blocks:
                raise ValueError("check: a table that shares no block state with this one")
            for record in table.latest.values():
                ids, live = table._live(record, 0, record.held)
                np.add.at(counts, ids[live], 1)
        # a block no record held since it was reused has no first holder and a stale count
        holders = np.where(self._v.first_holder == NOBODY, 0, self._v.holders)
        problems = [
            f"block {b}: {holders[b]} holders counted, {counts[b]} records"
            for b in np.flatnonzero(counts != holders).tolist()
        ]
        for table in (self, *sharing):
            if len(table.latest) > table._max_sessions:
                problems.append(
                    f"{len(table.latest)} sessions over the limit {table._max_sessions}"
                )
        return problems
