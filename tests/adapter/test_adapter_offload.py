"""Releases and idles through vLLM's CPU offload tiers (``engine/offload.py``), on vLLM's real
``Scheduler`` with its real ``SimpleCPUOffloadConnector`` and ``OffloadingConnector``
(scheduler side; no model, no worker): the test completes each step's copies as the workers
would report them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata
from vllm_parts import BLOCK, make_request, state_of, tokens

from vllm_affinity.core import Segment
from vllm_affinity.engine import apply_engine_patches
from vllm_affinity.engine.fail_open import ERRORS
from vllm_affinity.engine.offload import StaleFirst
from vllm_affinity.testing.scheduling import scheduler, step

apply_engine_patches()

SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
PAGE = SPEC.page_size_bytes
#: One chunk of the ``OffloadingConnector``'s tier (a block, padded to the tier's alignment).
CHUNK = max(PAGE, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)


def one_group(num_blocks: int) -> KVCacheConfig:
    """One full-attention group, with the backing tensor the offloader sizes its tier from."""
    tensor = KVCacheTensor(
        size=PAGE * num_blocks, layers=["layer"], layer_stride=PAGE * num_blocks, block_stride=PAGE
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], SPEC)],
    )


@dataclass
class Offloaded:
    """A scheduler with the simple CPU offloader, and what its workers were asked to copy."""

    engine: Any
    stores: list[int] = field(default_factory=list)  # GPU blocks copied to the CPU tier
    loads: list[int] = field(default_factory=list)  # CPU blocks loaded back

    @classmethod
    def build(cls, gpu_blocks: int, cpu_blocks: int, lazy: bool) -> Offloaded:
        """The simple CPU offloader, lazy or eager."""
        return cls.with_connector(
            gpu_blocks,
            "SimpleCPUOffloadConnector",
            {"cpu_bytes_to_use": PAGE * cpu_blocks, "lazy_offload": lazy},
        )

    @classmethod
    def chunked(cls, gpu_blocks: int, cpu_chunks: int, policy: str) -> Offloaded:
        """The ``OffloadingConnector``, a chunk per block, its tier evicting by ``policy``."""
        return cls.with_connector(
            gpu_blocks,
            "OffloadingConnector",
            {"cpu_bytes_to_use": CHUNK * cpu_chunks, "eviction_policy": policy},
        )

    @classmethod
    def with_connector(cls, gpu_blocks: int, name: str, extra: dict[str, Any]) -> Offloaded:
        config = KVTransferConfig(
            kv_connector=name, kv_role="kv_both", kv_connector_extra_config=extra
        )
        engine = scheduler(
            one_group(gpu_blocks),
            max_num_seqs=4,
            max_num_batched_tokens=4 * BLOCK,  # the lazy walk covers 8 blocks
            kv_transfer_config=config,
        )
        return cls(engine)

    @property
    def state(self) -> Any:
        state = state_of(self.engine.kv_cache_manager)
        state.idle_guard = None  # every idle acted on
        return state

    @property
    def cpu_pool(self) -> Any:
        return self.engine.connector.scheduler_manager.cpu_block_pool

    @property
    def policy(self) -> Any:
        """The ``OffloadingConnector``'s tier's cache policy."""
        return self.engine.connector.connector_scheduler.manager._policy

    def done(self, output: Any) -> KVConnectorOutput:
        """The workers' report of the step: every copy it asked for is done."""
        meta = output.kv_connector_metadata
        if isinstance(meta, OffloadingConnectorMetadata):
            jobs = {**meta.load_jobs, **meta.store_jobs}
            self.loads += [len(job.dst_spec.block_ids) for job in meta.load_jobs.values()]
            return KVConnectorOutput(
                finished_recving={job.req_id for job in meta.load_jobs.values()} or None,
                kv_connector_worker_meta=OffloadingWorkerMetadata(
                    completed_jobs=dict.fromkeys(jobs, 1)
                ),
            )
        stored = {}
        if meta.store_event >= 0:
            self.stores += meta.store_gpu_blocks
            stored[meta.store_event] = 1
        self.loads += meta.load_cpu_blocks
        received = {r for requests in meta.load_event_to_reqs.values() for r in requests}
        return KVConnectorOutput(
            finished_recving=received or None,
            kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(completed_store_events=stored),
        )

    def run(self, session: str, start: int, blocks: int) -> list[int]:
        """A request of ``blocks`` full blocks run to its end; the session's blocks."""
        request = make_request(
            tokens(start, blocks), session=session, sampling_params=SamplingParams(max_tokens=1)
        )
        self.engine.add_request(request)
        while request.request_id in self.engine.requests:
            step(self.engine, connector=self.done)
        self.settle()
        return self.state.sessions.latest[session].block_ids.tolist()

    def settle(self) -> None:
        """Steps with nothing to run until the copies a finished request left are done."""
        manager = getattr(self.engine.connector, "scheduler_manager", None)
        for _ in range(4):
            if manager is not None and not manager.has_pending_stores():
                return
            step(self.engine, connector=self.done)
        if manager is not None:
            raise AssertionError("the offloader's copies never completed")


def test_the_lazy_offloader_never_copies_a_released_block_and_idles_keep_their_place() -> None:
    """Lazy mode copies what the GPU evicts next: a released block is dead and never copied
    nor counted as hit; an idle session's blocks are copied and stay IDLE through the copy, so
    when the pool takes them the session's return loads them from the CPU tier."""
    tier = Offloaded.build(gpu_blocks=40, cpu_blocks=128, lazy=True)
    state, queue = tier.state, tier.state.queue
    a = tier.run("A", 0, 8)
    b = tier.run("B", 1000, 8)
    assert tier.stores == []  # 23 free blocks: nothing near eviction yet
    assert state.release("A", 2).moved == 6
    assert state.idle_session("B").blocks_idled == 8
    tier.run("C", 2000, 16)  # the free blocks run low: the walk copies what comes next
    sizes = queue.segment_sizes()
    assert (sizes["released"], sizes["idle"]) == (6, 8)  # every copy done, every block back
    assert set(tier.stores) >= set(b)  # the idle session's blocks, copied
    assert not set(tier.stores) & set(a[2:])  # never a released one
    assert queue.released_hit == 0 and queue.num_pending == 0
    assert state.stats().model_dump()["offload_blocks_parked"] == 8
    hashes = {block: state.pool.blocks[block].block_hash for block in b}
    tier.run("D", 3000, 20)  # takes the released blocks, then most of the idle ones
    evicted = [block for block in b if state.pool.blocks[block].block_hash != hashes[block]]
    assert len(evicted) >= 6
    before = len(tier.loads)
    tier.run("B", 1000, 9)  # back: what the GPU lost comes from the CPU tier
    assert len(tier.loads) - before >= len(evicted)
    assert queue.released_hit == 0
    assert not state.check(idle=True)


def test_a_release_sends_the_cpu_tiers_copies_first_and_spares_the_live_ones() -> None:
    """Eager mode copies every block as it is computed, so a compacted session's dead blocks
    are in the CPU tier already: the release moves their copies first in the tier's order, and
    when the tier needs room they go, not an older session's live ones (LRU's victims)."""
    tier = Offloaded.build(gpu_blocks=64, cpu_blocks=17, lazy=False)
    state = tier.state
    old = tier.run("old", 5000, 6)  # the tier's least recently used: LRU's first victims
    tier.run("A", 0, 8)
    old_hashes = [state.pool.blocks[b].block_hash for b in old]
    cpu = tier.cpu_pool
    assert all(cpu.cached_block_hash_to_block.get_one_block(h) for h in old_hashes)
    released = state.release("A", 2)
    assert released.moved == 6
    assert state.stats().model_dump()["offload_blocks_released"] == 6
    assert cpu.free_block_queue.segment_sizes()["released"] == 6
    free = cpu.free_block_queue.segment_sizes()["free"]
    tier.run("C", 2000, 5)  # the tier is full: room for five more
    assert all(cpu.cached_block_hash_to_block.get_one_block(h) for h in old_hashes)
    assert cpu.free_block_queue.segment_sizes()["released"] == 6 - (5 - free)


def test_a_failing_tier_is_counted_and_the_release_stands() -> None:
    tier = Offloaded.build(gpu_blocks=64, cpu_blocks=32, lazy=False)
    state = tier.state
    blocks = tier.run("A", 0, 8)

    class Broken:
        def release(self, block_hashes: Any) -> int:
            raise RuntimeError("a tier that fails")

    state.attach_tier(Broken())
    before = ERRORS.counts["offload"]
    assert state.release("A", 2).moved == 6
    assert ERRORS.counts["offload"] == before + 1
    assert all(state.queue.segment_of(state.pool.blocks[b]) is Segment.RELEASED for b in blocks[2:])


@pytest.mark.parametrize("lazy", [True, False])
def test_without_releases_the_offloader_copies_as_vllms_own(lazy: bool) -> None:
    """No release, no idle: the plugin changes nothing the offloader does (same copies, same
    loads) as vLLM without the plugin on the same requests."""
    from benchmarks.engine.engine_scale import unpatched

    def copies() -> tuple[list[int], list[int]]:
        tier = Offloaded.build(gpu_blocks=40, cpu_blocks=64, lazy=lazy)
        for session, blocks in (("A", 8), ("B", 12), ("C", 12), ("D", 12), ("A", 10)):
            request = make_request(
                tokens(1000 * "ABCD".index(session), blocks),
                sampling_params=SamplingParams(max_tokens=1),
            )
            tier.engine.add_request(request)
            while tier.engine.requests:
                step(tier.engine, connector=tier.done)
            tier.settle()
        return tier.stores, tier.loads

    with_plugin = copies()
    with unpatched():
        vanilla = copies()
    assert with_plugin == vanilla
    assert with_plugin[0]  # it did copy
    assert with_plugin[1] or lazy  # and eager mode loaded (lazy's walk left the prefix)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_offloading_connectors_tier_evicts_released_chunks_before_live_ones(
    policy: str,
) -> None:
    """vLLM's default offloader stores every chunk as it is computed: a compacted session's
    dead chunks sit in the CPU tier. After the release they are the tier's first victims,
    whatever its policy; without the release (vLLM's order) an older session's live chunks
    go."""
    for release in (True, False):
        tier = Offloaded.chunked(gpu_blocks=64, cpu_chunks=17, policy=policy)
        state = tier.state
        assert isinstance(tier.policy, StaleFirst)
        old = tier.run("old", 5000, 6)
        tier.run("A", 0, 8)
        old_keys = [state.pool.blocks[b].block_hash for b in old]
        assert all(tier.policy.get(key) is not None for key in old_keys)  # stored
        if release:
            assert state.release("A", 2).moved == 6
            assert state.stats().model_dump()["offload_blocks_released"] == 6
            assert tier.policy.stale == 6
        tier.run("C", 2000, 5)  # the tier (17 chunks, 14 used) makes room for two
        kept = sum(tier.policy.get(key) is not None for key in old_keys)
        if release:
            assert kept == 6 and tier.policy.stale == 4
        else:
            assert kept < 6
        assert state.queue.released_hit == 0


def test_stale_first_keeps_vllms_eviction_contract() -> None:
    """``evict`` gives exactly n chunks outside ``protected``, or None and changes nothing; a
    chunk in use (a transfer reads it) is never given; the rest comes from the policy."""
    import inspect

    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

    policy = StaleFirst(LRUCachePolicy(cache_capacity=4))
    # vLLM 0.33's insert also takes the request's context
    context = (
        (ReqContext("r"),) if "req_context" in inspect.signature(policy.insert).parameters else ()
    )
    for n, key in enumerate((b"a", b"b", b"c", b"d")):
        chunk = ChunkStatus(n)
        chunk.ref_cnt = 0
        policy.insert(key, chunk, *context)
    policy.get(b"d").ref_cnt = 1  # being loaded
    policy.mark_non_evictable(b"d")
    assert policy.release([b"c", b"d", b"zz", None]) == 2
    assert policy.evict(4, set()) is None  # only three evictable
    assert policy.stale == 2 and policy.get(b"c") is not None
    assert [key for key, _ in policy.evict(2, {b"a"})] == [b"c", b"b"]
    assert policy.stale == 1  # d, in use, waits
    assert policy.get(b"c") is None and policy.get(b"a") is not None
    policy.touch([b"d"], ReqContext("r2"))  # a request reads it: live again
    assert policy.stale == 0


@pytest.mark.parametrize("kind", ["simple", "chunked", "none"])
def test_a_cpu_tier_turns_the_auto_picker_off(kind: str) -> None:
    """With a CPU tier behind the pool, the predicted-return picker (on by ``auto`` for a
    one-group model) is off: its bets evict what the tier held longest. Without one it is on."""
    if kind == "simple":
        state = Offloaded.build(gpu_blocks=64, cpu_blocks=32, lazy=True).state
    elif kind == "chunked":
        state = Offloaded.chunked(gpu_blocks=64, cpu_chunks=32, policy="lru").state
    else:
        state = state_of(scheduler(one_group(64)).kv_cache_manager)
    assert state.stats().predict_return is (kind == "none")
