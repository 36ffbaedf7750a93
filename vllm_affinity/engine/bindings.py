"""Binding the blocks vLLM hands out to the sessions that hold them (``Bindings``): the engine
room's per-step path.

Each scheduler step's output says which blocks each request got (``take_scheduled``,
``bind_taken``); the pool's pops say which blocks were handed out for new content
(``blocks_handed_out``: no record holds them any more). One session table per KV-cache group
records the latest request of each session; the pool's ``BlockStates`` says who holds each
block.

Invariants: a block handed out is unbound before any table is read (``tables`` and
``block_states`` settle the handouts that wait); a request's record is its blocks as the
scheduler last handed them over, or is rebound whole before it frees them (``bind_request``);
``bound`` holds each running request's bound lengths per group, and nothing once it is done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

import numpy as np

from ..core import HOLE, SessionBlocks
from ..core.block_states import BlockStates, id_array
from ..core.groups import KVGroup, decode_bound_at_free
from ..core.request_keys import DENSE_KINDS
from ..core.sessions import FEW_BLOCKS
from .pool_context import PoolContext

#: Handouts that wait to be unbound (``blocks_handed_out``) at most, of one block and of many
#: (a server whose requests name no session binds none and reads no state): then the states
#: are settled at once.
_MAX_HANDED_ONE = 1024
_MAX_HANDED = 1024


@dataclass(slots=True)
class StepBind:
    """A request of a step's output, taken (``Bindings.take_scheduled``) and not yet bound: per
    group its block ids and where their waiting tail starts (``_step_ids``), or no lists
    (``grown`` None) when its blocks are read from the manager at the bind."""

    session: str
    request_id: str
    prompt: int
    grown: list[np.ndarray | list[int]] | None
    handed: list[int | None]
    already: tuple[int, ...] | None


class Bindings:
    """The session tables (one per group) and the blocks of running requests bound in them."""

    def __init__(self, ctx: PoolContext) -> None:
        self._ctx = ctx
        self.pool, self.queue = ctx.pool, ctx.queue
        self._tables: tuple[SessionBlocks, ...] = ()
        self._block_states = BlockStates(self.pool.num_gpu_blocks, fixed=True)
        #: Blocks handed out and not yet unbound (``_settle``): single ones (a decode step's),
        #: and allocations of many by their last block id (bound from the step's output).
        self._handed_one: list[Any] = []
        self._handed: dict[int, list[Any]] = {}
        #: Per group, its list's index in vLLM's and whether it is full attention (no hole).
        self._group_lists: list[tuple[int, bool]] = []
        #: Tokens a request may decode with its growth bound at its free (``take_scheduled``).
        self._decode_at_free = 0
        #: Each running request's bound lengths, per group.
        self._bound: dict[str, tuple[int, ...]] = {}
        #: Running requests whose growth is bound at their free (``take_scheduled``), or when
        #: a release of their session needs it (``catch_up``).
        self._decoding: set[str] = set()
        #: A running request's blocks by request id (the ``KVCacheManager``'s coordinator's
        #: ``get_blocks``; set when the manager is built).
        self.request_blocks: Callable[[str], Sequence[list[Any]]] | None = None

    def attach(self, groups: tuple[KVGroup, ...]) -> None:
        """The model's groups (``ctx.groups``, set already): empty tables for them."""
        self._group_lists = [(g.index, g.kind in DENSE_KINDS) for g in groups]
        self._decode_at_free = decode_bound_at_free(groups, DENSE_KINDS)
        self._new_tables()

    @property
    def raw_states(self) -> BlockStates:
        """Who holds each block as it stands: the handouts that wait not unbound yet (a block
        handed out is no queued block: the picker and the stats' one-group count read this)."""
        return self._block_states

    @property
    def bound(self) -> dict[str, tuple[int, ...]]:
        """The running requests bound so far (``check``: none while idle)."""
        return self._bound

    def _new_tables(self) -> None:
        """Empty session tables, one per group, as at start-up."""
        #: Per block of the pool, who holds its content: one for every group's table.
        self._block_states = BlockStates(self.pool.num_gpu_blocks, fixed=True)
        self._tables = tuple(
            SessionBlocks(self._ctx.max_sessions, 0, g.kind in DENSE_KINDS, self._block_states)
            for g in self._ctx.groups
        )

    def forget(self) -> None:
        """After the plugin failed in a path that binds blocks (``fail_open.py``): every
        session's record is dropped, as at start-up, and no release waits on a block in use,
        so nothing the tables knew before the failure can release a live block. The queue's
        order stays (vLLM's LRU order for every block freed from now on)."""
        self.queue.cancel_pending_many(self.queue.pending_ids())
        self._handed_one.clear()
        self._handed.clear()
        self._bound.clear()
        self._decoding.clear()
        self._new_tables()

    @property
    def tables(self) -> tuple[SessionBlocks, ...]:
        """One session table per group, the blocks handed out so far unbound in them."""
        if self._handed_one or self._handed:
            self._settle()
        return self._tables

    @property
    def block_states(self) -> BlockStates:
        """Who holds each block of the pool (every group's table's), the blocks handed out so
        far unbound."""
        if self._handed_one or self._handed:
            self._settle()
        return self._block_states

    def _settle(self) -> None:
        """Unbind the blocks handed out since the states were last read (``blocks_handed_out``):
        a step's decode blocks in one call, not a call per block; an allocation of many that no
        bind took (``_step_ids``) on its own."""
        handed, self._handed_one = self._handed_one, []
        if handed:
            self._block_states.unbind([block.block_id for block in handed])
        many, self._handed = self._handed, {}
        for blocks in many.values():
            self._block_states.unbind([block.block_id for block in blocks])

    @property
    def sessions(self) -> SessionBlocks:
        """The first group's table: which sessions are known and their latest request (every
        group's table records the same requests)."""
        return self.tables[0]

    def take_scheduled(
        self,
        session: str,
        request_id: str,
        block_ids: Sequence[Sequence[int]],
        prompt: int,
        appended: bool,
        decoded: int = 0,
    ) -> StepBind | None:
        """``PoolAffinity.bind_scheduled``'s first half, for one request of the step's output:
        its lists converted, and their tails that wait to be unbound taken (``_step_ids``);
        None when there is nothing to bind now. Every request of the step is taken before any
        is bound: what no request took is then unbound at once, before the first record holds
        a block."""
        already = self._bound.get(request_id) if appended else None
        if appended:
            if already is None:
                return None  # never bound whole: bound when it frees its blocks
            if decoded > 0 and decoded <= self._decode_at_free:
                self._decoding.add(request_id)
                return None
            if request_id in self._decoding:  # decoded past the bound: its growth so far, now
                self._decoding.discard(request_id)
                if self.request_blocks is not None:
                    return StepBind(session, request_id, prompt, None, [], already)
        grown, handed = zip(
            *(self._step_ids(block_ids[index], dense) for index, dense in self._group_lists),
            strict=True,
        )
        return StepBind(session, request_id, prompt, list(grown), list(handed), already)

    def bind_taken(self, binds: Sequence[StepBind | None]) -> None:
        """``PoolAffinity.bind_scheduled``'s second half: the taken requests' records, in order."""
        for bind in binds:
            if bind is None:
                continue
            if bind.grown is None:
                assert self.request_blocks is not None
                blocks = self.request_blocks(bind.request_id)
                self.bind_request(bind.session, bind.request_id, blocks, bind.prompt)
                continue
            self._bind(
                bind.session, bind.request_id, bind.grown, bind.already, bind.prompt, None,
                bind.handed,
            )  # fmt: skip

    def blocks_handed_out(self, blocks: Sequence[Any]) -> None:
        """vLLM's pool hands these blocks out for new content (``BlockPool.get_new_blocks``,
        through the queue's pop: its handout hook): no record holds them any more. They wait
        to be unbound until the states are next read (``tables``, ``block_states``: no record
        can hold them before then), at most ``_MAX_HANDED_ONE`` single ones (a decode step's,
        mostly: unbound in one call) and ``_MAX_HANDED`` of many (a server whose requests name
        no session reads none). An allocation of many is mostly a request's that the step's
        output binds right after: its tail is unbound and held there in one pass
        (``_step_ids``, ``SessionBlocks.record``'s ``handed_from``)."""
        if len(blocks) == 1:
            if len(self._handed_one) < _MAX_HANDED_ONE:
                self._handed_one.append(blocks[0])
                return
        elif len(blocks) > FEW_BLOCKS and len(self._handed) < _MAX_HANDED:
            last = blocks[-1].block_id
            earlier = self._handed.get(last)  # an allocation's, freed since: unbound now
            self._handed[last] = list(blocks)
            if earlier is None:
                return
            blocks = earlier
        start = perf_counter_ns()
        # no hold comes before the waiting ones are unbound: unbinds in any order, no settle
        self._block_states.unbind([block.block_id for block in blocks])
        if len(self._handed_one) >= _MAX_HANDED_ONE or len(self._handed) >= _MAX_HANDED:
            self._settle()
        self._ctx.engine_ns += perf_counter_ns() - start

    def _step_ids(
        self, block_ids: Sequence[int], dense: bool
    ) -> tuple[np.ndarray | list[int], int | None]:
        """A group's block list from the step's output (a new or resumed request's whole list,
        a running one's new blocks), converted, and where its tail that waits to be unbound
        starts (``blocks_handed_out``: all of a chunk's new blocks, a new prompt's blocks after
        its hit), if it has one; the bind unbinds it (``_bind``)."""
        ids = self._id_array(block_ids, dense)
        if not self._handed or len(block_ids) <= FEW_BLOCKS:
            return ids, None
        handed = self._handed.pop(block_ids[-1], None)
        if handed is None:
            return ids, None
        head = len(block_ids) - len(handed)
        # the last ids agree (the key); the first does too where the list ends with this
        # allocation: a request's blocks are distinct, and an allocation is appended whole
        if head < 0 or block_ids[head] != handed[0].block_id:
            self._handed[block_ids[-1]] = handed  # another list's: unbound with the rest
            return ids, None
        return ids, head

    def bind_request(
        self, session: str, request_id: str, blocks: Sequence[list[Any]], prompt: int
    ) -> None:
        """Record the request's blocks (vLLM's block objects, one list per vLLM group) as they
        are now, for what the step outputs did not bind: called before the request frees its
        blocks, at the cost of a length check when everything is bound already."""
        lengths = tuple(len(blocks[g.index]) for g in self._ctx.groups)
        already = self._bound.get(request_id)
        if lengths == already:
            return
        grown = [
            self._ids(blocks[g.index][already[position] if already else 0 :])
            for position, g in enumerate(self._ctx.groups)
        ]
        self._bind(session, request_id, grown, already, prompt, whole=blocks)

    def _bind(
        self,
        session: str,
        request_id: str,
        grown: list[np.ndarray | list[int]],
        already: tuple[int, ...] | None,
        prompt: int,
        whole: Sequence[list[Any]] | None,
        handed: list[int | None] | None = None,
    ) -> None:
        """Each group's table records the request's ``grown`` blocks: its whole lists when
        ``already`` is None, else the blocks after the ``already`` bound. A running request's
        record that another request of the session replaced meanwhile is recorded again whole
        (from ``whole``), or left to the bind before it frees its blocks. ``handed``: per
        group, where the tail that waits to be unbound starts (``_step_ids``), if any: unbound
        here whatever happens."""
        lengths = []
        handed = handed or [None] * len(grown)
        for position, (group, table) in enumerate(zip(self._ctx.groups, self.tables, strict=True)):
            ids, fresh = grown[position], handed[position]
            start = already[position] if already else 0
            lengths.append(start + len(ids))
            if self.queue.num_pending:  # live users again: not RELEASED when freed
                self.queue.cancel_pending_many(ids if isinstance(ids, list) else ids.tolist())
            if not start:
                table.record(session, ids, prompt, request_id, handed_from=fresh)
                continue
            if fresh:  # new blocks after others (not vLLM's): unbound before the grow
                self._unbind_tail(ids, fresh)
                fresh = None
            if table.grow(session, request_id, start, ids, prompt, handed=fresh == 0):
                continue
            self._unbind_tail(ids, fresh)  # the grow held nothing: unbound all the same
            if whole is None:
                for later in range(position + 1, len(grown)):  # no record of theirs follows
                    self._unbind_tail(grown[later], handed[later])
                self._bound.pop(request_id, None)  # bound whole before it frees its blocks
                return
            every = self._ids(whole[group.index])
            if self.queue.num_pending:  # recorded whole again: every block a live user's
                self.queue.cancel_pending_many(every if isinstance(every, list) else every.tolist())
            table.record(session, every, prompt, request_id)
        self._bound[request_id] = tuple(lengths)

    def _unbind_tail(self, ids: np.ndarray | list[int], fresh: int | None) -> None:
        """Unbind the blocks of ``ids`` from ``fresh`` on (a tail that waits, ``_step_ids``)."""
        if fresh is not None:
            self._block_states.unbind(ids[fresh:])

    def _ids(self, blocks: Sequence[Any]) -> np.ndarray | list[int]:
        """The blocks' ids, ``HOLE`` for the null block."""
        return self._id_array([block.block_id for block in blocks], dense=False)

    def _id_array(self, block_ids: Sequence[int], dense: bool) -> np.ndarray | list[int]:
        """Block ids, ``HOLE`` for the null block's: an array, or a list of a few (a decode
        step's block: Python steps beat numpy's set-up)."""
        null = self._ctx.null_id
        if len(block_ids) <= FEW_BLOCKS:
            return [HOLE if block_id == null else block_id for block_id in block_ids]
        ids = id_array(block_ids)
        if not dense:  # ``dense``: a full-attention group's, never the null block
            ids[ids == null] = HOLE  # a sliding window's or a Mamba group's
        return ids

    def catch_up(self, session: str) -> None:
        """Bind the growth of the session's decoding request (``bind_scheduled``) before a
        release reads its record: a release while it runs covers what it generated so far."""
        if not self._decoding or self.request_blocks is None:
            return
        record = self.sessions.latest.get(session)
        request_id = record.request_id if record is not None else None
        if request_id is not None and request_id in self._decoding:
            assert record is not None
            blocks = self.request_blocks(request_id)
            self.bind_request(session, request_id, blocks, record.num_prompt_tokens)

    def request_done(self, session: str, request_id: str) -> None:
        """The request freed its blocks (finished, aborted or preempted)."""
        self._bound.pop(request_id, None)
        self._decoding.discard(request_id)
        for table in self.tables:
            table.request_finished(session, request_id)


class OverBindings:
    """A part of the engine room that reads the session tables: the pool's context, its
    bindings, and the tables as they stand once the handouts that wait are unbound."""

    def __init__(self, ctx: PoolContext, bindings: Bindings) -> None:
        self._ctx, self._bindings = ctx, bindings
        self.pool, self.queue, self.counters = ctx.pool, ctx.queue, ctx.counters

    @property
    def tables(self) -> tuple[SessionBlocks, ...]:
        return self._bindings.tables

    @property
    def sessions(self) -> SessionBlocks:
        return self._bindings.sessions
