"""vLLM adapter, engine side: thin wrapt patches of small methods plus two ``EngineCore`` utilities.

- ``BlockPool.__init__``: swap in the three-segment queue and attach a ``PoolAffinity``.
- ``BlockPool.get_new_blocks``: blocks handed out for new content lose their session owners.
- ``KVCacheManager.allocate_slots`` / ``free`` / ``pop_blocks_for_free``: bind a request's blocks
  (prefix hits and new ones) to its session (``session_id``, else ``cache_salt``).
- ``EngineCore.affinity_release`` / ``affinity_stats``: called from the API server through
  ``call_utility_async``; they run inside the engine-core process between scheduler steps, so
  no locking against the scheduler is needed.

All of vLLM's own method bodies stay untouched.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import wrapt

from .compat import check_supported_vllm
from .core import ReleaseResult, SegmentedFreeBlockQueue, SessionBlocks

_applied = False


class PoolAffinity:
    """Per-``BlockPool`` state: the segmented queue (also ``pool.free_block_queue``), the session
    table, and which blocks of each running request are already bound."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.queue = SegmentedFreeBlockQueue(pool.free_block_queue.get_all_free_blocks())
        pool.free_block_queue = self.queue
        self.sessions = SessionBlocks()
        self._bound: dict[str, int] = {}
        self.counters: Counter[str] = Counter()

    def bind_request(self, session: str, request_id: str, blocks: list[Any], prompt: int) -> None:
        """Bind the request's blocks not bound yet; record them as the session's latest."""
        already = self._bound.get(request_id, 0)
        if len(blocks) == already:
            return
        new_ids = [b.block_id for b in blocks[already:] if not b.is_null]
        self.sessions.bind(session, new_ids)
        for block_id in new_ids:  # a live user again: must not go to RELEASED when freed
            self.queue.cancel_pending(block_id)
        self._bound[request_id] = len(blocks)
        self.sessions.record(session, [b.block_id for b in blocks if not b.is_null], prompt)

    def request_done(self, request_id: str) -> None:
        self._bound.pop(request_id, None)

    def release(
        self, session: str, first_block: int, prompt_tokens: int | None = None
    ) -> dict[str, Any]:
        selection = self.sessions.select_release(session, first_block, prompt_tokens)
        results = Counter(self.queue.release(self.pool.blocks[b]) for b in selection.block_ids)
        moved, pending = results[ReleaseResult.MOVED], results[ReleaseResult.PENDING]
        self.counters["releases"] += 1
        self.counters[f"releases_{selection.status}"] += 1
        self.counters["blocks_moved"] += moved
        self.counters["blocks_pending"] += pending
        return {
            "status": selection.status,
            "block_released": moved + pending,
            "moved": moved,
            "pending": pending,
            "kept_shared": selection.kept_shared,
        }

    def stats(self) -> dict[str, Any]:
        return {
            "segments": self.queue.segment_sizes(),
            "pending": self.queue.num_pending,
            "released_reused": self.queue.released_reused,
            "sessions": len(self.sessions.latest),
            "num_blocks": self.pool.num_gpu_blocks,
            **dict(self.counters),
        }


def affinity_of(pool: Any) -> PoolAffinity | None:
    return getattr(pool, "_jiuwen_affinity", None)


def _session_of(request: Any) -> str | None:
    return getattr(request, "session_id", None) or getattr(request, "cache_salt", None)


def _bind(manager: Any, request: Any) -> PoolAffinity | None:
    state = affinity_of(manager.block_pool)
    session = _session_of(request)
    if state is not None and session:
        blocks = manager.coordinator.get_blocks(request.request_id)[0]
        state.bind_request(session, request.request_id, blocks, request.num_prompt_tokens)
    return state


# -- wrappers --------------------------------------------------------------------------------


def _block_pool_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
    wrapped(*args, **kwargs)
    instance._jiuwen_affinity = PoolAffinity(instance)


def _get_new_blocks(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    blocks = wrapped(*args, **kwargs)
    state = affinity_of(instance)
    if state is not None:
        state.sessions.unbind(b.block_id for b in blocks)
    return blocks


def _allocate_slots(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    result = wrapped(*args, **kwargs)
    if result is not None:
        request = args[0] if args else kwargs["request"]
        _bind(instance, request)
    return result


def _free(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    request = args[0] if args else kwargs["request"]
    state = _bind(instance, request)
    try:
        return wrapped(*args, **kwargs)
    finally:
        if state is not None:
            state.request_done(request.request_id)


def _engine_state(engine_core: Any) -> PoolAffinity:
    state = affinity_of(engine_core.scheduler.kv_cache_manager.block_pool)
    if state is None:
        raise RuntimeError("vllm_affinity: the engine's BlockPool was created without the plugin")
    return state


def affinity_release(
    self: Any, session: str, first_block: int, prompt_tokens: int | None = None
) -> dict[str, Any]:
    """EngineCore utility: release ``session``'s blocks from ``first_block`` on."""
    return _engine_state(self).release(session, int(first_block), prompt_tokens)


def affinity_stats(self: Any) -> dict[str, Any]:
    """EngineCore utility: segment sizes and counters."""
    return _engine_state(self).stats()


def apply_engine_patches() -> None:
    """Idempotent: general plugins load in every vLLM process, some more than once."""
    global _applied
    if _applied:
        return
    check_supported_vllm()
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.engine.core import EngineCore

    wrapt.wrap_function_wrapper(BlockPool, "__init__", _block_pool_init)
    wrapt.wrap_function_wrapper(BlockPool, "get_new_blocks", _get_new_blocks)
    wrapt.wrap_function_wrapper(KVCacheManager, "allocate_slots", _allocate_slots)
    wrapt.wrap_function_wrapper(KVCacheManager, "free", _free)
    wrapt.wrap_function_wrapper(KVCacheManager, "pop_blocks_for_free", _free)
    EngineCore.affinity_release = affinity_release
    EngineCore.affinity_stats = affinity_stats
    _applied = True
