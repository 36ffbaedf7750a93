"""Memory of the plugin's session table (pure core), under the churn that made the old owner sets
grow without bound: many sessions sharing one long prefix (a system prompt, tools).

    python -m benchmarks.engine.server_session_memory [--sessions 200000] [--shared-blocks 64]

Reports the bytes the table retains (its dicts, and per tracked session its key, record and
arrays), per tracked session and per binding, with the default ``VLLM_AFFINITY_MAX_SESSIONS``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from jiuwen_replay.output import write_json
from vllm_affinity.core import SessionBlocks
from vllm_affinity.settings import Settings


def retained_bytes(table: SessionBlocks) -> int:
    size = sys.getsizeof(table.latest) + table.block_state_bytes
    for key, record in table.latest.items():
        size += sys.getsizeof(key) + sys.getsizeof(record) + sys.getsizeof(record.request_id)
        size += sys.getsizeof(record.block_ids) + sys.getsizeof(record.generations)
    return size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200_000)
    parser.add_argument("--shared-blocks", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/server_session_memory.json")
    args = parser.parse_args()
    max_sessions = Settings().max_sessions
    table = SessionBlocks(max_sessions)
    shared = list(range(args.shared_blocks))
    started = time.perf_counter()
    for i in range(args.sessions):
        own = 100_000 + i % 20_000  # one block of its own, reused cyclically by the pool
        table.record(f"session-{i}", [*shared, own], 0, f"request-{i}")
        if (i + 1) % 50_000 == 0:
            print(f"  {i + 1:,} sessions", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - started
    size = retained_bytes(table)
    result: dict[str, Any] = {
        "sessions_churned": args.sessions,
        "blocks_per_session": args.shared_blocks + 1,
        "max_sessions": max_sessions,
        "sessions_tracked": len(table),
        "bindings": table.bindings,
        "holders_of_a_shared_block": table.holders(0),
        "retained_mb": round(size / 2**20, 1),
        "bytes_per_tracked_session": round(size / len(table)),
        "bytes_per_binding": round(size / table.bindings, 1),
        "record_us_per_session": round(seconds / args.sessions * 1e6, 2),
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
