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
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Literal

from .compaction import owner_of

#: ``running``: an idle selection of a session whose request runs (nothing selected).
SelectionStatus = Literal["ok", "unknown_session", "record_mismatch", "running"]

#: A record index where the request holds no block (vLLM's null block).
HOLE = -1


def _common_prefix(a: array[int], b: array[int], n: int, chunk: int = 256) -> int:
    """The length of the longest common prefix of ``a[:n]`` and ``b[:n]``: slices compared in C,
    a Python step per element only inside the first chunk that differs."""
    start = 0
    while start < n:
        end = min(start + chunk, n)
        if a[start:end] != b[start:end]:
            while a[start] == b[start]:
                start += 1
            return start
        start = end
    return n


@dataclass(slots=True)
class SessionRecord:
    """A session's latest request: its blocks (with the generation each had when recorded) and
    how many of them, from the start, the record still holds."""

    request_id: str | None  # None once the request finished (or was preempted)
    block_ids: array[int]
    generations: array[int]
    num_prompt_tokens: int
    held: int = 0


@dataclass(frozen=True, slots=True)
class ReleaseSelection:
    """Outcome of a release (or idle) request on the session table."""

    block_ids: list[int] = field(default_factory=list)  # nobody else holds them: release
    kept_shared: int = 0  # still held by another session
    status: SelectionStatus = "ok"


class SessionBlocks:
    """Bounded session → latest-request blocks table with a holder count per block."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.latest: OrderedDict[str, SessionRecord] = OrderedDict()
        self._holders: dict[int, int] = {}  # block id → records holding its current content
        self._generation: dict[int, int] = {}  # block id → times reused for new content
        self._first_holder: dict[int, str] = {}  # block id → first session to hold its content
        self._shared: set[int] = set()  # blocks whose content a second session has held
        self._max_sessions = max_sessions
        self.bindings = 0  # (session, block) pairs held: the sum of the holder counts
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.latest)

    def holders(self, block_id: int) -> int:
        return self._holders.get(block_id, 0)

    def record(
        self, session: str, block_ids: Sequence[int], num_prompt_tokens: int, request_id: str = ""
    ) -> None:
        """The session's latest request (``request_id``) now holds exactly ``block_ids``. A
        request that only grew since it was last recorded (still running: none of its blocks can
        have been reused) costs only its new blocks. ``HOLE`` marks an index without a block;
        where the same running request held one there before, the record keeps it (see the
        module's docstring)."""
        old = self.latest.get(session)
        if (
            old is not None
            and old.request_id is not None
            and old.request_id == request_id
            and HOLE in block_ids  # a full-attention table never has one: no Python loop
        ):
            block_ids = self._kept_where_dropped(old, block_ids)
        if (
            old is not None
            and old.request_id is not None
            and old.request_id == request_id
            and old.held == len(old.block_ids)
            and len(block_ids) >= old.held
            and old.block_ids == array("i", block_ids[: old.held])
        ):
            self._hold(session, old, block_ids[old.held :])
            old.num_prompt_tokens = num_prompt_tokens
            self.latest.move_to_end(session)
            return
        new = SessionRecord(request_id, array("i"), array("I"), num_prompt_tokens)
        kept = 0 if old is None else self._carried_over(old, block_ids)
        if old is not None and kept:  # the shared prefix moves over as it is (counts unchanged)
            new.block_ids, new.generations = old.block_ids[:kept], old.generations[:kept]
        self._hold(session, new, block_ids[kept:])
        if old is not None:
            self._let_go(old, kept)
        self.latest[session] = new
        self.latest.move_to_end(session)
        while len(self.latest) > self._max_sessions:
            _, evicted = self.latest.popitem(last=False)
            self._let_go(evicted, 0)
            self.evicted += 1

    def _carried_over(self, old: SessionRecord, block_ids: Sequence[int]) -> int:
        """How many leading entries of ``old`` the new record holds as they are: the same block
        at each index, its content unchanged since ``old`` recorded it. A session's next
        request mostly starts with its last one's blocks: found by comparing arrays (C loops),
        not by letting go of and holding again every block in Python."""
        n = min(old.held, len(block_ids))
        if n == 0:
            return 0
        ids = array("i", block_ids[:n])
        same = _common_prefix(old.block_ids, ids, n)
        if same == 0:
            return 0
        now = array("I", map(self._generation.get, ids[:same], repeat(0)))
        return _common_prefix(old.generations, now, same)

    def grow(
        self, session: str, request_id: str, held: int, new_ids: Sequence[int], prompt: int
    ) -> bool:
        """The running request ``request_id``, recorded with ``held`` blocks, got ``new_ids``
        after them: recorded at the cost of the new blocks alone. Earlier entries are kept as
        they are: a running request's earlier blocks only ever drop out of a sliding window,
        where the record keeps them anyway (see ``record``). False (nothing changes) when the
        session's latest record is not that request's, as recorded: call ``record``."""
        old = self.latest.get(session)
        if (
            old is None
            or old.request_id is None
            or old.request_id != request_id
            or old.held != held
            or len(old.block_ids) != held
        ):
            return False
        self._hold(session, old, new_ids)
        old.num_prompt_tokens = prompt
        self.latest.move_to_end(session)
        return True

    def _kept_where_dropped(self, old: SessionRecord, block_ids: Sequence[int]) -> list[int]:
        """``block_ids`` with each hole the running request had a block at (still unreused)
        filled with that block."""
        merged = list(block_ids)
        generation = self._generation
        for i in range(min(old.held, len(merged))):
            kept = old.block_ids[i]
            if merged[i] == HOLE and kept != HOLE and generation.get(kept, 0) == old.generations[i]:
                merged[i] = kept
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
            self._let_go(record, 0)

    def unbind(self, block_ids: Iterable[int]) -> None:
        """These blocks are being reused for new content: no record holds them any more."""
        # Only a block whose current content some record held (``_first_holder``: set by every
        # hold, dropped only here) can have a record entry still valid: the others' entries are
        # stale already, and a fresh block from vLLM's free list costs one set operation.
        first_holder = self._first_holder
        touched = first_holder.keys() & block_ids if first_holder else ()
        if not touched:
            return
        generation, holders = self._generation, self._holders
        for block_id in touched:
            generation[block_id] = generation.get(block_id, 0) + 1
            self.bindings -= holders.pop(block_id, 0)
            del first_holder[block_id]
        self._shared.difference_update(touched)

    def sole_holder(self, block_id: int) -> str | None:
        """The session whose record alone holds the block's content and no other session
        ever held (side branches count as their session); ``None`` otherwise."""
        if self._holders.get(block_id, 0) != 1 or block_id in self._shared:
            return None
        return self._first_holder.get(block_id)

    def is_shared(self, block_id: int) -> bool:
        """Whether more than one session has held the block's current content."""
        return block_id in self._shared

    def select_release(self, session: str, first_block: int) -> ReleaseSelection:
        """Blocks to release for ``session`` from block index ``first_block`` of its latest
        request."""
        record = self.latest.get(session)
        if record is None:
            return ReleaseSelection(status="unknown_session")
        released, kept = self._let_go(record, first_block)
        return ReleaseSelection(released, kept)

    def select_idle(self, session: str) -> ReleaseSelection:
        """The blocks of ``session``'s latest request that it alone holds, tail first (the order
        LRU gives them up in): the ones to reuse early while it waits on its user. Unlike a
        release, the session keeps holding them. Status ``running`` while its request runs."""
        record = self.latest.get(session)
        if record is None:
            return ReleaseSelection(status="unknown_session")
        if record.request_id is not None:
            return ReleaseSelection(status="running")
        own: list[int] = []
        shared = 0
        for block_id, alone in self._tail_first(record):
            if alone:
                own.append(block_id)
            else:
                shared += 1
        return ReleaseSelection(own, shared)

    def own_tail_first(self, session: str) -> Iterator[int]:
        """``select_idle``'s blocks, lazily: a caller that needs the first few of a long record
        (the predicted-return picker) reads only those."""
        record = self.latest.get(session)
        if record is not None and record.request_id is None:
            yield from (block_id for block_id, alone in self._tail_first(record) if alone)

    def _tail_first(self, record: SessionRecord) -> Iterator[tuple[int, bool]]:
        """The record's blocks still holding its content, tail first, each with whether the
        record alone holds it and no other session ever did."""
        holders, generation, shared_blocks = self._holders, self._generation, self._shared
        ids, generations = record.block_ids, record.generations
        held = record.held
        while held and (
            ids[held - 1] == HOLE or generation.get(ids[held - 1], 0) != generations[held - 1]
        ):
            held -= 1  # a tail that holds nothing any more (reused: never again) is cut off
        record.held = held  # the picker walks this tail once per pop: no re-walk of the cut
        for i in reversed(range(held)):
            block_id = ids[i]
            if block_id == HOLE or generation.get(block_id, 0) != generations[i]:
                continue  # no block here, or reused since
            yield block_id, holders.get(block_id, 0) == 1 and block_id not in shared_blocks

    def unreused(self, session: str, first_block: int) -> list[int]:
        """The blocks of ``session``'s latest request from ``first_block`` on that still hold the
        content it recorded (not reused since), released or not."""
        record = self.latest.get(session)
        if record is None:
            return []
        generation = self._generation
        return [
            block_id
            for i, block_id in enumerate(record.block_ids[first_block:], first_block)
            if block_id != HOLE and generation.get(block_id, 0) == record.generations[i]
        ]

    # -- internals ----------------------------------------------------------------------------
    def _hold(self, session: str, record: SessionRecord, block_ids: Sequence[int]) -> None:
        holders, generation, first_holder = self._holders, self._generation, self._first_holder
        owner = owner_of(session)  # a side branch shares its own session's blocks freely
        bound = 0
        for block_id in block_ids:
            record.block_ids.append(block_id)
            if block_id == HOLE:
                record.generations.append(0)
                continue
            bound += 1
            record.generations.append(generation.get(block_id, 0))
            holders[block_id] = holders.get(block_id, 0) + 1
            if first_holder.setdefault(block_id, owner) != owner:
                self._shared.add(block_id)
        record.held = len(record.block_ids)
        self.bindings += bound

    def _let_go(self, record: SessionRecord, first: int) -> tuple[list[int], int]:
        """The record stops holding its blocks from index ``first`` on; returns the blocks no
        record holds any more and no other session has held, and how many are kept for others."""
        released: list[int] = []
        kept = 0
        holders, generation, shared = self._holders, self._generation, self._shared
        for i in range(first, record.held):
            block_id = record.block_ids[i]
            if block_id == HOLE or generation.get(block_id, 0) != record.generations[i]:
                continue  # no block, or reused since: this record does not hold the new content
            count = holders.get(block_id, 0) - 1
            self.bindings -= 1
            if count > 0:
                holders[block_id] = count
                kept += 1
            else:
                holders.pop(block_id, None)
                if block_id in shared:
                    kept += 1
                else:
                    released.append(block_id)
        record.held = min(record.held, first)
        return released, kept

    def check(self) -> list[str]:
        """Invariant violations (empty when consistent): every holder count equals the number
        of records holding the block's current content, and ``bindings`` is their sum."""
        counts: dict[int, int] = {}
        for record in self.latest.values():
            for i in range(record.held):
                block_id = record.block_ids[i]
                if block_id == HOLE:
                    continue
                if self._generation.get(block_id, 0) == record.generations[i]:
                    counts[block_id] = counts.get(block_id, 0) + 1
        problems = [
            f"block {b}: {self._holders.get(b, 0)} holders counted, {counts.get(b, 0)} records"
            for b in sorted(set(counts) | set(self._holders))
            if counts.get(b, 0) != self._holders.get(b, 0)
        ]
        if self.bindings != sum(counts.values()):
            problems.append(f"bindings {self.bindings} != {sum(counts.values())} held")
        if len(self.latest) > self._max_sessions:
            problems.append(f"{len(self.latest)} sessions over the limit {self._max_sessions}")
        return problems
