"""Queue operation cost: vLLM's own FreeKVCacheBlockQueue vs the three-segment queue.

One operation sequence shaped like BlockPool's use (allocate = popleft_n; free a request =
append_n of its cached blocks in reverse order plus prepend_n of its uncached tail; prefix hit =
remove of a queued block), generated once by driving a vLLM queue, then replayed on fresh queues
of both kinds in alternating rounds in one process. Without releases both queues pop the same
blocks (checked once before timing). The cost of ``release()`` (a move from NORMAL to RELEASED),
an operation vLLM's queue does not have, is timed separately.

    python benchmarks/queue_ops.py [--blocks 8192] [--ops 200000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

from _common import write_json
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from vllm_affinity.core import SegmentedFreeBlockQueue

Op = tuple[str, Any]


def make_ops(blocks: int, count: int, seed: int = 0) -> list[Op]:
    """Drive a real vLLM queue with a random BlockPool-like workload and record block ids."""
    rng = random.Random(seed)
    queue, pool = fresh("vllm", blocks)
    queued = set(range(blocks))
    live: list[list[int]] = []
    ops: list[Op] = []
    while len(ops) < count:
        r = rng.random()
        if r < 0.45 and len(queued) > 64:
            taken = [b.block_id for b in queue.popleft_n(rng.randint(1, 32))]
            queued.difference_update(taken)
            live.append(taken)
            ops.append(("popleft_n", len(taken)))
        elif r < 0.9 and live:
            request = live.pop(rng.randrange(len(live)))
            cached, tail = list(reversed(request[:-1])), request[-1:]
            queue.append_n([pool[i] for i in cached])
            queue.prepend_n([pool[i] for i in tail])
            queued.update(request)
            ops += [("append_n", cached), ("prepend_n", tail)]
        elif queued:
            victim = rng.choice(tuple(queued)) if len(ops) % 16 == 0 else next(iter(queued))
            queue.remove(pool[victim])
            queued.discard(victim)
            live.append([victim])
            ops.append(("remove", victim))
    return ops


def replay(queue: Any, blocks: list[Any], ops: list[Op]) -> float:
    popleft_n, append_n, prepend_n, remove = (
        queue.popleft_n, queue.append_n, queue.prepend_n, queue.remove,
    )  # fmt: skip
    start = time.perf_counter()
    for op, arg in ops:
        if op == "popleft_n":
            popleft_n(arg)
        elif op == "append_n":
            append_n([blocks[i] for i in arg])
        elif op == "prepend_n":
            prepend_n([blocks[i] for i in arg])
        else:
            remove(blocks[arg])
    return time.perf_counter() - start


def same_pops(ops: list[Op], n: int) -> bool:
    """Both queues hand out the same blocks for the whole sequence (no releases)."""
    (vq, vb), (sq, sb) = fresh("vllm", n), fresh("segmented", n)
    for op, arg in ops:
        if op == "popleft_n":
            if [b.block_id for b in vq.popleft_n(arg)] != [b.block_id for b in sq.popleft_n(arg)]:
                return False
        elif op == "remove":
            vq.remove(vb[arg])
            sq.remove(sb[arg])
        else:
            getattr(vq, op)([vb[i] for i in arg])
            getattr(sq, op)([sb[i] for i in arg])
    return True


def release_cost(n: int) -> float:
    """Seconds per release() of a queued cached block (NORMAL → RELEASED)."""
    queue, blocks = fresh("segmented", n)
    queue.append_n(queue.popleft_n(n))
    start = time.perf_counter()
    for block in blocks:
        queue.release(block)
    return (time.perf_counter() - start) / n


def fresh(kind: str, n: int) -> tuple[Any, list[Any]]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    queue = FreeKVCacheBlockQueue(blocks) if kind == "vllm" else SegmentedFreeBlockQueue(blocks)
    return queue, blocks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8192)
    parser.add_argument("--ops", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/queue_ops.json")
    args = parser.parse_args()
    ops = make_ops(args.blocks, args.ops)
    if not same_pops(ops, args.blocks):
        print("error: the two queues diverged on the same sequence", file=sys.stderr)
        return 1
    times: dict[str, list[float]] = {"vllm": [], "segmented": []}
    for r in range(args.rounds):
        for kind in times:
            queue, blocks = fresh(kind, args.blocks)
            times[kind].append(replay(queue, blocks, ops))
        print(f"  round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "blocks": args.blocks,
        "operations": len(ops),
        "rounds": args.rounds,
        "same_blocks_popped": True,
        "median_seconds": {k: round(v, 4) for k, v in medians.items()},
        "ns_per_op": {k: round(v / len(ops) * 1e9, 1) for k, v in medians.items()},
        "ratio_segmented_vs_vllm": round(medians["segmented"] / medians["vllm"], 3),
        "release_ns_per_block": round(release_cost(args.blocks) * 1e9, 1),
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
