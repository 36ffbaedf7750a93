"""The plugin's engine cost at GPU scale, on CPU: vLLM's real ``KVCacheManager`` / ``BlockPool``
(no model) with GPU-sized pools (blocks of 16 tokens), driven as the scheduler drives them for
agent traffic: per request, the session's window looked up, allocated in prefill chunks (the
block ids read as the scheduler reads them for its output), decoded token by token, freed;
sessions grow turn by turn, compact (the window back to the system prompt and a summary), and
end (an idle signal) while new ones start.

Vanilla and the plugin run in one process, rounds alternating: the vanilla manager's pool is
built with the plugin's ``BlockPool.__init__`` wrapper set aside, so it carries no plugin state
(its calls pass through the other wrappers at one attribute check each). Reported per cell:
the scheduler-side time per request (the plugin's request hook, prefix lookup, allocations,
frees), the ratio, the prompt tokens each side hit, and (``--memory``) what the plugin's own
structures hold.

    python -m benchmarks.engine_scale
        [--cells 20000:16384:30,200000:16384:300,200000:131072:40,400000:131072:40]
        [--hybrid] [--rounds 12] [--memory] [--profile]

A cell is ``POOL_BLOCKS:PROMPT_TOKENS:SESSIONS``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 16
#: The scheduler's prefill chunk (vLLM's ``max_num_batched_tokens`` on a GPU).
CHUNK = 8192
#: Tokens decoded per turn (an agent's tool call).
DECODE = 64
#: The system prompt and tools every session shares.
SYSTEM = 4096
RESULTS = Path(__file__).resolve().parent / "results"
#: Pool blocks : prompt tokens : sessions (cycling when they hold more than the pool).
DEFAULT_CELLS = "20000:16384:30,200000:16384:300,200000:131072:40,400000:131072:40"


@dataclass(frozen=True)
class Cell:
    pool: int
    prompt: int
    sessions: int
    hybrid: bool = False

    @property
    def name(self) -> str:
        kind = "hybrid" if self.hybrid else "full"
        return (
            f"{self.pool // 1000}k blocks, {self.prompt // 1024}k tokens, "
            f"{self.sessions} sessions, {kind}"
        )


@contextmanager
def vanilla_pools() -> Iterator[None]:
    """Block pools built inside are vLLM's own: the plugin's ``BlockPool.__init__`` wrapper is
    set aside, so no plugin state is attached (the other wrappers then pass straight through)."""
    from vllm.v1.core.block_pool import BlockPool

    wrapper = BlockPool.__dict__["__init__"]
    BlockPool.__init__ = wrapper.__wrapped__  # type: ignore[method-assign]
    try:
        yield
    finally:
        BlockPool.__init__ = wrapper  # type: ignore[method-assign]


def manager(cell: Cell) -> Any:
    """vLLM's ``KVCacheManager`` over one full-attention group, or (``hybrid``) gpt-oss's shape:
    a 128-token sliding window beside full attention."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    specs: list[Any] = [full]
    if cell.hybrid:
        specs.insert(0, SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                          dtype=torch.float32, sliding_window=128))  # fmt: skip
    config = KVCacheConfig(
        num_blocks=cell.pool,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
    )
    return KVCacheManager(config, max_model_len=1 << 20, scheduler_block_size=BLOCK,
                          hash_block_size=BLOCK, enable_caching=True)  # fmt: skip


@dataclass
class Traffic:
    """Each slot's sessions, turn by turn: the shared system prompt, the session's own task,
    then per turn the answer and a tool's output; a compaction every ``compact_every`` turns
    (back to the system prompt and a summary). A session lasts ``life`` turns: at its last it
    goes idle (the agent says so: its blocks are evicted first) and the slot's next session
    starts, so sessions come and go as they do on a server."""

    cell: Cell
    compact_every: int = 6
    life: int = 9
    windows: dict[int, list[int]] = field(default_factory=dict)
    turns: dict[int, int] = field(default_factory=dict)

    def window(self, slot: int) -> tuple[list[int], str, bool]:
        """The slot's next window, its session, and whether the session ends with it."""
        turn = self.turns.get(slot, 0)
        self.turns[slot] = turn + 1
        age, generation = turn % self.life, turn // self.life
        session = f"s{slot}.{generation}"
        base = 10**9 + slot * 10**7 + turn * 10**5
        grow = max(BLOCK, self.cell.prompt // (2 * self.compact_every))
        last = age == self.life - 1
        if age == 0:  # a session starts half-way to its longest window
            task = list(range(base, base + self.cell.prompt // 2 - SYSTEM))
            self.windows[slot] = [*range(SYSTEM), *task]
        elif age % self.compact_every == 0:
            self.windows[slot] = [*range(SYSTEM), *range(base, base + 2048)]
        else:
            window = self.windows[slot]
            window += [*range(base, base + DECODE), *range(base + DECODE, base + grow)]
            del window[self.cell.prompt - 1 :]  # a window never outgrows the longest prompt
        return self.windows[slot], session, last


@dataclass
class Side:
    """One side of the comparison: its manager, the time its scheduler-side calls took, the
    prompt tokens it hit."""

    name: str
    kv: Any
    state: Any
    seconds: list[float] = field(default_factory=list)
    hit: int = 0
    requests: int = 0
    _ids: int = 0

    def serve(self, hasher: Callable[..., Any], session: str, prompt: list[int]) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self._ids += 1
        request = Request(
            request_id=f"{self.name}{self._ids}", prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=DECODE), pooling_params=None,
            block_hasher=hasher, session_id=session,
        )  # fmt: skip
        kv = self.kv
        start = time.perf_counter()
        if self.state is not None:
            self.state.on_new_request(request, release_on_divergence=False)
        computed, hit = kv.get_computed_blocks(request)[:2]
        done = hit
        first = True
        while done < request.num_tokens:  # chunked prefill
            step = min(CHUNK, request.num_tokens - done)
            if first:
                blocks = kv.allocate_slots(request, step, hit, computed)
            else:
                blocks = kv.allocate_slots(request, step)
            if blocks is None:
                raise RuntimeError(f"{self.name}: the pool is too small for one request")
            # the scheduler's output: a new request's every block id, a running one's new ones
            if first:
                kv.get_blocks(request.request_id).get_block_ids()
                first = False
            else:
                blocks.get_block_ids(allow_none=True)
            done += step
            request.num_computed_tokens = done
        for _ in range(DECODE):
            request.append_output_token_ids(7)
            kv.allocate_slots(request, 1).get_block_ids(allow_none=True)
            request.num_computed_tokens += 1
        kv.free(request)
        self.seconds.append(time.perf_counter() - start)
        self.hit += hit
        self.requests += 1


def run_cell(
    cell: Cell, rounds: int, vanilla_kv: Any, plugin_kv: Any, profile: bool = False
) -> dict[str, Any]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    from vllm_affinity.engine import affinity_of

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    state = affinity_of(plugin_kv.block_pool)
    assert state is not None and affinity_of(vanilla_kv.block_pool) is None
    sides = [Side("vanilla", vanilla_kv, None), Side("plugin", plugin_kv, state)]
    traffic = {side.name: Traffic(cell) for side in sides}
    per_round: dict[str, list[float]] = {side.name: [] for side in sides}
    gc.disable()
    try:
        for round_ in range(rounds):
            for side in sides if round_ % 2 == 0 else reversed(sides):
                profiler = cProfile.Profile() if profile and side.state is not None else None
                if profiler is not None:
                    profiler.enable()
                mark = len(side.seconds)
                for slot in range(cell.sessions):
                    window, session, last = traffic[side.name].window(slot)
                    side.serve(hasher, session, window)
                    if last and side.state is not None:
                        side.state.idle_session(session)
                if profiler is not None:
                    profiler.disable()
                    pstats.Stats(profiler).sort_stats("tottime").print_stats(
                        "vllm_affinity|queue|block_pool", 30
                    )
                per_round[side.name].append(statistics.mean(side.seconds[mark:]))
                gc.collect()
            print(
                f"  round {round_ + 1}/{rounds}: vanilla {per_round['vanilla'][-1] * 1e3:.2f} ms, "
                f"plugin {per_round['plugin'][-1] * 1e3:.2f} ms per request",
                flush=True,
            )
    finally:
        gc.enable()
    steady = slice(2, None) if rounds > 3 else slice(None)  # the first rounds start sessions
    vanilla, plugin = (statistics.median(per_round[s.name][steady]) for s in sides)
    ratios = [p / v for v, p in zip(per_round["vanilla"], per_round["plugin"], strict=True)]
    return {
        "cell": cell.name, "pool_blocks": cell.pool, "prompt_tokens": cell.prompt,
        "sessions": cell.sessions, "hybrid": cell.hybrid, "rounds": rounds,
        "vanilla_ms": vanilla * 1e3, "plugin_ms": plugin * 1e3,
        "ratio": statistics.median(ratios[steady]), "round_ratios": ratios,
        "hit_tokens": {s.name: s.hit for s in sides},
        "blocks_predicted": state.stats().blocks_predicted,
        # what the plugin timed of itself on the scheduler path (/metrics), per request
        "plugin_own_ms": state.stats().counter("engine_us") / 1e3 / max(1, sides[1].requests),
    }  # fmt: skip


def plugin_memory(cell: Cell, rounds: int) -> float:
    """MB the plugin's own code holds after ``rounds`` of the traffic (tracemalloc, counting
    only allocations made in ``vllm_affinity``)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    from vllm_affinity.engine import affinity_of

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    tracemalloc.start()
    kv = manager(cell)
    side, traffic = Side("memory", kv, affinity_of(kv.block_pool)), Traffic(cell)
    for _ in range(rounds):
        for slot in range(cell.sessions):
            window, session, _ = traffic.window(slot)
            side.serve(hasher, session, window)
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, "*vllm_affinity*")]
    )
    tracemalloc.stop()
    return sum(stat.size for stat in snapshot.statistics("filename")) / 2**20


def parse_cells(text: str, hybrid: bool) -> list[Cell]:
    cells = []
    for part in text.split(","):
        try:
            pool, prompt, sessions = (int(x) for x in part.split(":"))
        except ValueError:
            raise SystemExit(
                f"a cell is POOL_BLOCKS:PROMPT_TOKENS:SESSIONS, not {part!r}"
            ) from None
        cells.append(Cell(pool, prompt, sessions, hybrid))
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default=DEFAULT_CELLS)
    parser.add_argument("--hybrid", action="store_true", help="also every cell on a hybrid spec")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument(
        "--profile", action="store_true",
        help="print where the plugin side's time goes (cProfile, 25 costliest functions)",
    )  # fmt: skip
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    cells = parse_cells(args.cells, False)
    if args.hybrid:
        cells += parse_cells(args.cells, True)
    from jiuwen_replay.output import write_outputs
    from vllm_affinity.engine import apply_engine_patches

    apply_engine_patches()
    rows = []
    for cell in cells:
        print(f"{cell.name}:", flush=True)
        with vanilla_pools():
            vanilla_kv = manager(cell)
        row = run_cell(cell, args.rounds, vanilla_kv, manager(cell), args.profile)
        del vanilla_kv
        gc.collect()
        if args.memory:
            row["plugin_mb"] = plugin_memory(cell, args.rounds)
        rows.append(row)
    command = " ".join(
        ["python -m benchmarks.engine_scale", *(argv if argv is not None else sys.argv[1:])]
    )
    lines = [
        f"Command: `{command}`",
        "",
        "The plugin's scheduler-side time per request at GPU scale (vLLM's real KVCacheManager, "
        f"blocks of {BLOCK} tokens, prefill chunks of {CHUNK}, {DECODE} tokens decoded per turn)",
        "",
        "| cell | vanilla ms / request | plugin ms / request | ratio | the plugin's own ms / "
        "request | prompt tokens hit (vanilla / plugin) | plugin MB |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        mb = f"{row['plugin_mb']:.1f}" if "plugin_mb" in row else "n/a"
        hits = row["hit_tokens"]
        lines.append(
            f"| {row['cell']} | {row['vanilla_ms']:.2f} | {row['plugin_ms']:.2f} | "
            f"x{row['ratio']:.2f} | {row['plugin_own_ms']:.2f} | "
            f"{hits['vanilla'] / 1e6:.2f}M / {hits['plugin'] / 1e6:.2f}M "
            f"| {mb} |"
        )
    lines += ["", "The ratio is the median of the steady rounds' ratios."]
    write_outputs(args.out, "engine_scale", {"config": vars(args), "rows": rows},
                  "\n".join(lines) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
