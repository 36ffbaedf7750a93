"""vLLM's real ``KVCacheManager`` (and its ``BlockPool``) with no model and no server: the
adapter tests' and the engine benchmarks' pool."""

from __future__ import annotations

from typing import Any


def kv_cache_manager(num_blocks: int, block_size: int = 16, max_model_len: int = 4096) -> Any:
    """vLLM's real ``KVCacheManager`` over one full-attention group, with no model (prefix
    caching on): what the adapter tests and ``benchmarks/engine/picker_cost.py`` drive."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=True,
    )
