"""vLLM adapter, engine side: thin wrapt patches of small methods plus two ``EngineCore`` utilities.

- ``BlockPool.__init__``: swap in the segmented queue and attach a ``PoolAffinity``
  (``pool_affinity.py``: the state and every path that acts on it). Blocks the pool hands out
  for new content (``get_new_blocks``, through the queue's ``popleft_n``) are held by no session
  any more: the queue's handout hook says so, with no wrap of vLLM's method.
- ``Scheduler.schedule``: bind the blocks each step hands the workers (a new request's prefix
  hits and new blocks, a running request's new ones, as vLLM's ``SchedulerOutput`` lists them)
  to the request's session (``session_id``, else ``cache_salt``); ``KVCacheManager.free`` /
  ``pop_blocks_for_free``: bind what no output listed, before vLLM frees the blocks.
- ``KVCacheManager.get_computed_blocks``: on a hybrid model, a request's instructions' end
  becomes its junction, where vLLM keeps the sliding-window and Mamba state
  (``checkpoints.py``); where every sparse group is a sliding window, the engine's
  coordinator's ``cache_blocks`` (that instance only) keeps the window at a session's answer end.
- ``Scheduler.add_request``: an in-request release (the ``X-KV-Release`` hint, carried in the
  request's ``sampling_params.extra_args``) acts here, before the request is scheduled, so the
  blocks it releases can serve that very request's allocation. A request naming its parent
  session (``kv_parent``) starts protecting the parent's blocks (``core/subagents.py``).
- ``EngineCore.affinity_release_prompt`` / ``affinity_session_idle`` / ``affinity_stats`` /
  ``affinity_check`` / ``affinity_classify_window`` (the compaction rule, when several API
  servers share the engine) / ``affinity_chain_of`` / ``affinity_record_answer`` (the implicit
  sessions' table, likewise): called from the API server through
  ``call_utility_async``; they run inside the engine-core process between scheduler steps, so
  no locking against the scheduler is needed. They turn ``PoolAffinity``'s answers (the
  protocol's models) into plain dicts, at the process boundary.

Both release paths end in one rule: the session's latest request's blocks from the first one whose
hash differs from a prompt's block-hash chain (the new request's own, or the rendered cut of the
old window) are released.

All of vLLM's own method bodies stay untouched.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

import wrapt

from jiuwen_kv_protocol.models import ReleaseMode

from ..compat import check_supported_vllm
from ..core.answer_chains import Answer, AnswerChains, ChainWindow
from ..core.compaction import AgentWindow, CompactionRule, Window
from ..core.groups import KVGroup, kind_of
from ..settings import Settings
from .fail_open import ERRORS, utility
from .offload import apply_offload_patches
from .pool_affinity import PoolAffinity, affinity_of, session_of

_applied = False
logger = logging.getLogger("vllm_affinity")


def _bind(state: PoolAffinity, session: str, manager: Any, request: Any) -> None:
    blocks = manager.coordinator.get_blocks(request.request_id)
    state.bind_request(session, request.request_id, blocks, request.num_prompt_tokens)


def describe_groups(coordinator: Any) -> tuple[KVGroup, ...]:
    """The coordinator's KV-cache groups that prefix caching covers, at their own block sizes
    (a group that opts out, such as a circular indexer buffer, holds per-request scratch: no
    session keeps it)."""
    hash_block_size = coordinator.block_pool.hash_block_size
    groups = []
    for index, (manager, group) in enumerate(
        zip(
            coordinator.single_type_managers,
            coordinator.kv_cache_config.kv_cache_groups,
            strict=True,
        )
    ):
        spec = group.kv_cache_spec
        if not getattr(spec, "prefix_cacheable", True):
            continue
        block_size = manager.block_size
        window = getattr(spec, "sliding_window", None)
        groups.append(
            KVGroup(
                index,
                kind_of(type(spec).__name__),
                block_size,
                block_size // hash_block_size,
                window if isinstance(window, int) else 0,
            )
        )
    return tuple(groups)


# -- wrappers --------------------------------------------------------------------------------
# Each runs vLLM's own method exactly once and guards its own part (``fail_open.py``): a failure
# of the plugin is counted and logged, and vLLM's answer stands.


def _make_block_pool_init(settings: Settings) -> Any:
    def _block_pool_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
        wrapped(*args, **kwargs)
        try:
            instance._jiuwen_affinity = PoolAffinity(instance, settings)
        except Exception as exc:  # the pool stays vLLM's (the queue works as its own)
            ERRORS.caught("block_pool_init", exc)

    return _block_pool_init


def _kv_cache_manager_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
    """The manager's coordinator knows the model's KV-cache groups: every one is tracked (and
    reported, prefix caching on or not). A layout the plugin cannot read leaves the pool
    vLLM's alone."""
    wrapped(*args, **kwargs)
    state = affinity_of(instance.block_pool)
    if state is None:
        return
    try:
        _attach_manager(state, instance)
    except Exception as exc:
        instance.block_pool._jiuwen_affinity = None  # half known is worse than unknown
        ERRORS.caught("kv_cache_manager_init", exc)


def _attach_manager(state: PoolAffinity, manager: Any) -> None:
    state.request_blocks = manager.coordinator.get_blocks  # a decoding request's, on demand
    groups = describe_groups(manager.coordinator)
    if groups:  # none: a model whose every group opts out of prefix caching (no KV to track)
        state.attach_groups(groups)
        if state.checkpoints is not None and state.checkpoints.answers:
            # this engine's coordinator alone: no other model pays a wrap per allocation
            wrapt.wrap_function_wrapper(manager.coordinator, "cache_blocks", _cache_blocks)
    if not manager.enable_caching or not groups:
        # e.g. vLLM's CPU build turns prefix caching off for MLA models on CPUs without AMX
        logger.warning(
            "vllm_affinity: prefix caching is off on this engine: no prompt can hit a cached "
            "block, so releases have nothing to free (turn prefix caching on to use the plugin)"
        )


def _get_computed_blocks(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """A hybrid model's request may get its instructions' end as its junction
    (``checkpoints.py``); any other request's lookup is vLLM's, at one attribute check."""
    answer = wrapped(*args, **kwargs)
    state = affinity_of(instance.block_pool)
    if state is None or state.checkpoints is None:
        return answer
    start = perf_counter_ns()
    try:
        request = args[0] if args else kwargs["request"]
        return state.checkpoints.on_lookup(instance.coordinator, request, answer)
    except Exception as exc:
        ERRORS.caught("get_computed_blocks", exc)
        return answer
    finally:
        state.engine_ns += perf_counter_ns() - start


def _cache_blocks(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """A session's decoding request on a sliding-window model: its computed end is the
    junction for this call, so the window at its answer's end stays cached
    (``checkpoints.py``); vLLM's own call either way, its junction put back after. Wraps the
    coordinator of a model whose sparse groups are all sliding windows (``_attach_manager``)."""
    state = affinity_of(instance.block_pool)
    if state is None or state.checkpoints is None or not state.checkpoints.answers:
        return wrapped(*args, **kwargs)
    point = 0
    try:
        request = args[0] if args else kwargs["request"]
        tokens = args[1] if len(args) > 1 else kwargs["num_computed_tokens"]
        if session_of(request):
            point = state.checkpoints.return_point(instance, request, tokens)
    except Exception as exc:
        ERRORS.caught("cache_blocks", exc)
    if not point:
        return wrapped(*args, **kwargs)
    junction = request.shared_prefix_boundary
    request.shared_prefix_boundary = point
    try:
        return wrapped(*args, **kwargs)
    finally:
        request.shared_prefix_boundary = junction


def _free(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    state = affinity_of(instance.block_pool)
    if state is None:
        return wrapped(*args, **kwargs)
    start = perf_counter_ns()
    session = None
    try:
        request = args[0] if args else kwargs["request"]
        session = session_of(request)
        if session:
            _bind(state, session, instance, request)  # the blocks as they are, before vLLM frees
    except Exception as exc:
        session = None
        state.forget_bindings()  # what the tables knew of the request may be wrong now
        ERRORS.caught("free", exc)
    state.engine_ns += perf_counter_ns() - start
    try:
        return wrapped(*args, **kwargs)
    finally:
        if session:
            start = perf_counter_ns()
            try:
                state.request_done(session, request.request_id)
            except Exception as exc:
                state.forget_bindings()
                ERRORS.caught("free", exc)
            state.engine_ns += perf_counter_ns() - start


def _make_add_request(settings: Settings) -> Any:
    def _add_request(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        manager = getattr(instance, "kv_cache_manager", None)
        state = affinity_of(manager.block_pool) if manager is not None else None
        if state is not None:
            start = perf_counter_ns()
            try:
                request = args[0] if args else kwargs["request"]
                if request.request_id not in instance.requests:
                    state.on_new_request(request, settings.release_on_divergence)
            except Exception as exc:  # the request is served unhinted
                ERRORS.caught("add_request", exc)
            state.engine_ns += perf_counter_ns() - start
        return wrapped(*args, **kwargs)

    return _add_request


def _schedule(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """Counts the scheduler's steps (the plugin's time per step is its time over them) and
    binds the blocks the step hands the workers to their sessions (``bind_scheduled``)."""
    output = wrapped(*args, **kwargs)
    manager = getattr(instance, "kv_cache_manager", None)
    state = affinity_of(manager.block_pool) if manager is not None else None
    if state is not None:
        state.steps += 1
        start = perf_counter_ns()
        try:
            bind_step(state, instance.requests, output)
        except Exception as exc:  # the step's blocks stay unbound: no session holds them
            state.forget_bindings()
            ERRORS.caught("schedule", exc)
        state.engine_ns += perf_counter_ns() - start
    return output


def bind_step(state: PoolAffinity, requests: Any, output: Any) -> None:
    """Bind what a scheduler step's output (vLLM's ``SchedulerOutput``) gives each request of
    a session: a new or resumed request's whole block lists, a running request's new blocks.
    Every request is taken before any is bound (``PoolAffinity.take_scheduled``). A decode
    step that gave no request a block costs a count of its ``None`` entries."""
    binds = []
    for new in output.scheduled_new_reqs:
        request = requests.get(new.req_id)
        session = session_of(request) if request is not None else None
        if session:
            binds.append(
                state.take_scheduled(
                    session, new.req_id, new.block_ids, request.num_prompt_tokens, appended=False
                )
            )
    cached = output.scheduled_cached_reqs
    new_block_ids = cached.new_block_ids
    if new_block_ids.count(None) != len(new_block_ids):  # else a decode step (most): no block
        resumed = cached.resumed_req_ids
        for req_id, block_ids in zip(cached.req_ids, new_block_ids, strict=True):
            if block_ids is None:
                continue
            request = requests.get(req_id)
            session = session_of(request) if request is not None else None
            if session:
                binds.append(
                    state.take_scheduled(
                        session, req_id, block_ids, request.num_prompt_tokens,
                        appended=req_id not in resumed,
                        decoded=request.num_computed_tokens - request.num_prompt_tokens,
                    )
                )  # fmt: skip
    if binds:
        state.bind_taken(binds)


def _timed(function: Callable[..., Any]) -> Callable[..., Any]:
    """An engine utility whose time counts in the plugin's engine time (it holds up the next
    scheduler step as long as it runs)."""

    @functools.wraps(function)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = perf_counter_ns()
        try:
            return function(self, *args, **kwargs)
        finally:
            try:
                state = affinity_of(self.scheduler.kv_cache_manager.block_pool)
            except AttributeError:  # no scheduler yet: nothing to count in
                state = None
            if state is not None:
                state.spent_in_utility(perf_counter_ns() - start)

    return timed


def _engine_state(engine_core: Any) -> PoolAffinity:
    state = affinity_of(engine_core.scheduler.kv_cache_manager.block_pool)
    if state is None:
        raise RuntimeError("vllm_affinity: the engine's BlockPool was created without the plugin")
    return state


def affinity_release_prompt(
    self: Any,
    session: str,
    prompt_token_ids: list[int],
    cache_salt: str | None,
    protocol: ReleaseMode = "post",
    keep_tokens: int = 0,
) -> dict[str, Any]:
    """EngineCore utility for ``POST /release_kv_cache`` (and openJiuwen's ``agent_hint``
    evict/offload, ``protocol="agent_hint"``): ``prompt_token_ids`` is the old window rendered up
    to the released message. Its block hashes, computed by the engine's own hasher with the salt
    the chat requests used, are compared with the session's cached blocks."""
    chain = _block_hashes(self, prompt_token_ids, cache_salt)
    return (
        _engine_state(self)
        .release_divergent(
            session, chain, protocol, require_common_prefix=True, keep_tokens=keep_tokens
        )
        .model_dump()
    )


def affinity_restore_prompt(
    self: Any, session: str, prompt_token_ids: list[int], cache_salt: str | None
) -> dict[str, Any]:
    """EngineCore utility for openJiuwen's ``prefetch`` (see ``PoolAffinity.restore_divergent``)."""
    chain = _block_hashes(self, prompt_token_ids, cache_salt)
    return _engine_state(self).restore_divergent(session, chain).model_dump()


def _block_hashes(engine_core: Any, prompt_token_ids: list[int], cache_salt: str | None) -> Any:
    """The block hashes vLLM would give a request with this prompt and salt."""
    hasher = getattr(engine_core, "request_block_hasher", None)
    if hasher is None:
        raise RuntimeError("vllm_affinity: prefix caching is disabled on this engine")
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    probe = Request(
        request_id="vllm-affinity-release",
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=hasher,
    )
    return probe.block_hashes


def affinity_session_idle(
    self: Any, session: str, ends_task: bool = True, next_use: float | None = None
) -> dict[str, Any]:
    """EngineCore utility: the session's last call ended waiting on its user (see
    ``core/lifecycle.py``; ``next_use``: the agent's hint, seconds); sent by the API server
    after the answer, off the request's path."""
    return _engine_state(self).idle_session(session, ends_task, next_use).model_dump()


def _make_classify_window(max_sessions: int) -> Any:
    def affinity_classify_window(self: Any, session: str, window: Any, agent: Any) -> str:
        """EngineCore utility: the compaction rule's verdict on a session's window, judged here
        when the server runs several API servers (``agent_windows.EngineWindows``): this engine
        serves every request of the session. The rule's state is created on first use."""
        rule = getattr(self, "_jiuwen_windows", None)
        if rule is None:
            rule = self._jiuwen_windows = CompactionRule(max_sessions)
        return rule.classify(session, Window.from_wire(window), AgentWindow.from_wire(agent))

    return affinity_classify_window


def _make_chain_utilities(max_sessions: int) -> tuple[Any, Any]:
    """The implicit sessions' table here, when several API servers share the engine
    (``implicit_sessions.EngineChains``); created on first use."""

    def table(engine: Any) -> AnswerChains:
        chains = getattr(engine, "_jiuwen_chains", None)
        if chains is None:
            chains = engine._jiuwen_chains = AnswerChains(max_sessions)
        return chains

    def affinity_chain_of(self: Any, principal: str, window: Any) -> tuple[str, str]:
        """EngineCore utility: the chain of a window of ``principal`` and how the window
        relates to it (``core/answer_chains.py``)."""
        return table(self).chain_of(principal, ChainWindow.from_wire(window))

    def affinity_record_answer(
        self: Any, principal: str, chain: str, answer: Any, main: bool = True
    ) -> None:
        """EngineCore utility: the server answered ``chain``'s request with ``answer``."""
        table(self).record(principal, chain, Answer.from_wire(answer), bool(main))

    return affinity_chain_of, affinity_record_answer


def affinity_check(self: Any, blocks: bool = False) -> dict[str, Any]:
    """EngineCore utility: the invariants, checked between scheduler steps within a bound
    (``PoolAffinity.check``; ``checked`` says what this call covered); with ``blocks``, also
    every cached block's hash per group, as vLLM's KV events spell it (what a KV-aware router's
    view of this engine must equal)."""
    state = _engine_state(self)
    scheduler = self.scheduler
    idle = not scheduler.has_requests()
    problems = state.check(idle, bounded=True)
    exact = state.check_scope["holders"]  # each group's bindings walk every record too
    answer = {
        "idle": idle,
        "problems": problems,
        "checked": state.check_scope,
        **state.stats(exact=exact).model_dump(),
    }
    if blocks:
        answer["cached_blocks"] = cached_block_hashes(state.pool)
    return answer


def event_hash_text(block_hash: Any) -> str:
    """A block hash as vLLM's KV events carry it (bytes, or an int with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), as text for JSON."""
    return block_hash.hex() if isinstance(block_hash, bytes) else str(block_hash)


def cached_block_hashes(pool: Any) -> dict[str, list[str]]:
    """Per KV-cache group, the hashes of the blocks in vLLM's prefix cache."""
    from vllm.v1.core.kv_cache_utils import (
        get_block_hash,
        get_group_id,
        maybe_convert_block_hash,
    )

    out: dict[str, list[str]] = {}
    for key in pool.cached_block_hash_to_block._cache:
        text = event_hash_text(maybe_convert_block_hash(get_block_hash(key)))
        out.setdefault(str(get_group_id(key)), []).append(text)
    return {group: sorted(hashes) for group, hashes in out.items()}


def affinity_stats(self: Any) -> dict[str, Any]:
    """EngineCore utility: segment sizes and counters."""
    return _engine_state(self).stats().model_dump()


def apply_engine_patches() -> None:
    """Idempotent: general plugins load in every vLLM process, some more than once."""
    global _applied
    if _applied:
        return
    check_supported_vllm()
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    settings = Settings.from_env()
    wrapt.wrap_function_wrapper(BlockPool, "__init__", _make_block_pool_init(settings))
    wrapt.wrap_function_wrapper(KVCacheManager, "__init__", _kv_cache_manager_init)
    wrapt.wrap_function_wrapper(KVCacheManager, "get_computed_blocks", _get_computed_blocks)
    wrapt.wrap_function_wrapper(KVCacheManager, "free", _free)
    wrapt.wrap_function_wrapper(KVCacheManager, "pop_blocks_for_free", _free)
    wrapt.wrap_function_wrapper(Scheduler, "add_request", _make_add_request(settings))
    wrapt.wrap_function_wrapper(Scheduler, "schedule", _schedule)
    apply_offload_patches()
    chain_of, record_answer = _make_chain_utilities(settings.max_sessions)
    utilities = {
        "affinity_release_prompt": affinity_release_prompt,
        "affinity_restore_prompt": affinity_restore_prompt,
        "affinity_session_idle": affinity_session_idle,
        "affinity_stats": affinity_stats,
        "affinity_check": affinity_check,
        "affinity_classify_window": _make_classify_window(settings.max_sessions),
        "affinity_chain_of": chain_of,
        "affinity_record_answer": record_answer,
    }
    for name, function in utilities.items():  # a failure is counted, then answered as one
        setattr(EngineCore, name, utility()(_timed(function)))
    _applied = True
