"""The engine room's shared state (``PoolContext``): what every part of ``PoolAffinity`` reads.

Each part (``bindings.py``, ``releases.py``, ``families.py``, ``picker.py``,
``pool_reports.py``) holds the one context of its pool and reads from it at each use, never a
copy: the groups, their counts, the picker's predictor and the guards are replaced while vLLM
runs (``PoolAffinity.attach_groups``, ``predict_returns``; tests set the guards), and the
engine time is a running sum."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core import SegmentedFreeBlockQueue
from ..core.counters import Counters
from ..core.groups import KVGroup
from ..core.idle_guard import IdleGuard
from ..core.returns import ReturnPredictor
from ..core.siblings import SiblingStarts
from ..core.subagents import Subagents


class OffloadTier(Protocol):
    """A tier the pool's blocks are copied to (``offload.py``): told of the released blocks'
    hashes, it reuses their copies first; answers how many it moved."""

    def release(self, block_hashes: Sequence[Any]) -> int: ...


@dataclass(slots=True)
class PoolContext:
    """One ``BlockPool``'s plugin state that more than one part reads.

    Set once: the pool, its segmented queue (``pool.free_block_queue``), the counters, the
    caps and the families. Replaced while vLLM runs (read at each use): the groups and their
    counts, the predictor and the guards, the PROTECTED cap; summed: the engine time."""

    pool: Any
    queue: SegmentedFreeBlockQueue
    counters: Counters
    #: vLLM's ``get_block_hash``: a block hash without its group id.
    strip_group: Callable[[Any], Any]
    max_sessions: int
    #: vLLM's null block (a sliding window's dropped positions): a HOLE in the records.
    null_id: int
    subagents: Subagents
    siblings: SiblingStarts
    #: ``VLLM_AFFINITY_CHILD_END``: what a subagent's end does to its blocks.
    child_end: str
    groups: tuple[KVGroup, ...] = ()
    #: Per group, its counters (``GROUP_COUNTERS``).
    group_counts: list[dict[str, int]] = field(default_factory=list)
    #: The predicted-return picker's predictor and the waiting leads' guard (None: LRU's order).
    returns: ReturnPredictor | None = None
    wait_guard: IdleGuard | None = None
    idle_guard: IdleGuard | None = None
    #: Most blocks the PROTECTED segment may hold (waiting parents' blocks); 0: off.
    protect_cap: int = 0
    #: Nanoseconds the plugin spent on the scheduler's path (``patches.py``' wrappers and the
    #: picker) and the scheduler steps run: ``/metrics`` shows the time per step.
    engine_ns: int = 0
    steps: int = 0
    #: Where the pool's blocks are copied to (an offloader's CPU tier): told of releases.
    tiers: list[OffloadTier] = field(default_factory=list)
