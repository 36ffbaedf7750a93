"""The engine's per-pool state: the segmented queue, one session table per KV-cache group, the
subagent families, and every path that releases, idles, protects or restores a session's
blocks (``PoolAffinity``). Plain Python and numpy over vLLM's block objects; ``patches.py``
attaches it to vLLM's ``BlockPool`` and calls it from its wraps and utilities.

``PoolAffinity`` answers with the protocol's models (``EngineRelease``, ``EngineIdle``,
``EngineRestore``, ``EngineStats``); the utilities turn them into plain dicts only at the
process boundary.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

import numpy as np

from jiuwen_kv_protocol.models import (
    COUNTER_NAMES,
    GROUP_COUNTERS,
    EngineIdle,
    EngineRelease,
    EngineRestore,
    EngineStats,
    GroupStats,
    ReleaseMode,
    Segments,
)

from ..core import (
    HOLE,
    IdleResult,
    ReleaseResult,
    ReleaseSelection,
    Segment,
    SegmentedFreeBlockQueue,
    SessionBlocks,
    first_stale_block,
)
from ..core.block_states import BlockStates, id_array
from ..core.compaction import owner_of, retried_branch, side_branch
from ..core.counters import Counters
from ..core.groups import KVGroup, decode_bound_at_free
from ..core.idle_guard import IdleGuard
from ..core.request_keys import DENSE_KINDS
from ..core.returns import ReturnPredictor
from ..core.sessions import FEW_BLOCKS
from ..core.siblings import SiblingStarts
from ..core.subagents import FamilyChange, Subagents
from ..core.tenants import scoped
from ..settings import Settings
from .checkpoints import InstructionCheckpoints, has_sparse_groups
from .fail_open import ERRORS
from .request_view import keys_of

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


@dataclass(slots=True)
class _StepBind:
    """A request of a step's output, taken (``PoolAffinity.take_scheduled``) and not yet
    bound: per group its block ids and where their waiting tail starts (``_step_ids``), or no
    lists (``grown`` None) when its blocks are read from the manager at the bind."""

    session: str
    request_id: str
    prompt: int
    grown: list[np.ndarray | list[int]] | None
    handed: list[int | None]
    already: tuple[int, ...] | None


#: Handouts that wait to be unbound (``blocks_handed_out``) at most, of one block and of many
#: (a server whose requests name no session binds none and reads no state): then the states
#: are settled at once.
#: What one bounded check (``/affinity/check``, between two scheduler steps) walks at most: a
#: rotating slice of this many blocks of a larger pool, and the session records (their holder
#: counts, each group's bindings) only while there are at most this many (a walk of every
#: record is ~1 s at 100k sessions).
CHECK_BLOCKS = 16_384
CHECK_RECORDS = 4_096
_MAX_HANDED_ONE = 1024
_MAX_HANDED = 1024


class PoolAffinity:
    """Per-``BlockPool`` state: the segmented queue (also ``pool.free_block_queue``), one
    session table per KV-cache group (``core/groups.py``), and which blocks of each running
    request are already bound.

    Until the ``KVCacheManager`` names the groups (``attach_groups``), the pool is taken to have
    one group at the hash block size, as a Llama-style model has."""

    def __init__(self, pool: Any, settings: Settings | None = None) -> None:
        settings = settings or Settings()
        self.pool = pool
        self.queue = SegmentedFreeBlockQueue(
            pool.free_block_queue.get_all_free_blocks(), capacity=len(pool.blocks)
        )
        pool.free_block_queue = self.queue
        #: vLLM's null block (a sliding window's dropped positions): a HOLE in the records.
        self._null_id: int = pool.null_block.block_id
        #: Nanoseconds the plugin spent on the scheduler's path (``patches.py``' wrappers and
        #: the picker) and the scheduler steps run: ``/metrics`` shows the time per step.
        self.engine_ns = 0
        self.steps = 0
        #: Where the next bounded check's slice of blocks starts, and what the last covered.
        self._check_cursor = 0
        self.check_scope: dict[str, Any] = {}
        from vllm.v1.core.kv_cache_utils import get_block_hash

        self._strip_group = get_block_hash
        self._max_sessions = settings.max_sessions
        self.counters = Counters(COUNTER_NAMES)
        self._checkpoints = settings.checkpoints
        #: A side branch's instruction length (its latest request's ``HEAD_KEY``).
        self._side_heads: OrderedDict[str, int] = OrderedDict()
        self.groups: tuple[KVGroup, ...] = ()
        self._tables: tuple[SessionBlocks, ...] = ()
        #: Blocks handed out and not yet unbound (``_settle``): single ones (a decode step's),
        #: and allocations of many by their last block id (bound from the step's output).
        self._handed_one: list[Any] = []
        self._handed: dict[int, list[Any]] = {}
        # the picker is part of the session lifecycle: release-only mode is LRU's order; None:
        # ``auto``, on until the groups say the model is hybrid (``attach_groups``)
        self._picker = settings.predict_return if settings.lifecycle else False
        self.returns: ReturnPredictor | None = None
        self.wait_guard: IdleGuard | None = None
        self.attach_groups((KVGroup(0, "full_attention", pool.hash_block_size),))
        self.subagents = Subagents(settings.max_sessions)
        self.siblings = SiblingStarts()
        self._child_end = settings.child_end
        self.idle_guard = IdleGuard(settings.max_sessions) if settings.idle_guard else None
        self.predict_returns(
            self._picker is True or (self._picker is None and len(self.groups) == 1)
        )
        #: Most blocks the PROTECTED segment may hold (waiting parents' blocks); 0: off.
        self.protect_cap = int(settings.protect_share * pool.num_gpu_blocks)
        self._bound: dict[str, tuple[int, ...]] = {}
        #: Running requests whose growth is bound at their free (``bind_scheduled``), or when
        #: a release of their session needs it (``_catch_up``).
        self._decoding: set[str] = set()
        #: A running request's blocks by request id (the ``KVCacheManager``'s coordinator's
        #: ``get_blocks``; set when the manager is built).
        self.request_blocks: Callable[[str], Sequence[list[Any]]] | None = None
        self.queue.set_on_handout(self.blocks_handed_out)  # vLLM's ``get_new_blocks``' pops
        self.queue.set_on_hook_error(self._hook_failed)  # the pop goes on as LRU's

    def _hook_failed(self, hook: str, exc: Exception) -> None:
        """The picker or the handout hook failed inside vLLM's pop (``fail_open.py``): counted
        and logged; a handout not unbound leaves the tables unsure of what blocks hold."""
        if hook == "handout":
            self.forget_bindings()
        ERRORS.caught("handout" if hook == "handout" else "picker", exc)  # the two it names

    def attach_groups(self, groups: tuple[KVGroup, ...]) -> None:
        """The model's KV-cache groups that prefix caching covers (before any request)."""
        if not groups:
            raise ValueError("vllm_affinity: no prefix-cacheable KV-cache group to track")
        self.groups = groups
        #: Per group, its list's index in vLLM's and whether it is full attention (no hole).
        self._group_lists = [(g.index, g.kind in DENSE_KINDS) for g in groups]
        #: Tokens a request may decode with its growth bound at its free (``bind_scheduled``).
        self._decode_at_free = decode_bound_at_free(groups, DENSE_KINDS)
        self._new_tables()
        #: The instructions' checkpoints of a model with a sliding-window or Mamba group.
        self.checkpoints = (
            InstructionCheckpoints(self.queue, groups, self.counters, self._max_sessions)
            if self._checkpoints and has_sparse_groups(groups)
            else None
        )
        if self._picker is None and len(groups) > 1:
            self.predict_returns(False)  # ``auto`` on a hybrid model: LRU's order
        self._group_counts = [dict.fromkeys(GROUP_COUNTERS, 0) for _ in groups]

    def _new_tables(self) -> None:
        """Empty session tables, one per group, as at start-up."""
        #: Per block of the pool, who holds its content: one for every group's table.
        self._block_states = BlockStates(self.pool.num_gpu_blocks, fixed=True)
        self._tables = tuple(
            SessionBlocks(self._max_sessions, 0, g.kind in DENSE_KINDS, self._block_states)
            for g in self.groups
        )

    def forget_bindings(self) -> None:
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

    def bind_scheduled(
        self,
        session: str,
        request_id: str,
        block_ids: Sequence[Sequence[int]],
        prompt: int,
        appended: bool,
        decoded: int = 0,
    ) -> None:
        """Record what the scheduler's step output hands the workers (one list of block ids
        per vLLM group): a new or resumed request's whole block lists, or (``appended``) the
        blocks a running request got in this step, after those already bound: from the ids vLLM
        computed for its output, once per prefill step. A request that has ``decoded`` tokens
        (its prompt computed) leaves its growth to its free (``bind_request``: its last few
        blocks read once, not a bind per step that got one) while none of its blocks can have
        been dropped before then (``decode_bound_at_free``: a sliding window's drops are kept
        in the record, so past that it binds every step again; a Mamba group's, always).

        A step's output of many requests: ``take_scheduled`` for each, then ``bind_taken``."""
        self.bind_taken(
            [self.take_scheduled(session, request_id, block_ids, prompt, appended, decoded)]
        )

    def take_scheduled(
        self,
        session: str,
        request_id: str,
        block_ids: Sequence[Sequence[int]],
        prompt: int,
        appended: bool,
        decoded: int = 0,
    ) -> _StepBind | None:
        """``bind_scheduled``'s first half, for one request of the step's output: its lists
        converted, and their tails that wait to be unbound taken (``_step_ids``); None when
        there is nothing to bind now. Every request of the step is taken before any is bound:
        what no request took is then unbound at once, before the first record holds a block."""
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
                    return _StepBind(session, request_id, prompt, None, [], already)
        grown, handed = zip(
            *(self._step_ids(block_ids[index], dense) for index, dense in self._group_lists),
            strict=True,
        )
        return _StepBind(session, request_id, prompt, list(grown), list(handed), already)

    def bind_taken(self, binds: Sequence[_StepBind | None]) -> None:
        """``bind_scheduled``'s second half: the taken requests' records, in order."""
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
        self.engine_ns += perf_counter_ns() - start

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
        lengths = tuple(len(blocks[g.index]) for g in self.groups)
        already = self._bound.get(request_id)
        if lengths == already:
            return
        grown = [
            self._ids(blocks[g.index][already[position] if already else 0 :])
            for position, g in enumerate(self.groups)
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
        for position, (group, table) in enumerate(zip(self.groups, self.tables, strict=True)):
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
        null = self._null_id
        if len(block_ids) <= FEW_BLOCKS:
            return [HOLE if block_id == null else block_id for block_id in block_ids]
        ids = id_array(block_ids)
        if not dense:  # ``dense``: a full-attention group's, never the null block
            ids[ids == null] = HOLE  # a sliding window's or a Mamba group's
        return ids

    def _catch_up(self, session: str) -> None:
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

    def release(self, session: str, first_block: int, mode: ReleaseMode = "post") -> EngineRelease:
        """Release the session's latest blocks after its first ``first_block`` hash blocks
        (block indices, for a one-group model), in every group."""
        return self._release_groups(session, [g.block_of(first_block) for g in self.groups], mode)

    def _release_groups(
        self,
        session: str,
        first_blocks: Sequence[int],
        mode: ReleaseMode,
        also: Sequence[ReleaseSelection] = (),
    ) -> EngineRelease:
        """Release the session's latest blocks of each group from that group's block index in
        ``first_blocks`` on (and the blocks ``also`` selected, in the same release)."""
        self._catch_up(session)
        selections = [
            table.select_release(session, first)
            for table, first in zip(self.tables, first_blocks, strict=True)
        ]
        return self._apply(selections, first_blocks, mode, also)

    def release_divergent(
        self,
        session: str,
        chain: list[Any],
        mode: ReleaseMode,
        require_common_prefix: bool = False,
        also: Sequence[ReleaseSelection] = (),
        keep_tokens: int = 0,
    ) -> EngineRelease:
        """Release the session's latest blocks, in every group, from the first one ``chain`` (a
        prompt's block hashes) cannot hit. ``require_common_prefix``: a chain that shares not
        even one block with the session's cache is a different prompt (template, salt), not a
        cut of it: answer ``record_mismatch`` and release nothing. ``also``: blocks selected
        elsewhere, released with these. ``keep_tokens``: every block holding the session's
        first that many tokens is kept, the one straddling their end included."""
        started = time.perf_counter()
        record = self.sessions.latest.get(session)
        if record is None:
            result = self._apply([ReleaseSelection(status="unknown_session")], (0,), mode, also)
        else:
            firsts = [
                max(first, group.blocks_holding(keep_tokens))
                for first, group in zip(self._first_stale(session, chain), self.groups, strict=True)
            ]
            if require_common_prefix and chain and not self._any_hit(session, firsts):
                result = self._apply([ReleaseSelection(status="record_mismatch")], (0,), mode)
            else:
                result = self._release_groups(session, firsts, mode, also)
            result.prompt_tokens = record.num_prompt_tokens
        # time spent in the engine core on this path (what a hinted request adds to its step)
        self.counters.add(f"release_us_{mode}", round((time.perf_counter() - started) * 1e6))
        return result

    def release_rewritten(self, session: str, chain: list[Any], head: int = 0) -> EngineRelease:
        """A compaction told from the agent's own requests (``core/compaction.py``): the main
        thread's blocks ``chain`` cannot hit, also when ``chain`` shares no block with them (the
        agent said the old window is gone), and a retry's replaced window past what ``chain``
        hits, in one release, decided now. ``head``: the new window's instructions, in tokens.

        The session's side branch goes in the same release. One that started with the whole
        old prompt (Qwen Code's suggestion: the window and one message) goes whole. One with a
        prompt of its own (a memory extractor or opencode's summarizer under its own system
        prompt, the Codex CLI's tool-less compaction request) keeps its instructions and the
        part of the conversation the new window still carries, as long as it was in the old
        window (the Codex CLI keeps its environment and the user's turns; the next compaction
        request sends them again): what ``chain`` hits of the old window past the
        instructions, one block more for the two renderings' differences."""
        also: list[ReleaseSelection] = []
        side = side_branch(session)
        if side in self.sessions.latest:
            side_head = self._side_heads.pop(side, 0)
            if self._carried_conversation(side, session):
                firsts = [0] * len(self.tables)
            else:
                kept = self._first_stale(session, chain)
                firsts = [
                    self._side_keeps(group, side_head, max(0, f * group.block_size - head))
                    for f, group in zip(kept, self.groups, strict=True)
                ]
            also += [t.select_release(side, f) for t, f in zip(self.tables, firsts, strict=True)]
            for table in self.tables:
                table.forget(side)
        retried = retried_branch(session)
        if retried in self.sessions.latest:  # a retry's replaced window: what chain cannot hit
            firsts = self._first_stale(retried, chain)
            also += [t.select_release(retried, f) for t, f in zip(self.tables, firsts, strict=True)]
            for table in self.tables:
                table.forget(retried)
        return self.release_divergent(session, chain, "compaction", also=also)

    @staticmethod
    def _side_keeps(group: KVGroup, side_head: int, carried: int) -> int:
        """The side branch's blocks kept at a rewrite: its instructions (the block straddling
        their end included) and ``carried`` tokens more, one block more for those (they are
        the new window's rendering of the items, the side's may differ by a few tokens)."""
        if carried == 0:
            return group.blocks_holding(side_head)
        return group.blocks_holding(side_head + carried) + 1

    def _carried_conversation(self, branch: str, session: str) -> bool:
        """Whether ``branch``'s latest request started with every whole block of ``session``'s
        latest prompt (in the first group that holds both): the conversation, not only the
        instructions they share (the Codex CLI's compaction request shares its developer prompt,
        190 of 371 blocks, its tools rendered apart)."""
        for table, group in zip(self.tables, self.groups, strict=True):
            side = table.latest.get(branch)
            main = table.latest.get(session)
            if side is None or main is None or not main.block_ids:
                continue
            shared = 0
            for side_id, main_id in zip(side.block_ids, main.block_ids, strict=False):
                if side_id != main_id or side_id == HOLE:
                    break
                shared += 1
            whole = min(len(main.block_ids), main.num_prompt_tokens // group.block_size)
            return shared > 0 and shared >= whole
        return False

    def restore_divergent(self, session: str, chain: list[Any]) -> EngineRestore:
        """openJiuwen's ``prefetch``: the session's blocks from the first one ``chain`` cannot
        hit (in every group), demoted by an earlier release and not reused since, go back to
        the most-recently-used end of NORMAL. Blocks already reused are gone: this server has
        no second tier to load them from."""
        if session not in self.sessions.latest:
            status, firsts, restored = "unknown_session", [0], 0
        else:
            firsts = self._first_stale(session, chain)
            blocks = self.pool.blocks
            restored = sum(
                self.queue.restore(blocks[b])
                for table, first in zip(self.tables, firsts, strict=True)
                for b in table.unreused(session, first)
            )
            status = "ok"
        self.counters.add("restores", 1)
        self.counters.add("blocks_restored", restored)
        return EngineRestore(status=status, blocks_restored=restored, first_stale_block=firsts[0])

    def idle_session(
        self, session: str, ends_task: bool = True, next_use: float | None = None
    ) -> EngineIdle:
        """The session waits on its user: its own blocks (every group's) go to IDLE, tail first,
        reused after released blocks and before any live session's, when the idle guard finds
        it worth it (``next_use``, the agent's hint in seconds, weighs in). Shared blocks and
        blocks in use stay.

        A subagent (a session that named a parent) whose signal ``ends_task`` (its model
        answered, or its hint says it is not back within the hour) has ended its task instead:
        its parent stops waiting on it, and with ``VLLM_AFFINITY_CHILD_END=release`` its own
        blocks are released as dead after what its siblings will hit (``_end_child``; and what
        other sessions have hit is kept: ``core/sessions.py``)."""
        self.counters.add("idles", 1)  # every signal, applied or not (a replay waits on it)
        if ends_task and self.subagents.parent_of(session) is not None:
            record = self.sessions.latest.get(session)
            result = None
            if self._child_end == "release" and record is not None and record.request_id is None:
                result = self._end_child(session)
            self._apply_family(self.subagents.ended(session))
            self.counters.add("children_ended", 1)
            if result is not None:
                return EngineIdle(
                    status=result.status, blocks_idled=0, kept_shared=result.kept_shared
                )
        selections = [table.select_idle(session) for table in self.tables]
        status = selections[0].status
        if status == "ok" and not self._worth_idling(self.idle_guard, session, next_use):
            self.counters.add("idles_returns_soon", 1)
            return EngineIdle(status="returns_soon", blocks_idled=0, kept_shared=0)
        moved = self._move_to_idle(selections)
        self.counters.add(f"idles_{status}", 1)
        return EngineIdle(
            status=status,
            blocks_idled=moved,
            kept_shared=sum(selection.kept_shared for selection in selections),
        )

    def _end_child(self, session: str) -> EngineRelease:
        """A subagent's end: its blocks are released as dead after what its siblings will hit
        (its instructions, the block straddling their end, and the start its siblings' first
        prompts have shared so far: ``core/siblings.py``), in every group."""
        keep = self.subagents.head_of(session)
        family = self.subagents.family_of(session)
        if family is not None:
            keep = max(keep, self.siblings.shared(family) * self.pool.hash_block_size)
        firsts = [group.blocks_holding(keep) for group in self.groups]
        kept = sum(
            len(table.unreused(session, 0)) - len(table.unreused(session, first))
            for table, first in zip(self.tables, firsts, strict=True)
        )
        self.counters.add("blocks_kept_instructions", kept)
        if self.returns is not None:  # what it keeps is for its siblings: not the picker's
            self.returns.forget(session)
        return self._release_groups(session, firsts, "child_end")

    def _sibling_family(self, parent: str, head: int, chain: Sequence[Any]) -> Any:
        """The key a new child's siblings are learned under: the hash of the block that ends
        its instructions, when the API server measured them, else its parent."""
        end = head // self.pool.hash_block_size
        return ("instructions", chain[end - 1]) if 0 < end <= len(chain) else ("parent", parent)

    def _move_to_idle(self, selections: Sequence[ReleaseSelection]) -> int:
        """Idle every group's selected blocks (one selection per group); how many moved."""
        blocks, moved = self.pool.blocks, 0
        for counts, selection in zip(self._group_counts, selections, strict=True):
            group_moved = sum(
                self.queue.idle(blocks[b]) is IdleResult.MOVED for b in selection.block_ids
            )
            counts["blocks_idled"] += group_moved
            moved += group_moved
        self.counters.add("blocks_idled", moved)
        return moved

    def _worth_idling(self, guard: IdleGuard | None, session: str, next_use: float | None) -> bool:
        """``guard``'s verdict (``core/idle_guard.py``; none: always), noting the absence it
        starts."""
        if guard is None:
            return True
        worth = guard.worth_idling(session, next_use)
        guard.went_idle(session, self.queue.cached_reused, self.queue.num_cached, next_use)
        return worth

    def _apply_family(self, change: FamilyChange) -> None:
        for parent in change.unprotect:
            self._unprotect(parent)
        if change.protect is not None:
            waiting = self._protect if self.protect_cap > 0 else self._idle_waiting
            waiting(change.protect)

    def _idle_waiting(self, parent: str) -> None:
        """With the picker on: a parent that waits on its first running subagent gives its own
        blocks up first (IDLE, tail first) when its wait guard finds its waits outlast LRU's
        reach (an idle guard of its own: a lead's waits are not its user's absences), unless
        its last call said when it is back (the picker then knows). A lead waits while its
        subagent runs tens of calls, and the call order alone reads it as back in a few: on
        the Claude Code trace at 0.1x this closes 69% of the LRU → Belady gap in the
        simulator, against 65% (``docs/decisions.md``). Its last child's end, or its own next
        call, puts them back (``_unprotect``)."""
        guard, returns = self.wait_guard, self.returns
        if guard is None or returns is None or returns.hinted(owner_of(parent)):
            return
        if not self._worth_idling(guard, parent, None):
            return
        moved = self._move_to_idle([table.select_idle(parent) for table in self.tables])
        self.counters.add("waits_idled", 1)
        self.counters.add("blocks_idled_waiting", moved)

    def _protect(self, parent: str) -> None:
        """The parent's blocks (prefix first, the part a hit needs; group by group) go to
        PROTECTED, within the cap; blocks in use or already demoted by a release stay as they
        are."""
        room = self.protect_cap - self.queue.segment_sizes()["protected"]
        if room <= 0:
            return
        blocks, moved = self.pool.blocks, 0
        for block_id in self._unreused(parent):
            if moved >= room:
                break
            moved += self.queue.protect(blocks[block_id])
        self.counters.add("protects", 1)
        self.counters.add("blocks_protected", moved)

    def _unprotect(self, parent: str) -> None:
        """The parent stops waiting: its PROTECTED blocks (and, with the picker on, its IDLE
        ones: ``_idle_waiting``) go back to the most-recently-used end of NORMAL (it calls
        again soon)."""
        blocks = self.pool.blocks
        marked = (
            {Segment.PROTECTED} if self.wait_guard is None else {Segment.PROTECTED, Segment.IDLE}
        )
        for block_id in self._unreused(parent):
            block = blocks[block_id]
            if self.queue.segment_of(block) in marked:
                self.queue.restore(block)

    def _unreused(self, session: str) -> list[int]:
        return [b for table in self.tables for b in table.unreused(session, 0)]

    def _first_stale(self, session: str, chain: list[Any]) -> list[int]:
        """Per group, the index of the session's first block ``chain`` cannot hit."""
        self._catch_up(session)
        return [
            first_stale_block(self._entries(group, table, session), chain)
            for group, table in zip(self.groups, self.tables, strict=True)
        ]

    def _any_hit(self, session: str, firsts: Sequence[int]) -> bool:
        """Whether ``firsts`` (from ``_first_stale``) keep at least one block of some group."""
        for table, first in zip(self.tables, firsts, strict=True):
            record = table.latest.get(session)
            if record is not None and any(b != HOLE for b in record.block_ids[:first]):
                return True
        return False

    def _entries(
        self, group: KVGroup, table: SessionBlocks, session: str
    ) -> list[tuple[Any, int] | None]:
        """The session's record in ``group`` as ``first_stale_block`` reads it: per index, no
        block (a hole), or the block's hash (without its group id) and how many hash blocks it
        covers from the prompt's start."""
        record = table.latest.get(session)
        if record is None:
            return []
        blocks, strip, unit = self.pool.blocks, self._strip_group, self.pool.hash_block_size
        entries: list[tuple[Any, int] | None] = []
        for index, block_id in enumerate(record.block_ids):
            if block_id == HOLE:
                entries.append(None)
                continue
            block = blocks[block_id]
            block_hash = block.block_hash
            tokens = getattr(block, "block_hash_num_tokens", None)  # from the prompt's start
            end = tokens // unit if tokens else (index + 1) * group.scale
            entries.append((None if block_hash is None else strip(block_hash), end))
        return entries

    def _apply(
        self,
        selections: Sequence[ReleaseSelection],
        first_blocks: Sequence[int],
        mode: ReleaseMode,
        also: Sequence[ReleaseSelection] = (),
    ) -> EngineRelease:
        """Release every group's selected blocks (and ``also``'s, counted as one release).
        ``selections`` holds one selection per group, in group order; ``also`` whole rounds
        of them (one per branch released with the session)."""
        groups = len(self._group_counts)
        if len(also) % groups:
            raise ValueError(f"{len(also)} selections are not whole rounds of {groups} groups")
        moved = pending = 0
        for per_group in (selections, also):
            for index, selection in enumerate(per_group):
                counts = self._group_counts[index % groups]
                results = Counter(
                    self.queue.release(self.pool.blocks[b]) for b in selection.block_ids
                )
                counts["blocks_released"] += (
                    results[ReleaseResult.MOVED] + results[ReleaseResult.PENDING]
                )
                moved += results[ReleaseResult.MOVED]
                pending += results[ReleaseResult.PENDING]
        status = selections[0].status
        self.counters.add("releases", 1)
        self.counters.add(f"releases_{status}", 1)
        self.counters.add(f"releases_{mode}", 1)
        self.counters.add("blocks_moved", moved)
        self.counters.add("blocks_pending", pending)
        self.counters.add(f"block_released_{mode}", moved + pending)
        return EngineRelease(
            status=status,
            block_released=moved + pending,
            moved=moved,
            pending=pending,
            kept_shared=sum(s.kept_shared for s in [*selections, *also]),
            first_stale_block=first_blocks[0],
        )

    def on_new_request(self, request: Any, release_on_divergence: bool) -> None:
        """A request entered the scheduler: act on its in-request hint (or, when the server
        releases on divergence, on any prompt of a known session) before it allocates."""
        session = session_of(request)
        if not session:
            return
        for guard in (self.idle_guard, self.wait_guard):
            if guard is not None:
                guard.came_back(session, self.queue.cached_reused)
        keys = keys_of(request)
        if self.returns is not None:
            self.returns.called(owner_of(session), keys.next_use)
        parent = scoped(keys.principal or "", keys.parent) if keys.parent else None
        if parent or self.subagents.waiting(session):
            family = None
            if parent and self.subagents.parent_of(session) is None:  # a child's first call
                family = self._sibling_family(parent, keys.head, request.block_hashes)
                self.siblings.observe(family, request.block_hashes)
            self._apply_family(self.subagents.call(session, parent, keys.head, family))
        if session == side_branch(owner_of(session)):
            self._note_side_head(session, keys.head)
        retried = retried_branch(session)
        if keys.retry:
            for table in self.tables:  # the replaced window waits apart for the next one
                table.move(session, retried)
        elif retried in self.sessions.latest and not keys.rewrite:
            self._settle_retry(retried, request.block_hashes)
        if keys.rewrite:
            self.release_rewritten(session, request.block_hashes, keys.head)
        elif keys.hint:
            self.release_divergent(session, request.block_hashes, "in_request")
        elif release_on_divergence and session in self.sessions.latest:
            self.release_divergent(session, request.block_hashes, "divergence")

    def _note_side_head(self, branch: str, head: int) -> None:
        """The instruction length of a side branch's latest request (bounded, oldest out)."""
        self._side_heads[branch] = head
        self._side_heads.move_to_end(branch)
        while len(self._side_heads) > self._max_sessions:
            self._side_heads.popitem(last=False)

    def _settle_retry(self, retried: str, chain: list[Any]) -> None:
        """The window after a retry says which branch the thread continues: the replaced
        window's blocks this prompt cannot hit are dead (the blocks the main thread still holds
        stay), in every group."""
        self.release_divergent(retried, chain, "compaction")
        for table in self.tables:
            table.forget(retried)

    def predict_returns(self, on: bool) -> None:
        """Turn the predicted-return picker on (a fresh predictor) or off (LRU's victims)."""
        self.returns = ReturnPredictor(self._max_sessions) if on else None
        self.wait_guard = IdleGuard(self._max_sessions) if on else None
        self.queue.set_picker(self.pick if on else None)

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
        assert self.returns is not None
        states = self._block_states  # as it stands: a block handed out is no queued victim
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
        assert self.returns is not None
        table, due_of, inf = self.tables[0], self.returns.due, float("inf")
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
        assert self.returns is not None
        blocks = self.pool.blocks
        chunk = min(max(_FEWEST_ENTRIES, take), 1024)
        reads = _CANDIDATE_CHUNKS
        tables = self.tables
        for session in self.returns.back_last_first():
            if not any(table.walkable(session) for table in tables):
                # running, or nothing left to walk (mostly the sessions that called last):
                # its due need not come first either, as the next one's is no later
                continue
            due = self.returns.due(session)
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

    def group_stats(self, exact: bool = False, bindings: int | None = None) -> list[GroupStats]:
        """Per group, its counts. Its bindings: with one group, the pool's (one numpy pass, or
        ``bindings`` when the caller made it); with several, counted record by record only
        when ``exact`` (``/affinity/check``): a walk over every record, 0.6 s at 100k
        sessions, has no place on the stats' path."""
        tables = self.tables
        single = None
        if len(tables) == 1:
            single = self._block_states.bindings() if bindings is None else bindings
        return [
            GroupStats(
                group=group.index,
                kind=group.kind,
                block_size=group.block_size,
                bindings=table.bindings if exact and single is None else single,
                **counts,
            )
            for group, table, counts in zip(self.groups, tables, self._group_counts, strict=True)
        ]

    def spent_in_utility(self, ns: int) -> None:
        """An engine utility call took ``ns`` nanoseconds between two scheduler steps: counted
        in the plugin's engine time, with the longest such call."""
        self.engine_ns += ns
        us = ns // 1000
        self.counters.add("utility_calls")
        self.counters.add("utility_us", us)
        longest = self.counters["utility_us_max"]
        if us > longest:
            self.counters.add("utility_us_max", us - longest)

    def stats(self, exact: bool = False) -> EngineStats:
        """The counters and sizes (``exact``: each group's bindings too, ``group_stats``)."""
        bindings = self.block_states.bindings()  # one pass over the pool (settled), read once
        return EngineStats(
            segments=Segments(**self.queue.segment_sizes()),
            pending=self.queue.num_pending,
            released_reused=self.queue.released_reused,
            released_hit=self.queue.released_hit,
            protected_reused=self.queue.protected_reused,
            children=len(self.subagents),
            sessions=len(self.sessions),
            bindings=bindings,
            sessions_evicted=self.sessions.evicted,
            num_blocks=self.pool.num_gpu_blocks,
            groups=self.group_stats(exact, bindings),
            predict_return=self.returns is not None,
            engine_errors=dict(ERRORS.counts),
            malformed_args=dict(ERRORS.malformed),
            **{
                **self.counters.as_dict(),
                "engine_us": (self.engine_ns + self.queue.picker_ns) // 1000,
                "engine_steps": self.steps,
            },
        )

    def check(self, idle: bool, bounded: bool = False) -> list[str]:
        """Invariant violations of the pool, the queue and the session tables (empty when all
        hold). ``idle``: no request is running, so nothing may be in use or pending.
        ``bounded``: at most ``CHECK_BLOCKS`` blocks (the next slice of a larger pool, calls
        rotating over it) and the holder counts only up to ``CHECK_RECORDS`` records;
        ``check_scope`` says what the call covered."""
        queue = self.queue
        records = sum(len(table.latest) for table in self.tables)
        holders = not bounded or records <= CHECK_RECORDS
        problems = self.subagents.check()
        if holders:
            problems += self.tables[0].check(self.tables[1:])
        known = [set(table.latest) for table in self.tables]
        if any(k != known[0] for k in known):
            problems.append("the groups' session tables know different sessions")
        sizes = queue.segment_sizes()
        if sum(sizes.values()) != queue.num_free_blocks:
            problems.append(f"segments {sizes} do not sum to {queue.num_free_blocks} free")
        blocks = self.pool.blocks
        if not bounded or len(blocks) <= CHECK_BLOCKS:
            start, stop = 0, len(blocks)
            in_use = self._check_all_blocks(problems)
        else:
            start = self._check_cursor
            stop = min(len(blocks), start + CHECK_BLOCKS)
            self._check_cursor = 0 if stop == len(blocks) else stop
            in_use = self._check_blocks(blocks[start:stop], problems)
        if idle and (in_use or queue.num_pending or self._bound):
            problems.append(
                f"idle, yet {in_use} blocks in use, {queue.num_pending} pending, "
                f"{len(self._bound)} requests bound"
            )
        self.check_scope = {"blocks": [start, stop], "of": len(blocks), "holders": holders}
        return problems

    def _check_all_blocks(self, problems: list[str]) -> int:
        """Every block against the queue's own walk; the blocks in use."""
        free = {b.block_id for b in self.queue.get_all_free_blocks()}
        in_use = 0
        for block in self.pool.blocks:
            if block.is_null:
                continue
            in_use += block.ref_cnt > 0
            if (block.ref_cnt == 0) != (block.block_id in free):
                where = "in" if block.block_id in free else "not in"
                problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt}, {where} queue")
        real = sum(1 for b in self.pool.blocks if not b.is_null)
        if len(free) + in_use != real:
            problems.append(f"{len(free)} free + {in_use} in use != {real} blocks")
        return in_use

    def _check_blocks(self, blocks: Sequence[Any], problems: list[str]) -> int:
        """``blocks`` against their own queue links; the blocks of them in use."""
        in_use = 0
        for block in blocks:
            if block.is_null:
                continue
            in_use += block.ref_cnt > 0
            queued = self.queue.holds(block)
            if (block.ref_cnt == 0) != queued:
                where = "in" if queued else "not in"
                problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt}, {where} queue")
        return in_use


def affinity_of(pool: Any) -> PoolAffinity | None:
    return getattr(pool, "_jiuwen_affinity", None)


def session_of(request: Any) -> str | None:
    """The request's session (vLLM's ``session_id``, else its ``cache_salt``), scoped to its
    principal; worked out once per request (this runs on every scheduler step)."""
    try:
        return request._jiuwen_session  # type: ignore[no-any-return]
    except AttributeError:
        pass
    session = getattr(request, "session_id", None) or getattr(request, "cache_salt", None)
    if session:
        principal = keys_of(request).principal
        if principal:
            session = scoped(principal, session)
    request._jiuwen_session = session
    return session
