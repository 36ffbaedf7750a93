"""What the predicted-return picker costs the engine core: the same workload on vLLM's real
``KVCacheManager`` / ``BlockPool`` (no model) with ``PoolAffinity.pick`` on and off, in one
process, rounds alternating; per request, the time of vLLM's own scheduling calls (prefix
lookup, allocation, caching, free) and the plugin's request hook.

The workload is the picker's worst case: every allocation reaches live blocks (the pool holds
about a third of the sessions' prompts), the sessions call in turn, and each prompt is long
(``--blocks-per-session``, 512 by default: 8k tokens at 16 per block), so a candidate's record
is long to read.

    python -m benchmarks.engine.picker_cost [--sessions 16] [--blocks-per-session 512] [--rounds 5]

Output: ``<out>/picker_cost.json`` (default ``benchmarks/results``) and a line per round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from jiuwen_replay.output import write_json
from vllm_affinity.engine import affinity_of, apply_engine_patches
from vllm_affinity.testing import kv_cache_manager

BLOCK = 16


def run(predict: bool, sessions: int, blocks: int, rounds: int) -> tuple[float, int, int]:
    """Seconds per request, prompt tokens hit, blocks the picker swapped."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    kv = kv_cache_manager(sessions * blocks // 3 + blocks + 2, BLOCK, max_model_len=1 << 20)
    state = affinity_of(kv.block_pool)
    assert state is not None
    state.predict_returns(predict)
    elapsed, hit, ids = 0.0, 0, 0
    for round_ in range(rounds):
        for s in range(sessions):
            start_token = s * 10**7
            prompt = [*range(start_token, start_token + (blocks - rounds + round_) * BLOCK), 1]
            ids += 1
            request = Request(
                request_id=f"r{ids}",
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=1),
                pooling_params=None,
                block_hasher=hasher,
                session_id=f"s{s}",
            )
            start = time.perf_counter()
            state.on_new_request(request, release_on_divergence=False)
            computed, n = kv.get_computed_blocks(request)[:2]
            kv.allocate_slots(request, request.num_tokens - n, n, computed)
            request.num_computed_tokens = request.num_tokens
            kv.cache_blocks(request, request.num_tokens)
            kv.free(request)
            elapsed += time.perf_counter() - start
            hit += n
    return elapsed / (rounds * sessions), hit, state.stats().blocks_predicted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--blocks-per-session", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    apply_engine_patches()
    sides: dict[str, list[float]] = {"lru": [], "picker": []}
    figures: dict[str, Any] = {}
    for repeat in range(args.repeat):
        for name in ("lru", "picker") if repeat % 2 == 0 else ("picker", "lru"):
            seconds, hit, swapped = run(
                name == "picker", args.sessions, args.blocks_per_session, args.rounds
            )
            sides[name].append(seconds)
            figures[name] = {"hit_tokens": hit, "blocks_predicted": swapped}
            print(f"{name}: {seconds * 1e3:.2f} ms per request, {hit:,} tokens hit, "
                  f"{swapped:,} blocks swapped", flush=True)  # fmt: skip
    median = {k: statistics.median(v) for k, v in sides.items()}
    result = {
        "sessions": args.sessions,
        "blocks_per_session": args.blocks_per_session,
        "ms_per_request": {k: round(v * 1e3, 3) for k, v in median.items()},
        "ratio": round(median["picker"] / median["lru"], 3),
        **{f"{k}_figures": v for k, v in figures.items()},
    }
    print(f"picker / LRU time per request: {result['ratio']}")
    write_json(Path(args.out) / "picker_cost.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
