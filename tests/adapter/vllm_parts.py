"""Real vLLM KV-cache classes without a model: a KVCacheManager over one full-attention group,
and requests hashed with vLLM's own block hasher (for the adapter tests)."""

from __future__ import annotations

import itertools
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from vllm_affinity.testing import kv_cache_manager
from vllm_affinity.testing.scheduling import bind_as_scheduled

BLOCK = 16
_ids = itertools.count()
init_none_hash(sha256)
_hasher = get_request_block_hasher(BLOCK, sha256)


def make_manager(num_blocks: int, block_size: int = BLOCK) -> KVCacheManager:
    return kv_cache_manager(num_blocks, block_size)


def make_request(tokens: list[int], session: str | None = None, **kw: Any) -> Request:
    kw.setdefault("sampling_params", SamplingParams(max_tokens=16))
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=tokens,
        pooling_params=None,
        block_hasher=_hasher,
        session_id=session,
        **kw,
    )


def run_prefill(manager: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does for a new request: look up the prefix, allocate, cache.
    Returns the request's block ids."""
    computed, num_computed = manager.get_computed_blocks(request)[:2]
    num_new = request.num_tokens - num_computed
    blocks = manager.allocate_slots(request, num_new, num_computed, computed)
    assert blocks is not None, "out of KV blocks"
    bind_as_scheduled(manager, request, blocks, first=True)  # the step's output
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_tokens)
    return list(manager.get_block_ids(request.request_id)[0])


def generate(manager: KVCacheManager, request: Request, n: int, token: int = 7) -> None:
    """Append ``n`` decoded tokens, allocating blocks as a running request would."""
    for _ in range(n):
        request.append_output_token_ids(token)
        blocks = manager.allocate_slots(request, 1)
        bind_as_scheduled(manager, request, blocks, first=False)
        request.num_computed_tokens += 1
        manager.cache_blocks(request, request.num_computed_tokens)


def tokens(start: int, n_blocks: int) -> list[int]:
    """``n_blocks`` full blocks of distinct tokens from ``start``."""
    return list(range(start, start + n_blocks * BLOCK))


def state_of(manager: KVCacheManager) -> Any:
    """The plugin's ``PoolAffinity`` of a manager's block pool."""
    from vllm_affinity.engine import affinity_of

    state = affinity_of(manager.block_pool)
    assert state is not None
    return state


def make_hybrid_manager(
    num_blocks: int,
    specs: list[Any],
    hash_block_size: int = BLOCK,
    scheduler_block_size: int = 0,
    retention_interval: int | None = None,
) -> KVCacheManager:
    """A KVCacheManager over several KV-cache groups (one per spec), as vLLM builds it for a
    hybrid model: one block pool, one single-type manager per group. ``retention_interval``:
    ``None`` keeps every sliding-window block (the config's default); 0, a server's default,
    keeps state only at prompt ends and junctions."""
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
        prefix_cache_retention_interval=retention_interval,
    )
    return KVCacheManager(
        config,
        max_model_len=4096,
        scheduler_block_size=scheduler_block_size or max(s.block_size for s in specs),
        hash_block_size=hash_block_size,
        enable_caching=True,
    )


def group_block_ids(manager: KVCacheManager, request: Request) -> tuple[list[int], ...]:
    """The request's block ids, one list per group (0 where vLLM holds the null block)."""
    return tuple(list(ids) for ids in manager.get_block_ids(request.request_id))
