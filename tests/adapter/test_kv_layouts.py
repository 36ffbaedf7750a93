"""Every KV-cache layout vLLM builds, through vLLM's real ``Scheduler`` (no model): one group of
each spec kind (vLLM's ``UnitaryKVCacheCoordinator``: every layer full attention, every layer a
sliding window as in Mistral 7B v0.1, chunked local attention, MLA, Mamba alone, attention with
sinks), hybrids (``HybridKVCacheCoordinator``) and prefix caching off
(``KVCacheCoordinatorNoPrefixCache``). Each serves sessions with shared instructions (their
checkpoint told), a second turn, a compaction the server told (``kv_rewrite``), an idle signal
and the picker on a tight pool, with every path of the plugin on: no path may fail (the
engine's error counts stay as they were) and the pool's invariants hold.

Cross attention (encoder-decoder models) is left out: vLLM's scheduler gives it a manager of
its own outside prefix caching, which no request path here reaches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from vllm_parts import state_of

from vllm_affinity.core.request_keys import CHECKPOINT_KEY, REWRITE_KEY
from vllm_affinity.engine import apply_engine_patches, cached_block_hashes
from vllm_affinity.engine.fail_open import ERRORS
from vllm_affinity.engine.patches import affinity_session_idle
from vllm_affinity.testing.scheduling import scheduler, step

apply_engine_patches()

KINDS: dict[str, Any] = dict(num_kv_heads=1, head_size=1, dtype=torch.float32)


def full(block: int = 16) -> Any:
    return FullAttentionSpec(block_size=block, **KINDS)


def sliding(block: int = 16) -> Any:
    return SlidingWindowSpec(block_size=block, sliding_window=64, **KINDS)


def chunked(block: int = 16) -> Any:
    return ChunkedLocalAttentionSpec(block_size=block, attention_chunk_size=64, **KINDS)


def mla(block: int = 16) -> Any:
    return MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=576, dtype=torch.float32)


def sink(block: int = 16) -> Any:
    return SinkFullAttentionSpec(block_size=block, sink_len=4, **KINDS)


def mamba(block: int = 16) -> Any:
    return MambaSpec(
        block_size=block, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )


#: name → (the groups' specs, prefix caching on, the coordinator vLLM builds)
LAYOUTS: dict[str, tuple[Callable[[], list[Any]], bool, type]] = {
    "full": (lambda: [full()], True, UnitaryKVCacheCoordinator),
    "every-layer-sliding": (lambda: [sliding()], True, UnitaryKVCacheCoordinator),
    "chunked-local": (lambda: [chunked()], True, UnitaryKVCacheCoordinator),
    "mla": (lambda: [mla()], True, UnitaryKVCacheCoordinator),
    "sinks": (lambda: [sink()], True, UnitaryKVCacheCoordinator),
    "mamba-only": (lambda: [mamba()], True, UnitaryKVCacheCoordinator),
    "sliding+full": (lambda: [sliding(), full()], True, HybridKVCacheCoordinator),
    "mamba+full": (lambda: [mamba(64), full(64)], True, HybridKVCacheCoordinator),
    "no-prefix-cache": (lambda: [sliding(), full()], False, KVCacheCoordinatorNoPrefixCache),
}

INSTRUCTIONS = list(range(100, 100 + 8 * 16))  # 8 blocks of 16 every session sends first


def ask(core: Any, hasher: Any, rid: str, session: str, prompt: list[int], **extra: Any) -> None:
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=4, ignore_eos=True, extra_args=extra or None)
    core.add_request(
        Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=hasher,
            session_id=session,
        )
    )


def run(core: Any) -> None:
    for _ in range(200):
        step(core)
        if not core.has_requests():
            return
    raise AssertionError("requests still running after 200 steps")


def hasher_for(block: int) -> Any:
    """vLLM's block hasher at the scheduler's hash block size (its block size here)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block, sha256)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_serves_every_path_with_no_plugin_failure(layout: str) -> None:
    specs_of, caching, coordinator_kind = LAYOUTS[layout]
    specs = specs_of()
    block = max(spec.block_size for spec in specs)
    hasher = hasher_for(block)
    config = KVCacheConfig(
        num_blocks=48,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
    )
    try:
        core = scheduler(config, max_model_len=2048, block_size=block, prefix_caching=caching)
    except TypeError as exc:  # vLLM 0.32 cannot build its own SinkFullAttentionManager
        if layout == "sinks" and "SinkFullAttentionManager" in str(exc):
            pytest.skip(f"vLLM itself cannot build this layout: {exc}")
        raise
    manager = core.kv_cache_manager
    assert type(manager.coordinator) is coordinator_kind
    state = state_of(manager)
    errors = dict(ERRORS.counts)
    told = {CHECKPOINT_KEY: len(INSTRUCTIONS)}
    # two sessions share the instructions; each tells where they end
    a1 = [*INSTRUCTIONS, *range(1000, 1000 + 48)]
    ask(core, hasher, "a1", "A", a1, **told)
    run(core)
    ask(core, hasher, "b1", "B", [*INSTRUCTIONS, *range(2000, 2000 + 48)], **told)
    run(core)
    # A's second turn, then its compaction (the server told a rewrite)
    a2 = [*a1, 7, 7, 7, 7, *range(3000, 3000 + 40)]
    ask(core, hasher, "a2", "A", a2, **told)
    run(core)
    ask(
        core,
        hasher,
        "a3",
        "A",
        [*INSTRUCTIONS, *range(4000, 4000 + 20)],
        **told,
        **{REWRITE_KEY: "rewrite"},
    )
    run(core)
    # B waits on its user; then a session that needs most of the pool, the picker on
    affinity_session_idle(_Engine(core), "B")
    state.predict_returns(True)
    ask(core, hasher, "c1", "C", list(range(5000, 5000 + 20 * 16)))
    run(core)
    assert dict(ERRORS.counts) == errors, "a plugin path failed on this layout"
    assert state.check(idle=True) == []
    if caching:
        assert state.sessions.latest  # the sessions' blocks were bound
        assert cached_block_hashes(manager.block_pool)  # KV events' spelling of the cache
    stats = state.stats()
    assert stats.engine_errors == errors


class _Engine:
    """What the ``EngineCore`` utilities read of the engine: its scheduler."""

    def __init__(self, core: Any) -> None:
        self.scheduler = core


@pytest.mark.parametrize("layout", ["sliding+full", "every-layer-sliding"])
@pytest.mark.parametrize("keep_answers", [True, False])
def test_a_sessions_next_call_hits_its_answer_on_a_sliding_window_model(
    layout: str, keep_answers: bool
) -> None:
    """vLLM keeps a sliding window's state at the prompt's end only: the agent's next call (the
    window, the answer, a tool result) hits up to the prompt's end and computes the answer
    again. The plugin keeps the window at the answer's end (``checkpoints.py``)."""
    from vllm.v1.request import Request

    specs_of, _, _ = LAYOUTS[layout]
    hasher = hasher_for(16)
    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs_of())],
        prefix_cache_retention_interval=0,  # a server's default (the class's: dense)
    )
    core = scheduler(config, max_model_len=2048, block_size=16)
    state = state_of(core.kv_cache_manager)
    assert state.checkpoints is not None and state.checkpoints.answers
    if not keep_answers:  # what vLLM keeps alone
        state.checkpoints.answers = False
    prompt = [*INSTRUCTIONS, *range(1000, 1040)]  # 168 tokens: vLLM keeps the window at 160
    core.add_request(
        Request(
            request_id="a1", prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=40, ignore_eos=True),
            pooling_params=None, block_hasher=hasher, session_id="A",
        )
    )  # fmt: skip
    run(core)  # it answers 40 tokens of 7: 207 computed, 12 full blocks (192 tokens)
    following = Request(
        request_id="a2", prompt_token_ids=[*prompt, *[7] * 40, *range(3000, 3030)],
        sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
        block_hasher=hasher, session_id="A",
    )  # fmt: skip
    hit = core.kv_cache_manager.get_computed_blocks(following)[1]
    assert hit == (192 if keep_answers else 160)
    assert state.stats().released_hit == 0
