"""Offline prefix-cache simulator for a hybrid model: full attention beside sliding-window or
Mamba groups, all drawing from one pool (``simulator.py`` models one group).

What vLLM (0.32, default retention) does, block by block (``HybridModel``: the blocks of every
group have ``block`` tokens, as on the shapes here):

- **Full attention** caches every full block of a prompt.
- **A sparse group** keeps its state only at some *boundaries* (in blocks): a sliding window's
  state at boundary ``b`` is its blocks ``b - window .. b - 1``; a Mamba state at ``b`` is one
  block. A request keeps states at its replay boundary (``(tokens - 1) // block``), at its
  junction (vanilla: where full attention hit further than the sparse groups; the plugin: also
  its instructions' end, the later of the two, ``vllm_affinity/engine/checkpoints.py``) and, with a
  retention interval, every ``interval`` blocks (sliding-window groups only, as vLLM 0.32).
- **A hit** is the longest boundary, within the full-attention hit, at which every sparse
  group holds its state (0 is always one).

Policies: ``lru`` (vanilla), ``interval`` (vanilla with ``interval`` blocks of retention),
``release`` (``lru`` plus the release of a rewritten session's stale blocks in every group, as
the plugin's compaction and in-request paths do), ``checkpoint`` (``release`` plus the
instructions' checkpoint, kept recent by every request that shares it: the plugin on a hybrid
model; its idle segment is left out). The bound beside them: ``belady`` gives the whole pool to
full attention and evicts the block used farthest ahead (``simulator.simulate``); no policy
on the hybrid pool hits more, since a hybrid hit never exceeds full attention's.

Requests are served one at a time; blocks are freed tail first, as vLLM frees them.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_affinity.core import common_prefix_length
from vllm_affinity.core.checkpoints import instructions_end

from .simulator import CapacityError, Request, block_hashes, simulate

HYBRID_POLICIES = ("lru", "interval", "release", "checkpoint")
_RELEASING = ("release", "checkpoint")


@dataclass(frozen=True)
class HybridModel:
    """The KV-cache groups of a hybrid model, as the simulator needs them."""

    #: Tokens per block (every group's here).
    block: int
    #: ``sliding_window`` or ``mamba``.
    sparse_kind: str
    #: How many sparse groups (Gemma 3: one per sliding layer kind; gpt-oss, Qwen3-Next: one).
    sparse_groups: int = 1
    #: A sliding window's blocks before a boundary (its window over the block size, rounded up).
    window_blocks: int = 1

    def __post_init__(self) -> None:
        if self.sparse_kind not in ("sliding_window", "mamba"):
            raise ValueError(f"sparse_kind {self.sparse_kind!r}: sliding_window or mamba")
        if self.block < 1 or self.sparse_groups < 1 or self.window_blocks < 1:
            raise ValueError(f"{self}: block, sparse_groups and window_blocks must be positive")

    def state_positions(self, boundary: int) -> range:
        """The block positions of a sparse group that hold its state at ``boundary``."""
        if boundary <= 0:
            return range(0)
        if self.sparse_kind == "mamba":
            return range(boundary - 1, boundary)
        return range(max(0, boundary - self.window_blocks), boundary)


@dataclass(frozen=True)
class HybridRequest:
    session: str
    tokens: tuple[int, ...]
    #: Leading tokens that are the request's instructions (0: none known).
    instructions: int = 0


class _HybridCache:
    """Blocks of every group in one pool, in one LRU order (a block is keyed by its group and
    its hash: group 0 is full attention, 1.. the sparse groups)."""

    def __init__(self, capacity: int, model: HybridModel, policy: str, interval: int) -> None:
        self.capacity, self.model, self.policy, self.interval = capacity, model, policy, interval
        self.free = capacity
        self.where: dict[tuple[int, int], int] = {}  # (group, hash) → block
        self.key_of: dict[int, tuple[int, int]] = {}
        self.depth_of: dict[int, int] = {}
        self.order: OrderedDict[int, None] = OrderedDict()
        self.released: OrderedDict[int, None] = OrderedDict()
        self.owners: dict[int, set[str]] = {}
        self.latest: dict[str, list[int]] = {}
        self.ids = itertools.count()
        # the tokens a state spans in the pool, summed over the sparse groups
        window = model.window_blocks if model.sparse_kind == "sliding_window" else 1
        self._span = window * model.block * model.sparse_groups

    # -- lookups ------------------------------------------------------------------------------
    def _has_state(self, hashes: Sequence[int], boundary: int) -> bool:
        groups = range(1, self.model.sparse_groups + 1)
        return all(
            (g, hashes[i]) in self.where
            for g in groups
            for i in self.model.state_positions(boundary)
        )

    def hit(self, hashes: Sequence[int], limit: int) -> tuple[int, int]:
        """(the hit in blocks, full attention's own hit in blocks), within ``limit`` blocks."""
        full = 0
        while full < min(limit, len(hashes)) and (0, hashes[full]) in self.where:
            full += 1
        boundary = full
        while boundary > 0 and not self._has_state(hashes, boundary):
            boundary -= 1
        return boundary, full

    # -- the pool -----------------------------------------------------------------------------
    def _evict_one(self) -> None:
        if self.released:
            victim, _ = self.released.popitem(last=False)
        elif self.order:
            victim, _ = self.order.popitem(last=False)
        else:
            raise CapacityError("the pool cannot hold one request")
        del self.where[self.key_of.pop(victim)]
        self.depth_of.pop(victim)
        self.owners.pop(victim, None)
        self.free += 1

    def _take(self, blocks: Sequence[int]) -> None:
        """Blocks a request uses: out of the queue while it runs."""
        for b in blocks:
            self.order.pop(b, None)
            self.released.pop(b, None)

    def refresh(self, hashes: Sequence[int], boundary: int) -> None:
        """A checkpoint a request relied on without a hit: its queued blocks go to the most
        recently used end (``SegmentedFreeBlockQueue.refresh``)."""
        for g in range(1, self.model.sparse_groups + 1):
            for i in self.model.state_positions(boundary):
                b = self.where.get((g, hashes[i]))
                if b is not None and b in self.order:
                    self.order.move_to_end(b)

    def release(self, session: str, first_block: int) -> None:
        for b in self.latest.get(session, []):
            if self.depth_of.get(b, -1) < first_block:
                continue
            owners = self.owners.get(b)
            if owners is None or session not in owners:
                continue
            owners.discard(session)
            if not owners and b in self.order:
                del self.order[b]
                self.released[b] = None

    def serve(self, request: HybridRequest, generated: int) -> int:
        """One request; returns the prompt tokens it hit."""
        block, model = self.model.block, self.model
        hashes = block_hashes(request.tokens, block)
        limit = (len(request.tokens) - 1) // block
        hit, full = self.hit(hashes, limit)
        junction = full if full > hit else 0
        mark = 0
        if self.policy == "checkpoint":  # the plugin's rule: instructions longer than the state
            mark = instructions_end(request.instructions, block, self._span) // block
        if hit < mark and mark * block < len(request.tokens):
            junction = max(junction, mark)
        elif 0 < mark <= hit:
            self.refresh(hashes, mark)
        boundaries = {limit, junction} - {0}
        # vLLM 0.32 applies the interval to sliding-window groups only ("Only SWA acts on it")
        if self.policy == "interval" and self.interval and model.sparse_kind == "sliding_window":
            boundaries |= set(range(self.interval, len(hashes) + 1, self.interval))
        used = [self.where[(0, hashes[i])] for i in range(hit)]
        used += [
            self.where[(g, hashes[i])]
            for g in range(1, model.sparse_groups + 1)
            for i in model.state_positions(hit)
        ]
        self._take(used)
        new_full = [(0, i) for i in range(hit, len(hashes))]
        new_sparse = sorted(
            {
                (g, i)
                for b in boundaries
                if hit < b <= len(hashes)
                for g in range(1, model.sparse_groups + 1)
                for i in model.state_positions(b)
                if (g, hashes[i]) not in self.where
            }
        )
        total = -(-(len(request.tokens) + generated) // block)
        running = (total - len(hashes)) + model.sparse_groups  # uncached tail, running states
        need = len(new_full) + len(new_sparse) + running
        if need + len(used) > self.capacity:
            raise CapacityError(f"a request needs {need + len(used)} blocks, pool {self.capacity}")
        while self.free < need:
            self._evict_one()
        created = []
        for g, i in new_full + new_sparse:
            if (g, hashes[i]) in self.where:  # the same hash cached already: vLLM keeps one
                continue
            b = next(self.ids)
            self.where[(g, hashes[i])] = b
            self.key_of[b], self.depth_of[b] = (g, hashes[i]), i
            created.append(b)
        self.free -= len(created)
        blocks = sorted(used + created, key=lambda b: self.depth_of[b])
        for b in reversed(blocks):  # freed tail first
            self.order[b] = None
        for b in blocks:
            self.owners.setdefault(b, set()).add(request.session)
        self.latest[request.session] = blocks
        return hit * block


def simulate_hybrid(
    requests: Sequence[HybridRequest],
    capacity: int,
    model: HybridModel,
    policy: str,
    interval: int = 0,
    generated: int = 4,
) -> dict[str, float]:
    """Hit rate of ``requests`` on a pool of ``capacity`` blocks of ``model`` under ``policy``
    (``interval``: the retention interval in blocks, for ``interval``)."""
    if policy not in HYBRID_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {HYBRID_POLICIES}")
    cache = _HybridCache(capacity, model, policy, interval)
    previous: dict[str, tuple[int, ...]] = {}
    hit = 0
    for request in requests:
        before = previous.get(request.session)
        if policy in _RELEASING and before is not None:
            stale = common_prefix_length(before, request.tokens)
            if stale < len(before):
                cache.release(request.session, stale // model.block)
        hit += cache.serve(request, generated)
        previous[request.session] = request.tokens
    queries = sum(len(r.tokens) for r in requests)
    return {"hit_tokens": hit, "query_tokens": queries, "hit_rate": hit / queries if queries else 0}


def full_attention_bound(
    requests: Sequence[HybridRequest], capacity: int, model: HybridModel, generated: int = 4
) -> dict[str, float]:
    """Belady with the whole pool given to full attention: what no policy on the hybrid pool
    can beat (a hybrid hit never exceeds full attention's, and its sparse groups only take
    blocks)."""
    plain = [Request(r.session, r.tokens) for r in requests]
    return simulate(plain, capacity, "belady", model.block, generated)
