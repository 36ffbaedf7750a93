"""The plugin fails open where vLLM builds its pool (``fail_open.py``), on vLLM's real classes:
a failure while the plugin attaches leaves the pool vLLM's own, counted, and the engine serves
as if the plugin were absent; request keys of the wrong type are ignored and counted. (The
per-request paths fail open on a real server: ``tests/e2e/test_fail_open.py``.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm_parts import make_manager, make_request, run_prefill, state_of, tokens

from vllm_affinity.core.request_keys import HEAD_KEY, NEXT_USE_KEY, PARENT_KEY, REWRITE_KEY
from vllm_affinity.engine import affinity_of, apply_engine_patches
from vllm_affinity.engine import patches as engine_patches
from vllm_affinity.engine.fail_open import ERRORS
from vllm_affinity.engine.pool_affinity import PoolAffinity
from vllm_affinity.testing.scheduling import scheduler, step

apply_engine_patches()


def broken(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a plugin bug")


def serves(manager: Any) -> None:
    """Two turns of a session, its prefix hit by the second (vLLM's own caching)."""
    first = make_request(tokens(0, 4), session="A")
    run_prefill(manager, first)
    manager.free(first)
    second = make_request([*tokens(0, 4), *range(9000, 9016)], session="A")
    assert manager.get_computed_blocks(second)[1] == 4 * 16
    run_prefill(manager, second)
    manager.free(second)


@pytest.mark.parametrize(
    ("path", "target", "name"),
    [
        ("block_pool_init", PoolAffinity, "__init__"),
        ("kv_cache_manager_init", engine_patches, "describe_groups"),
    ],
)
def test_a_failure_while_attaching_leaves_the_pool_vllms_own(
    path: str, target: Any, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = ERRORS.counts[path]
    monkeypatch.setattr(target, name, broken)
    manager = make_manager(32)
    assert affinity_of(manager.block_pool) is None  # absent, not half attached
    assert ERRORS.counts[path] == before + 1
    serves(manager)


def test_request_keys_of_the_wrong_type_are_ignored_and_counted() -> None:
    """A client's malformed ``kv_*`` values reaching the engine (through an entry point that
    passes ``vllm_xargs`` on unchecked) do nothing: the request is served, the values counted."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    core = scheduler(config)
    state = state_of(core.kv_cache_manager)
    errors = dict(ERRORS.counts)
    malformed = dict(ERRORS.malformed)
    bad = {HEAD_KEY: "512", NEXT_USE_KEY: "soon", REWRITE_KEY: 5, PARENT_KEY: ["lead"]}
    for n, extra in enumerate([None, bad]):
        params = SamplingParams(max_tokens=2, ignore_eos=True, extra_args=extra)
        request = make_request([*tokens(0, 3), n], session="A", sampling_params=params)
        core.add_request(request)
        while core.has_requests():
            step(core)
    assert dict(ERRORS.counts) == errors  # nothing raised: no path failed
    for key in bad:
        assert ERRORS.malformed[key] == malformed.get(key, 0) + 1
    assert state.stats().malformed_args == dict(ERRORS.malformed)
    assert state.counters["releases"] == 0  # the malformed rewrite released nothing
    assert state.check(idle=True) == []
