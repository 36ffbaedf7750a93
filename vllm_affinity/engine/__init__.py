"""The engine-core process: what runs inside vLLM's scheduler.

- ``patches``: the thin wrapt patches of vLLM's ``BlockPool``, ``KVCacheManager``, ``Scheduler``
  and ``EngineCore`` (the adapter; ``apply_engine_patches``);
- ``pool_affinity``: the per-pool state those patches act on (``PoolAffinity``), the door to
  its parts: ``bindings`` (per step), ``releases`` and ``families`` (per event), ``picker``
  (per pop), ``pool_reports`` (stats and checks), over ``pool_context``;
- ``checkpoints``: a hybrid model's instruction checkpoints.

Nothing here imports the API server's modules: the two processes share only ``core`` (the
request keys included) and ``settings``."""

from ..core.request_keys import (
    HEAD_KEY,
    HINT_KEY,
    NEXT_USE_KEY,
    PARENT_KEY,
    PRINCIPAL_KEY,
    RESERVED_KEYS,
    RETRY_KEY,
    REWRITE_KEY,
)
from .patches import (
    apply_engine_patches,
    bind_step,
    cached_block_hashes,
    describe_groups,
    event_hash_text,
)
from .pool_affinity import PoolAffinity, affinity_of, session_of

__all__ = [
    "HEAD_KEY",
    "HINT_KEY",
    "NEXT_USE_KEY",
    "PARENT_KEY",
    "PRINCIPAL_KEY",
    "RESERVED_KEYS",
    "RETRY_KEY",
    "REWRITE_KEY",
    "PoolAffinity",
    "affinity_of",
    "apply_engine_patches",
    "bind_step",
    "cached_block_hashes",
    "describe_groups",
    "event_hash_text",
    "session_of",
]
