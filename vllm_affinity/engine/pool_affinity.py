"""The engine's per-pool state, behind one door (``PoolAffinity``): what ``patches.py`` attaches
to vLLM's ``BlockPool`` and calls from its wraps and utilities.

The door holds the pool's parts, each in a module of its own (``docs/architecture.md``):

- ``pool_context.PoolContext``: the state more than one part reads;
- ``bindings.Bindings``: the session tables and the blocks each step binds (per step);
- ``releases.Releases``: releases, rewrites, retries, restores (per event);
- ``families.Families``: idles, subagents' ends, waiting leads (per event);
- ``picker.ReturnPicker``: the predicted-return picker (per pop, while on);
- ``pool_reports.PoolReports``: stats and the invariant check (per refresh, per check).

``PoolAffinity`` answers with the protocol's models (``EngineRelease``, ``EngineIdle``,
``EngineRestore``, ``EngineStats``); the utilities turn them into plain dicts only at the
process boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jiuwen_kv_protocol.models import (
    COUNTER_NAMES,
    GROUP_COUNTERS,
    EngineIdle,
    EngineRelease,
    EngineRestore,
    EngineStats,
    GroupStats,
    ReleaseMode,
)

from ..core import SegmentedFreeBlockQueue, SessionBlocks
from ..core.block_states import BlockStates
from ..core.compaction import owner_of, retried_branch, side_branch
from ..core.counters import Counters
from ..core.groups import KVGroup
from ..core.idle_guard import IdleGuard
from ..core.returns import ReturnPredictor
from ..core.siblings import SiblingStarts
from ..core.subagents import Subagents
from ..core.tenants import scoped
from ..settings import Settings
from .bindings import Bindings, StepBind
from .checkpoints import InstructionCheckpoints, has_sparse_groups
from .fail_open import ERRORS
from .families import Families
from .picker import ReturnPicker
from .pool_context import OffloadTier, PoolContext
from .pool_reports import PoolReports
from .releases import Releases
from .request_view import keys_of


class PoolAffinity:
    """Per-``BlockPool`` state: the segmented queue (also ``pool.free_block_queue``), one
    session table per KV-cache group (``core/groups.py``), and which blocks of each running
    request are already bound; every call goes to the part that does it.

    Until the ``KVCacheManager`` names the groups (``attach_groups``), the pool is taken to have
    one group at the hash block size, as a Llama-style model has."""

    def __init__(self, pool: Any, settings: Settings | None = None) -> None:
        settings = settings or Settings()
        self.pool = pool
        self.queue = SegmentedFreeBlockQueue(
            pool.free_block_queue.get_all_free_blocks(), capacity=len(pool.blocks)
        )
        pool.free_block_queue = self.queue
        from vllm.v1.core.kv_cache_utils import get_block_hash

        self.counters = Counters(COUNTER_NAMES)
        self._ctx = PoolContext(
            pool=pool,
            queue=self.queue,
            counters=self.counters,
            strip_group=get_block_hash,
            max_sessions=settings.max_sessions,
            null_id=pool.null_block.block_id,
            subagents=Subagents(settings.max_sessions),
            siblings=SiblingStarts(),
            child_end=settings.child_end,
        )
        self.subagents, self.siblings = self._ctx.subagents, self._ctx.siblings
        self.bindings = Bindings(self._ctx)
        self.releases = Releases(self._ctx, self.bindings)
        self.families = Families(self._ctx, self.bindings, self.releases)
        self.picker = ReturnPicker(self._ctx, self.bindings)
        self.reports = PoolReports(self._ctx, self.bindings)
        self._checkpoints = settings.checkpoints
        # the picker is part of the session lifecycle: release-only mode is LRU's order; None:
        # ``auto``, on until the groups say the model is hybrid (``attach_groups``)
        self._picker = settings.predict_return if settings.lifecycle else False
        self.attach_groups((KVGroup(0, "full_attention", pool.hash_block_size),))
        self._ctx.idle_guard = IdleGuard(settings.max_sessions) if settings.idle_guard else None
        self.predict_returns(
            self._picker is True or (self._picker is None and len(self.groups) == 1)
        )
        self._ctx.protect_cap = int(settings.protect_share * pool.num_gpu_blocks)
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
        self._ctx.groups = groups
        self.bindings.attach(groups)
        #: The instructions' checkpoints of a model with a sliding-window or Mamba group.
        self.checkpoints = (
            InstructionCheckpoints(self.queue, groups, self.counters, self._ctx.max_sessions)
            if self._checkpoints and has_sparse_groups(groups)
            else None
        )
        if self._picker is None and len(groups) > 1:
            self.predict_returns(False)  # ``auto`` on a hybrid model: LRU's order
        self._ctx.group_counts = [dict.fromkeys(GROUP_COUNTERS, 0) for _ in groups]

    def attach_tier(self, tier: OffloadTier) -> None:
        """An offloader copies this pool's blocks to ``tier`` (``offload.py``): a release tells
        it which copies are dead too. The predicted-return picker, on by ``auto``, goes off:
        its bets evict the deep blocks of sessions due back last, which the tier held longest
        (a GPU hit does not refresh a tier copy) and may have dropped, where LRU's victims
        mostly load back (the Claude Code trace on a 32B pool with a CPU tier: 160 tokens
        more computed than vanilla with it, 448 fewer without)."""
        self._ctx.tiers.append(tier)
        if self._picker is None and self._ctx.returns is not None:
            self.predict_returns(False)

    def predict_returns(self, on: bool) -> None:
        """Turn the predicted-return picker on (a fresh predictor) or off (LRU's victims)."""
        self._ctx.returns = ReturnPredictor(self._ctx.max_sessions) if on else None
        self._ctx.wait_guard = IdleGuard(self._ctx.max_sessions) if on else None
        self.queue.set_picker(self.pick if on else None)

    # -- the shared state, read (and set, where patches or tests do) through the door

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        return self._ctx.groups

    @property
    def returns(self) -> ReturnPredictor | None:
        return self._ctx.returns

    @property
    def wait_guard(self) -> IdleGuard | None:
        return self._ctx.wait_guard

    @property
    def idle_guard(self) -> IdleGuard | None:
        return self._ctx.idle_guard

    @idle_guard.setter
    def idle_guard(self, guard: IdleGuard | None) -> None:
        self._ctx.idle_guard = guard

    @property
    def protect_cap(self) -> int:
        return self._ctx.protect_cap

    @protect_cap.setter
    def protect_cap(self, cap: int) -> None:
        self._ctx.protect_cap = cap

    @property
    def engine_ns(self) -> int:
        return self._ctx.engine_ns

    @engine_ns.setter
    def engine_ns(self, ns: int) -> None:
        self._ctx.engine_ns = ns

    @property
    def steps(self) -> int:
        return self._ctx.steps

    @steps.setter
    def steps(self, steps: int) -> None:
        self._ctx.steps = steps

    @property
    def request_blocks(self) -> Callable[[str], Sequence[list[Any]]] | None:
        return self.bindings.request_blocks

    @request_blocks.setter
    def request_blocks(self, blocks: Callable[[str], Sequence[list[Any]]] | None) -> None:
        self.bindings.request_blocks = blocks

    @property
    def tables(self) -> tuple[SessionBlocks, ...]:
        """One session table per group, the blocks handed out so far unbound in them."""
        return self.bindings.tables

    @property
    def block_states(self) -> BlockStates:
        return self.bindings.block_states

    @property
    def sessions(self) -> SessionBlocks:
        return self.bindings.sessions

    @property
    def check_scope(self) -> dict[str, Any]:
        return self.reports.check_scope

    # -- per step (``bindings.py``)

    def forget_bindings(self) -> None:
        self.bindings.forget()

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
    ) -> StepBind | None:
        return self.bindings.take_scheduled(
            session, request_id, block_ids, prompt, appended, decoded
        )

    def bind_taken(self, binds: Sequence[StepBind | None]) -> None:
        self.bindings.bind_taken(binds)

    def blocks_handed_out(self, blocks: Sequence[Any]) -> None:
        self.bindings.blocks_handed_out(blocks)

    def bind_request(
        self, session: str, request_id: str, blocks: Sequence[list[Any]], prompt: int
    ) -> None:
        self.bindings.bind_request(session, request_id, blocks, prompt)

    def request_done(self, session: str, request_id: str) -> None:
        self.bindings.request_done(session, request_id)

    # -- per event (``releases.py``, ``families.py``)

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
                family = self.families.sibling_family(parent, keys.head, request.block_hashes)
                self.siblings.observe(family, request.block_hashes)
            self.families.apply_family(self.subagents.call(session, parent, keys.head, family))
        if session == side_branch(owner_of(session)):
            self.releases.note_side_head(session, keys.head)
        retried = retried_branch(session)
        if keys.retry:
            for table in self.tables:  # the replaced window waits apart for the next one
                table.move(session, retried)
        elif retried in self.sessions.latest and not keys.rewrite:
            self.releases.settle_retry(retried, request.block_hashes)
        if keys.rewrite:
            self.release_rewritten(session, request.block_hashes, keys.head)
        elif keys.hint:
            self.release_divergent(session, request.block_hashes, "in_request")
        elif release_on_divergence and session in self.sessions.latest:
            self.release_divergent(session, request.block_hashes, "divergence")

    def release(self, session: str, first_block: int, mode: ReleaseMode = "post") -> EngineRelease:
        return self.releases.release(session, first_block, mode)

    def release_divergent(
        self,
        session: str,
        chain: list[Any],
        mode: ReleaseMode,
        require_common_prefix: bool = False,
        also: Sequence[Any] = (),
        keep_tokens: int = 0,
    ) -> EngineRelease:
        return self.releases.release_divergent(
            session, chain, mode, require_common_prefix, also, keep_tokens
        )

    def release_rewritten(self, session: str, chain: list[Any], head: int = 0) -> EngineRelease:
        return self.releases.release_rewritten(session, chain, head)

    def restore_divergent(self, session: str, chain: list[Any]) -> EngineRestore:
        return self.releases.restore_divergent(session, chain)

    def idle_session(
        self, session: str, ends_task: bool = True, next_use: float | None = None
    ) -> EngineIdle:
        return self.families.idle_session(session, ends_task, next_use)

    # -- per pop, while the picker is on (``picker.py``)

    def pick(self, take: int) -> tuple[int, list[Any]]:
        return self.picker.pick(take)

    # -- per refresh and per check (``pool_reports.py``)

    def group_stats(self, exact: bool = False, bindings: int | None = None) -> list[GroupStats]:
        return self.reports.group_stats(exact, bindings)

    def spent_in_utility(self, ns: int) -> None:
        self.reports.spent_in_utility(ns)

    def stats(self, exact: bool = False) -> EngineStats:
        return self.reports.stats(exact)

    def check(self, idle: bool, bounded: bool = False) -> list[str]:
        return self.reports.check(idle, bounded)


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
