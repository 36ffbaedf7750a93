"""How long the plugin stalls the engine with many sessions tracked (implicit sessions make
every id-less request one), and what an id-less session costs: vLLM's real ``KVCacheManager``
at a GPU pool size, ``--sessions`` sessions of a few blocks each, then timed:

- ``PoolAffinity.stats()`` (what every API server asks each engine for every
  ``VLLM_AFFINITY_STATS_INTERVAL``, 2 s by default), beside the per-record count of bindings it
  made before (``SessionBlocks.bindings``, now only the check's);
- ``/affinity/check``'s engine call (bounded: a slice of the pool, the holder counts only up
  to a bound) beside the unbounded check the tests run;
- linking an id-less window (``ChainWindow.of`` in the API server, ``AnswerChains.chain_of``
  where the table is) at 8k, 32k and 128k-token windows (4 characters a token), one that
  carries its last answer and one that carries none (searched for an answer's stretches);
- the memory of the answer chains per chain and per link, and at the default caps
  (``VLLM_AFFINITY_MAX_SESSIONS`` chains).

    python -m benchmarks.engine.stats_stall [--sessions 100000] [--blocks 400000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import functools
import random
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


def _window(tokens: int, answered: str) -> list[dict[str, Any]]:
    """A chat window of about ``tokens`` tokens (4 characters each): turns of a user message
    and an answer, ``answered`` the last answer."""
    from vllm_affinity.testing import filler_text

    rng = random.Random(tokens)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}]
    while sum(len(str(m["content"])) for m in messages) < 4 * tokens:
        messages += [
            {"role": "user", "content": filler_text(rng, 200)},
            {"role": "assistant", "content": filler_text(rng, 60)},
        ]
    messages += [
        {"role": "assistant", "content": answered},
        {"role": "user", "content": "go on"},
    ]
    return messages


def link_costs(repeat: int) -> dict[str, dict[str, float]]:
    """Milliseconds (median) to read an id-less window and to link it, per window size."""
    from vllm_affinity.core.answer_chains import Answer, AnswerChains, ChainWindow

    out = {}
    for tokens in (8_192, 32_768, 131_072):
        chains = AnswerChains()
        answered = f"the answer {tokens} " * 20
        chain, _ = chains.chain_of("p", ChainWindow.of(_window(64, "x"), None))
        chains.record("p", chain, Answer(answered))
        for n in range(8):  # other answers whose stretches an unknown window is searched for
            other, _ = chains.chain_of("p", ChainWindow.of(_window(64, f"y{n}"), None))
            chains.record("p", other, Answer(f"another answer {n} " * 20))
        known, unknown = _window(tokens, answered), _window(tokens, "never answered here")
        windows = {"known": ChainWindow.of(known, None), "unknown": ChainWindow.of(unknown, None)}
        read = timed(functools.partial(ChainWindow.of, known, None), repeat)
        link = {
            k: timed(functools.partial(chains.chain_of, "p", w), repeat) for k, w in windows.items()
        }
        out[f"{tokens // 1024}k"] = {
            "read_window_ms": round(statistics.median(read), 2),
            "link_known_ms": round(statistics.median(link["known"]), 3),
            "link_unknown_ms": round(statistics.median(link["unknown"]), 3),
            "wire_chars": len(repr(windows["unknown"].to_wire())),
        }
    return out


def chains_memory(chains: int) -> dict[str, Any]:
    """Bytes the answer chains hold per chain and per link (traced), ``chains`` chains each
    answered until the links reach their cap, and the peak at those caps (twelve principals,
    API keys, each with its last answers' stretches)."""
    import tracemalloc

    from vllm_affinity.core.answer_chains import Answer, AnswerChains, ChainWindow

    tracemalloc.start()
    table = AnswerChains(max_chains=chains)
    window = ChainWindow.of([{"role": "user", "content": "hello"}], None)
    names = [table.chain_of(f"p{n % 12}", window)[0] for n in range(chains)]
    after_chains = tracemalloc.get_traced_memory()[0]
    links_per_chain = table._max_links // chains
    for n, name in enumerate(names):
        for k in range(links_per_chain):
            table.record(f"p{n % 12}", name, Answer("", (f"call-{n}-{k}-{'x' * 20}",)))
    peak = tracemalloc.get_traced_memory()[1]  # the link table at its fullest
    tracemalloc.stop()
    links = table._max_links
    return {
        "chains": chains,
        "links_cap": links,
        "bytes_per_chain": round(after_chains / chains),
        "bytes_per_link_at_cap": round((peak - after_chains) / links),
        "peak_mb": round(peak / 1e6, 1),
    }


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
    bounded_ms = timed(lambda: state.check(idle=False, bounded=True), args.repeat)
    scope = dict(state.check_scope)
    full_ms = timed(lambda: state.check(idle=False), 1)
    result: dict[str, Any] = {
        "pool_blocks": args.blocks,
        "sessions_tracked": stats.sessions,
        "bindings": stats.bindings,
        "stats_ms_max": round(max(stats_ms), 2),
        "stats_ms_median": round(statistics.median(stats_ms), 2),
        "per_record_bindings_ms_median": round(statistics.median(per_record_ms), 1),
        "per_record_bindings_twice_ms": round(2 * statistics.median(per_record_ms), 1),
        "check_bounded_ms_max": round(max(bounded_ms), 1),
        "check_bounded_scope": scope,
        "check_full_ms": round(full_ms[0], 1),
        "link_ms": link_costs(args.repeat),
        "chains_memory": chains_memory(args.sessions),
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
