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

Fail open: a failure here is counted under ``offload`` and the offloader goes on as vLLM's.
"""

from __future__ import annotations

import logging
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
    """Wrap the simple offloader's scheduler side, where this vLLM has it."""
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
