"""How long one stats refresh stalls the engine with many sessions tracked (implicit sessions
make every id-less request one): vLLM's real ``KVCacheManager`` at a GPU pool size, ``--sessions``
sessions of a few blocks each, then ``PoolAffinity.stats()`` (what every API server asks each
engine for every ``VLLM_AFFINITY_STATS_INTERVAL``, 2 s by default) timed, beside the per-record
count of bindings it made before (``SessionBlocks.bindings``, now only ``/affinity/check``'s).

    python -m benchmarks.stats_stall [--sessions 100000] [--blocks 400000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from jiuwen_replay.output import write_json

BLOCK = 16


def timed(call: Callable[[], Any], repeat: int) -> list[float]:
    """Milliseconds of each of ``repeat`` calls."""
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--blocks", type=int, default=400_000)
    parser.add_argument("--blocks-per-session", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/stats_stall.json")
    args = parser.parse_args()
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from vllm_affinity.engine import affinity_of, apply_engine_patches
    from vllm_affinity.testing import kv_cache_manager

    apply_engine_patches()
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    manager = kv_cache_manager(args.blocks, BLOCK, max_model_len=4096)
    state = affinity_of(manager.block_pool)
    assert state is not None
    width = args.blocks_per_session * BLOCK
    for n in range(args.sessions):
        prompt = list(range(n * width, (n + 1) * width))
        request = Request(
            request_id=f"r{n}", prompt_token_ids=prompt, sampling_params=SamplingParams(),
            pooling_params=None, block_hasher=hasher, session_id=f"session-{n}",
        )  # fmt: skip
        blocks = manager.allocate_slots(request, len(prompt))
        assert blocks is not None, "the pool is too small for the sessions"
        manager.cache_blocks(request, len(prompt))
        manager.free(request)  # bound at its free, as a finished request is
        if (n + 1) % 25_000 == 0:
            print(f"  {n + 1:,} sessions", file=sys.stderr, flush=True)
    stats_ms = timed(state.stats, args.repeat)
    per_record_ms = timed(lambda: sum(table.bindings for table in state.tables), args.repeat)
    stats = state.stats()
    result: dict[str, Any] = {
        "pool_blocks": args.blocks,
        "sessions_tracked": stats.sessions,
        "bindings": stats.bindings,
        "stats_ms_max": round(max(stats_ms), 2),
        "stats_ms_median": round(statistics.median(stats_ms), 2),
        "per_record_bindings_ms_median": round(statistics.median(per_record_ms), 1),
        "per_record_bindings_twice_ms": round(2 * statistics.median(per_record_ms), 1),
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
