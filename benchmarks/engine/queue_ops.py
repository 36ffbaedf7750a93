"""Queue operation cost: vLLM's own FreeKVCacheBlockQueue vs the segmented queue.

One operation sequence shaped like BlockPool's use (allocate = popleft_n; free a request =
append_n of its cached blocks in reverse order plus prepend_n of its uncached tail; prefix hit =
remove of a queued cached block, as only blocks with a hash can be hit), generated once by driving
a vLLM queue, then replayed on a fresh queue of each kind in lockstep: every operation runs on one
queue and at once on the other, the side going first alternating per operation. Only the queue
calls are timed (their arguments are prepared before), per kind of operation. Without releases
both queues pop the same blocks (checked once before timing). As in ``BlockPool``, a block has a
hash when it is appended and none when it is prepended (set outside the timed region, on both
sides). The costs of ``release()`` and ``idle()`` (moves from NORMAL to RELEASED or IDLE),
operations vLLM's queue does not have, are timed separately, and so are pops through the
segments when RELEASED and IDLE hold blocks (which vLLM's queue cannot be in: against its pops of
the same number of cached blocks).

    python -m benchmarks.engine.queue_ops [--blocks 8192] [--ops 200000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from typing import Any

from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, FreeKVCacheBlockQueue, KVCacheBlock

from jiuwen_replay.output import write_json
from vllm_affinity.core import SegmentedFreeBlockQueue

Op = tuple[str, Any]


def make_ops(blocks: int, count: int, seed: int = 0) -> list[Op]:
    """Drive a real vLLM queue with a random BlockPool-like workload and record block ids."""
    rng = random.Random(seed)
    queue, pool = fresh("vllm", blocks)
    cached: set[int] = set()  # queued blocks with a hash: the only ones a prefix hit can touch
    live: list[list[int]] = []
    ops: list[Op] = []
    while len(ops) < count:
        r = rng.random()
        if r < 0.45 and queue.num_free_blocks > 64:
            taken = [b.block_id for b in queue.popleft_n(rng.randint(1, 32))]
            cached.difference_update(taken)
            live.append(taken)
            ops.append(("popleft_n", len(taken)))
        elif r < 0.9 and live:
            request = live.pop(rng.randrange(len(live)))
            hashed, tail = list(reversed(request[:-1])), request[-1:]
            queue.append_n([pool[i] for i in hashed])
            queue.prepend_n([pool[i] for i in tail])
            cached.update(hashed)
            ops += [("append_n", hashed), ("prepend_n", tail)]
        elif cached:
            victim = rng.choice(tuple(cached)) if len(ops) % 16 == 0 else next(iter(cached))
            queue.remove(pool[victim])
            cached.discard(victim)
            live.append([victim])
            ops.append(("remove", victim))
    return ops


KINDS = ("popleft_n", "append_n", "prepend_n", "remove")
FREES = (KINDS.index("append_n"), KINDS.index("prepend_n"))


def prepared(blocks: list[Any], ops: list[Op]) -> list[tuple[int, Any]]:
    """The sequence with its arguments resolved to block objects, outside any timed region:
    (kind index, count | block list | block)."""
    out: list[tuple[int, Any]] = []
    for op, arg in ops:
        kind = KINDS.index(op)
        if op == "popleft_n":
            out.append((kind, arg))
        elif op == "remove":
            out.append((kind, blocks[arg]))
        else:
            out.append((kind, [blocks[i] for i in arg]))
    return out


def as_pool_frees(kind: int, blocks: list[Any]) -> None:
    """What ``BlockPool`` guarantees before it frees blocks: the ones it appends carry their
    hash, the ones it prepends have none (never filled, or evicted)."""
    appended = kind == KINDS.index("append_n")
    for block in blocks:
        block.reset_hash()
        if appended:
            block.set_block_hash(BlockHashWithGroupId(block.block_id.to_bytes(4, "big")))


def replay_lockstep(
    queues: tuple[Any, Any], steps: tuple[list[tuple[int, Any]], list[tuple[int, Any]]]
) -> tuple[list[float], list[float]]:
    """Run the same sequence on both queues in lockstep, each operation timed on one queue and
    then at once on the other, the first side alternating per operation: noise from the shared
    machine lands on both sides alike. Returns the seconds per kind of operation, per side."""
    methods = [[getattr(queue, kind) for kind in KINDS] for queue in queues]
    spent = ([0.0] * len(KINDS), [0.0] * len(KINDS))
    clock = time.perf_counter
    gc.disable()  # a collection inside one side's timed call would be charged to that side
    try:
        for i, (step_a, step_b) in enumerate(zip(*steps, strict=True)):
            for side in (0, 1) if i % 2 else (1, 0):
                kind, arg = step_a if side == 0 else step_b
                method = methods[side][kind]
                if kind in FREES:
                    as_pool_frees(kind, arg)
                start = clock()
                method(arg)
                spent[side][kind] += clock() - start
    finally:
        gc.enable()
    return spent


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
            for queue, pool in ((vq, vb), (sq, sb)):
                blocks = [pool[i] for i in arg]
                as_pool_frees(KINDS.index(op), blocks)
                getattr(queue, op)(blocks)
    return True


def cached_queue(kind: str, n: int) -> tuple[Any, list[Any]]:
    """A queue of ``n`` blocks, all freed with a hash (NORMAL), as after a burst of requests."""
    queue, blocks = fresh(kind, n)
    popped = queue.popleft_n(n)
    as_pool_frees(KINDS.index("append_n"), popped)
    queue.append_n(popped)
    return queue, blocks


def move_cost(n: int, method: str) -> float:
    """Seconds per ``release()`` (NORMAL → RELEASED) or ``idle()`` (NORMAL → IDLE) of a queued
    cached block."""
    queue, blocks = cached_queue("segmented", n)
    move = getattr(queue, method)
    start = time.perf_counter()
    for block in blocks:
        move(block)
    return (time.perf_counter() - start) / n


def marked_pop_ratio(n: int, take: int = 4, rounds: int = 5) -> float:
    """``popleft_n(take)`` until empty on a queue of cached blocks, a quarter of them idle and
    an eighth released (the segment-by-segment path), against vLLM's queue of the same cached
    blocks: segmented / vLLM seconds, median of ``rounds``."""
    ratios = []
    for _ in range(rounds):
        elapsed = {}
        for kind in ("vllm", "segmented"):
            queue, blocks = cached_queue(kind, n)
            if kind == "segmented":
                for block in blocks[::4]:
                    queue.idle(block)
                for block in blocks[1::8]:
                    queue.release(block)
            start = time.perf_counter()
            while queue.num_free_blocks >= take:
                queue.popleft_n(take)
            elapsed[kind] = time.perf_counter() - start
        ratios.append(elapsed["segmented"] / elapsed["vllm"])
    return statistics.median(ratios)


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
    counts = {kind: sum(1 for op, _ in ops if op == kind) for kind in KINDS}
    times: dict[str, list[list[float]]] = {"vllm": [], "segmented": []}
    for r in range(args.rounds):
        (vq, vb), (sq, sb) = fresh("vllm", args.blocks), fresh("segmented", args.blocks)
        vllm, segmented = replay_lockstep((vq, sq), (prepared(vb, ops), prepared(sb, ops)))
        times["vllm"].append(vllm)
        times["segmented"].append(segmented)
        print(f"  round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    per_kind: dict[str, Any] = {}
    for i, kind in enumerate(KINDS):
        vllm = statistics.median(t[i] for t in times["vllm"])
        seg = statistics.median(t[i] for t in times["segmented"])
        per_kind[kind] = {
            "operations": counts[kind],
            "vllm_ns_per_op": round(vllm / counts[kind] * 1e9, 1),
            "segmented_ns_per_op": round(seg / counts[kind] * 1e9, 1),
            "ratio": round(seg / vllm, 3),
        }
    totals = {k: statistics.median(sum(t) for t in v) for k, v in times.items()}
    paired = [sum(s) / sum(v) for s, v in zip(times["segmented"], times["vllm"], strict=True)]
    result = {
        "blocks": args.blocks,
        "operations": len(ops),
        "rounds": args.rounds,
        "same_blocks_popped": True,
        "timed": "queue calls only; arguments prepared outside the timed region",
        "per_kind": per_kind,
        "total_seconds_median": {k: round(v, 4) for k, v in totals.items()},
        "ratio_segmented_vs_vllm": round(statistics.median(paired), 3),
        "ratio_per_round": [round(x, 3) for x in paired],
        "release_ns_per_block": round(move_cost(args.blocks, "release") * 1e9, 1),
        "idle_ns_per_block": round(move_cost(args.blocks, "idle") * 1e9, 1),
        "popleft_with_idle_and_released_ratio": round(marked_pop_ratio(args.blocks), 3),
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
