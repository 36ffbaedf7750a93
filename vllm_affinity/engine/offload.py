"""vLLM adapter, engine side: releases and idles survive vLLM's simple CPU offloader
(``v1/simple_kv_offload``: ``--kv-offloading-size`` with ``VLLM_USE_SIMPLE_KV_OFFLOAD=1``, or the
``SimpleCPUOffloadConnector``).

That offloader's CPU tier is a second ``BlockPool``. Its lazy mode walks the GPU's free queue in
eviction order (``iter_blocks_after``) and copies the blocks the GPU will evict next; each copy
holds its block (``BlockPool.touch``: out of the queue) until the copy completes and frees it
(``append_n``). Unwrapped, that copied released blocks first, counted each as a hit of a
released block, and put released and idle blocks back at NORMAL's most-recently-used end. Here:

- the queue's walk leaves RELEASED out (``core/queue_links.py``): a released block is never
  copied;
- ``SimpleCPUOffloadScheduler.prepare_store_specs`` (both modes' copies) runs under the GPU
  queue's ``offloading()``: a marked block it takes is parked, no hit, and goes back to the head
  of its segment when the copy is done; an idle session's blocks near eviction are copied, so
  its return loads them from the CPU tier instead of recomputing them;
- ``bind_gpu_block_pool``: the GPU pool's plugin state learns of the CPU tier, so a release
  also moves the CPU tier's copies of the released blocks (found by hash) to the head of its
  reuse order: the tier drops dead copies before another session's live ones.

The ``OffloadingConnector`` (``--kv-offloading-size``, vLLM's default offloader) stores each
chunk to its CPU tier as it is computed, so a compacted session's dead chunks are there before
any release; its tier evicts by a cache policy (LRU, ARC or one of the user's). Here:

- ``CPUOffloadingManager.__init__``: its policy, whichever, is wrapped in ``StaleFirst``: an
  eviction takes the chunks a release declared dead first, then asks the policy for the rest;
- ``Scheduler.__init__``: the GPU pool's plugin state learns of that policy as a tier: a release
  names the released blocks' hashes, which are the tier's chunk keys (``make_offload_key`` packs
  a block hash and its group as vLLM packs a GPU block's hash; a chunk of several blocks is keyed
  by its last, and a chunk whose last block a release frees can serve no other prompt: the
  plugin releases only blocks no other session holds).

Fail open: a failure here is counted under ``offload`` and the offloader goes on as vLLM's.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import wrapt

from ..core import ReleaseResult, SegmentedFreeBlockQueue
from .fail_open import ERRORS
from .pool_affinity import affinity_of

logger = logging.getLogger("vllm_affinity")

#: The simple offloader's scheduler side (vLLM 0.32 and 0.33).
SIMPLE_OFFLOADER = "vllm.v1.simple_kv_offload.manager"


class CPUBlockTier:
    """An offload tier that is a vLLM ``BlockPool`` (the simple offloader's CPU pool): a
    released GPU block's copy there, if any and unused, goes to the tier's RELEASED."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def release(self, block_hashes: Sequence[Any]) -> int:
        """Release the tier's copies of ``block_hashes`` (vLLM's ``BlockHashWithGroupId``, as
        the GPU pool keys them); how many moved."""
        queue = self.pool.free_block_queue
        if not isinstance(queue, SegmentedFreeBlockQueue):
            return 0
        cached = self.pool.cached_block_hash_to_block
        moved = 0
        for block_hash in block_hashes:
            block = cached.get_one_block(block_hash)
            if block is not None and block.ref_cnt == 0:  # a copy being loaded stays
                moved += queue.release(block) is ReleaseResult.MOVED
        return moved


class StaleFirst(wrapt.ObjectProxy):  # type: ignore[misc]
    """A CPU tier's cache policy (any) whose evictions take the chunks releases declared dead
    first, oldest release first; the rest is the policy's own choice. A chunk a request reads
    or offers again afterwards (the manager's ``touch``, ``on_request_finished``, 0.33's
    ``on_request_access``) is live again. The dead keys it keeps are bounded by the tier's
    capacity (the oldest forgotten first)."""

    def __init__(self, policy: Any) -> None:
        super().__init__(policy)
        self._self_stale: OrderedDict[bytes, None] = OrderedDict()
        self._self_cap = max(1, int(getattr(policy, "cache_capacity", 0) or 0))

    @property
    def stale(self) -> int:
        """Chunks declared dead and not evicted yet (or evicted by the policy's own choice)."""
        return len(self._self_stale)

    def release(self, block_hashes: Sequence[Any]) -> int:
        """Mark the tier's chunks keyed by ``block_hashes`` dead; how many it holds."""
        stale, policy = self._self_stale, self.__wrapped__
        found = 0
        for block_hash in block_hashes:
            if block_hash is not None and policy.get(block_hash) is not None:
                stale[block_hash] = None
                stale.move_to_end(block_hash)
                found += 1
        while len(stale) > self._self_cap:
            stale.popitem(last=False)
        return found

    def _live_again(self, keys: Any) -> None:
        """A request reads or offers these chunks: live again, whatever a release said."""
        stale = self._self_stale
        if stale:
            for key in keys:
                stale.pop(key, None)

    def touch(self, keys: Any, req_context: Any) -> None:
        keys = list(keys)
        self._live_again(keys)
        self.__wrapped__.touch(keys, req_context)

    def on_request_finished(self, key_groups: Any, *args: Any, **kwargs: Any) -> None:
        for keys in key_groups:
            self._live_again(keys)
        self.__wrapped__.on_request_finished(key_groups, *args, **kwargs)

    def on_request_access(self, keys: Any, *args: Any, **kwargs: Any) -> None:
        """vLLM 0.33's access hook (absent in 0.32: called only where the manager has it)."""
        keys = list(keys)
        self._live_again(keys)
        self.__wrapped__.on_request_access(keys, *args, **kwargs)

    def evict(self, n: int, protected: set[Any]) -> list[tuple[Any, Any]] | None:
        """vLLM's contract: exactly ``n`` evictable chunks outside ``protected``, or None and no
        change. The dead ones first (ready, no transfer using them), then the policy's."""
        stale, policy = self._self_stale, self.__wrapped__
        if not stale or n <= 0:
            return policy.evict(n, protected)  # type: ignore[no-any-return]
        picked: list[tuple[Any, Any]] = []
        for key in list(stale):
            if len(picked) == n:
                break
            chunk = policy.get(key)
            if chunk is None:  # evicted by the policy's own choice meanwhile
                del stale[key]
            elif chunk.ref_cnt == 0 and key not in protected:
                picked.append((key, chunk))
        if len(picked) < n:
            rest = policy.evict(n - len(picked), protected | {key for key, _ in picked})
            if rest is None:
                return None
        else:
            rest = []
        for key, _ in picked:
            policy.remove(key)  # out of the policy's structures, as its own evict does
            del stale[key]
        return picked + rest


def _cpu_manager_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
    """The tier's policy, whichever it is, takes dead chunks first."""
    wrapped(*args, **kwargs)
    try:
        instance._policy = StaleFirst(instance._policy)
    except Exception as exc:
        ERRORS.caught("offload", exc)


def _scheduler_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
    """A scheduler with the ``OffloadingConnector``: its GPU pool tells the tier's policy of
    releases."""
    wrapped(*args, **kwargs)
    try:
        connector = getattr(instance, "connector", None)
        manager = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
        policy = getattr(manager, "_policy", None)
        state = affinity_of(instance.kv_cache_manager.block_pool)
        if isinstance(policy, StaleFirst) and state is not None:
            state.attach_tier(policy)
    except Exception as exc:
        ERRORS.caught("offload", exc)


def _gpu_queue(offloader: Any) -> SegmentedFreeBlockQueue | None:
    queue = getattr(getattr(offloader, "_gpu_block_pool", None), "free_block_queue", None)
    return queue if isinstance(queue, SegmentedFreeBlockQueue) else None


def _prepare_store_specs(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """The offloader's copies of this step, its holds parking the marked blocks it takes."""
    try:
        queue = _gpu_queue(instance)
    except Exception as exc:
        ERRORS.caught("offload", exc)
        queue = None
    if queue is None:
        return wrapped(*args, **kwargs)
    with queue.offloading():
        return wrapped(*args, **kwargs)


def _bind_gpu_block_pool(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """The GPU pool's plugin state learns of the offloader's CPU pool."""
    answer = wrapped(*args, **kwargs)
    try:
        pool = args[0] if args else kwargs["gpu_block_pool"]
        state = affinity_of(pool)
        cpu_pool = getattr(instance, "cpu_block_pool", None)
        if state is not None and cpu_pool is not None:
            state.attach_tier(CPUBlockTier(cpu_pool))
    except Exception as exc:
        ERRORS.caught("offload", exc)
    return answer


def apply_offload_patches() -> None:
    """Wrap the offloaders' scheduler sides, where this vLLM has them."""
    from vllm.v1.core.sched.scheduler import Scheduler

    wrapt.wrap_function_wrapper(Scheduler, "__init__", _scheduler_init)
    try:
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except ImportError:
        logger.debug("vllm_affinity: no CPU offloading manager in this vLLM")
    else:
        wrapt.wrap_function_wrapper(CPUOffloadingManager, "__init__", _cpu_manager_init)
    try:
        from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler
    except ImportError:  # a build without it: nothing to wrap
        logger.debug("vllm_affinity: no simple CPU offloader in this vLLM")
        return
    wrapt.wrap_function_wrapper(
        SimpleCPUOffloadScheduler, "prepare_store_specs", _prepare_store_specs
    )
    wrapt.wrap_function_wrapper(
        SimpleCPUOffloadScheduler, "bind_gpu_block_pool", _bind_gpu_block_pool
    )
