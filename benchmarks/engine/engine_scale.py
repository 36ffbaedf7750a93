"""The plugin's engine cost at GPU scale, on CPU: vLLM's real ``Scheduler`` over its real
``KVCacheManager`` / ``BlockPool`` (no model) with GPU-sized pools (blocks of 16 tokens), driven
by agent traffic scaled up: requests of many sessions in flight at once, prefilled in chunks,
decoded token by token; sessions grow turn by turn, compact (the window back to the system
prompt and a summary), and end (an idle signal) while new ones start.

Vanilla and the plugin run in one process, a scheduler step of each in turn (``--interleave
round``: a round of each in turn), so a change in the machine's speed falls on both sides alike.
Vanilla is vLLM as installed: its scheduler is built, and its steps run, with every one of the
plugin's wrappers set aside.
Reported per cell: the scheduler's time per request (``add_request``, ``schedule`` and
``update_from_output``: what the engine core's step spends outside the model), the ratio, the
prompt tokens each side hit, (``--memory``) what the plugin's own structures hold, and
(``--control``) the ratio of vLLM against itself, run the same way: the harness's own spread.
``--runs 3`` runs each cell three times (both sides afresh) and reports the median run.

``--driver manager`` times the ``KVCacheManager``'s calls alone (prefix lookup, allocations,
frees, one request at a time), without the scheduler's own work per step: the stricter ratio,
where the plugin's cost is set against the smallest part of a step.

    python -m benchmarks.engine.engine_scale
        [--cells 20000:16384:30,200000:16384:300,200000:131072:40,400000:131072:40]
        [--hybrid] [--driver scheduler|manager] [--rounds 12] [--runs 1]
        [--interleave step|round] [--memory] [--control] [--profile]

A cell is ``POOL_BLOCKS:PROMPT_TOKENS:SESSIONS``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
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
RESULTS = Path(__file__).resolve().parents[1] / "results"
#: Pool blocks : prompt tokens : sessions (cycling when they hold more than the pool).
DEFAULT_CELLS = "20000:16384:30,200000:16384:300,200000:131072:40,400000:131072:40"
MAX_MODEL_LEN = 1 << 18
WHAT = {
    "scheduler": "scheduler's time (vLLM's real Scheduler: add_request, schedule, "
    "update_from_output; requests in flight together)",
    "manager": "KVCacheManager's time alone (prefix lookup, allocations, frees; one request at "
    "a time)",
}


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


#: The classes the plugin wraps (``vllm_affinity/engine/patches.py``).
_PATCHED = (
    "vllm.v1.core.block_pool.BlockPool",
    "vllm.v1.core.kv_cache_manager.KVCacheManager",
    "vllm.v1.core.sched.scheduler.Scheduler",
)


@contextmanager
def unpatched() -> Iterator[None]:
    """vLLM as installed inside: every wrapper the plugin put on its classes is set aside (a
    pool built inside carries no plugin state; calls made inside pass no wrapper)."""
    import importlib

    import wrapt

    saved = []
    for dotted in _PATCHED:
        module, _, name = dotted.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        for attr, value in list(vars(cls).items()):
            if isinstance(value, wrapt.FunctionWrapper):
                saved.append((cls, attr, value))
                setattr(cls, attr, value.__wrapped__)
    try:
        yield
    finally:
        for cls, attr, value in saved:
            setattr(cls, attr, value)


def kv_cache_config(cell: Cell) -> Any:
    """One full-attention group, or (``hybrid``) gpt-oss's shape: a 128-token sliding window
    beside full attention."""
    import torch
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
    return KVCacheConfig(
        num_blocks=cell.pool,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
    )


def manager(cell: Cell) -> Any:
    """vLLM's ``KVCacheManager`` over the cell's KV-cache groups."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    return KVCacheManager(kv_cache_config(cell), max_model_len=MAX_MODEL_LEN,
                          scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                          enable_caching=True)  # fmt: skip


def scheduler(cell: Cell) -> Any:
    """vLLM's ``Scheduler`` over the cell's KV-cache groups: chunked prefill of ``CHUNK``
    tokens a step, up to 64 requests running."""
    from vllm_affinity.testing.scheduling import scheduler as make

    return make(kv_cache_config(cell), max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
                max_num_batched_tokens=CHUNK, block_size=BLOCK)  # fmt: skip


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
    """One side of the comparison: its engine (a ``Scheduler``, or a ``KVCacheManager`` for
    ``--driver manager``), the plugin's state on it (None: vanilla), the prompt tokens it
    hit."""

    name: str
    engine: Any
    state: Any
    hit: int = 0
    requests: int = 0
    steps: int = 0
    _ids: int = 0

    def vllm_as_installed(self) -> Any:
        """Vanilla's calls pass no plugin wrapper."""
        return unpatched() if self.state is None else nullcontext()

    def request(self, hasher: Callable[..., Any], session: str, prompt: list[int]) -> Any:
        """A request of the session (hashed here, outside the timed calls: both sides hash)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self._ids += 1
        return Request(
            request_id=f"{self.name}{self._ids}", prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=DECODE, ignore_eos=True),
            pooling_params=None, block_hasher=hasher, session_id=session,
        )  # fmt: skip

    def scheduler_round(self, traffic: Traffic, hasher: Callable[..., Any], slots: int) -> float:
        """Every slot's next request through the scheduler, ``slots`` of them in flight; the
        seconds ``add_request``, ``schedule`` and ``update_from_output`` took."""
        with self.vllm_as_installed():
            return sum(self.scheduler_steps(traffic, hasher, slots))

    def scheduler_steps(
        self, traffic: Traffic, hasher: Callable[..., Any], slots: int
    ) -> Iterator[float]:
        """``scheduler_round`` a step at a time: per step, the seconds that step's
        ``add_request`` calls, ``schedule`` and ``update_from_output`` took (the caller sets
        vLLM as installed around each step for vanilla: ``vllm_as_installed``)."""
        from vllm.v1.outputs import ModelRunnerOutput

        engine, clock = self.engine, time.perf_counter
        sessions, started = traffic.cell.sessions, 0
        in_flight: dict[str, tuple[Any, str, bool]] = {}
        while started < sessions or in_flight:
            elapsed = 0.0
            while started < sessions and len(in_flight) < slots:
                window, session, last = traffic.window(started)
                request = self.request(hasher, session, window)
                in_flight[request.request_id] = (request, session, last)
                started += 1
                start = clock()
                engine.add_request(request)
                elapsed += clock() - start
            start = clock()
            output = engine.schedule()
            elapsed += clock() - start
            requests = engine.requests
            ids = list(output.num_scheduled_tokens)
            runner = ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[
                    [7] if requests[r].num_computed_tokens >= requests[r].num_tokens else []
                    for r in ids
                ],
            )  # fmt: skip
            start = clock()
            outputs = engine.update_from_output(output, runner)
            elapsed += clock() - start
            self.steps += 1
            for batch in outputs.values():
                for out in batch.outputs:
                    if out.prefill_stats is not None:  # with the request's first token
                        self.hit += out.prefill_stats.num_local_cached_tokens
                    if out.finish_reason is None:
                        continue
                    _, session, last = in_flight.pop(out.request_id)
                    self.requests += 1
                    if last and self.state is not None:
                        self.state.idle_session(session)
            yield elapsed

    def manager_round(self, traffic: Traffic, hasher: Callable[..., Any], slots: int) -> float:
        """Every slot's next request on the ``KVCacheManager`` alone, one at a time, as the
        scheduler calls it; the seconds those calls took (the plugin's binding from the ids
        the scheduler reads for its output included)."""
        elapsed = 0.0
        for slot in range(traffic.cell.sessions):
            window, session, last = traffic.window(slot)
            elapsed += self.serve(self.request(hasher, session, window), session)
            if last and self.state is not None:
                self.state.idle_session(session)
        return elapsed

    def serve(self, request: Any, session: str) -> float:
        kv, state, rid = self.engine, self.state, request.request_id
        start = time.perf_counter()
        if state is not None:
            state.on_new_request(request, release_on_divergence=False)
        computed, hit = kv.get_computed_blocks(request)[:2]
        done = hit
        first = True
        while done < request.num_tokens:  # chunked prefill
            step = min(CHUNK, request.num_tokens - done)
            blocks = (
                kv.allocate_slots(request, step, hit, computed)
                if first
                else kv.allocate_slots(request, step)
            )
            if blocks is None:
                raise RuntimeError(f"{self.name}: the pool is too small for one request")
            # the scheduler's output: a new request's every block id, a running one's new ones
            ids = kv.get_blocks(rid).get_block_ids() if first else blocks.get_block_ids(True)
            if state is not None and ids is not None:  # what the step wrapper binds
                state.bind_scheduled(session, rid, ids, request.num_prompt_tokens, not first)
            first = False
            done += step
            request.num_computed_tokens = done
        for _ in range(DECODE):
            request.append_output_token_ids(7)
            ids = kv.allocate_slots(request, 1).get_block_ids(allow_none=True)
            if state is not None and ids is not None:
                state.bind_scheduled(session, rid, ids, request.num_prompt_tokens, True)
            request.num_computed_tokens += 1
        kv.free(request)
        elapsed = time.perf_counter() - start
        self.hit += hit
        self.requests += 1
        return elapsed


def in_flight(cell: Cell) -> int:
    """Requests the scheduler driver keeps in flight: up to 16, half the sessions, and what
    half the pool holds at the longest prompt."""
    per_request = -(-(cell.prompt + DECODE) // BLOCK) * (2 if cell.hybrid else 1)
    return max(1, min(16, cell.sessions // 2, cell.pool // (2 * per_request)))


def build(cell: Cell, driver: str, plugin: bool) -> Side:
    """One side's engine (vanilla's built with the plugin's wrappers set aside)."""
    from vllm_affinity.engine import affinity_of

    make = scheduler if driver == "scheduler" else manager
    with nullcontext() if plugin else unpatched():
        engine = make(cell)
    kv = engine.kv_cache_manager if driver == "scheduler" else engine
    state = affinity_of(kv.block_pool)
    assert (state is not None) == plugin
    return Side("plugin" if plugin else "vanilla", engine, state)


def _hasher() -> Callable[..., Any]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK, sha256)


def _alternate(
    sides: list[Side],
    cell: Cell,
    rounds: int,
    driver: str,
    profile: bool = False,
    interleave: str = "step",
) -> dict[str, list[float]]:
    """Each side's seconds per request, round by round: the two sides' steps interleaved
    (``step``: one side's scheduler step, then the other's, the first side changing every step,
    so a change in the machine's speed falls on both alike), or (``round``, and the manager
    driver) one side's whole round, then the other's, the first side changing every round."""
    hasher = _hasher()
    traffic = {side.name: Traffic(cell) for side in sides}
    per_round: dict[str, list[float]] = {side.name: [] for side in sides}
    slots = in_flight(cell)
    profiler = cProfile.Profile() if profile else None
    gc.disable()
    try:
        for round_ in range(rounds):
            served = {side.name: side.requests for side in sides}
            if driver == "scheduler" and interleave == "step":
                seconds = _lockstep_round(sides, traffic, hasher, slots, round_, profiler)
            else:
                seconds = {}
                for side in sides if round_ % 2 == 0 else reversed(sides):
                    with _profiled(profiler if side.state is not None else None):
                        if driver == "scheduler":
                            took = side.scheduler_round(traffic[side.name], hasher, slots)
                        else:
                            with side.vllm_as_installed():
                                took = side.manager_round(traffic[side.name], hasher, slots)
                    seconds[side.name] = took
                    gc.collect()
            for side in sides:
                done = max(1, side.requests - served[side.name])
                per_round[side.name].append(seconds[side.name] / done)
            gc.collect()
            first, second = (per_round[side.name][-1] * 1e3 for side in sides)
            print(
                f"  round {round_ + 1}/{rounds}: {sides[0].name} {first:.2f} ms, "
                f"{sides[1].name} {second:.2f} ms per request",
                flush=True,
            )
    finally:
        gc.enable()
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(
            "vllm_affinity|queue|block_pool|scheduler", 30
        )
    return per_round


def _lockstep_round(
    sides: list[Side],
    traffic: dict[str, Traffic],
    hasher: Callable[..., Any],
    slots: int,
    round_: int,
    profiler: cProfile.Profile | None,
) -> dict[str, float]:
    """One round of both sides, a scheduler step of each in turn (a side that finished its
    round waits for the other); the seconds each side's steps took."""
    steps = {side.name: side.scheduler_steps(traffic[side.name], hasher, slots) for side in sides}
    seconds = dict.fromkeys(steps, 0.0)
    running = list(sides)
    turn = round_
    while running:
        order = running if turn % 2 == 0 else running[::-1]
        turn += 1
        for side in order:
            with side.vllm_as_installed(), _profiled(None if side.state is None else profiler):
                took = next(steps[side.name], None)
            if took is None:
                running.remove(side)
            else:
                seconds[side.name] += took
    return seconds


@contextmanager
def _profiled(profiler: cProfile.Profile | None) -> Iterator[None]:
    if profiler is None:
        yield
        return
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()


def _steady_median(values: list[float]) -> float:
    """The median of the steady rounds (the first two start sessions; all of a short run)."""
    return statistics.median(values[2:] if len(values) > 3 else values)


def _steady_ratio(first: list[float], second: list[float]) -> tuple[float, list[float]]:
    """The median of the steady rounds' ratios, and every round's."""
    ratios = [b / a for a, b in zip(first, second, strict=True)]
    return _steady_median(ratios), ratios


def run_cell(
    cell: Cell, rounds: int, driver: str, profile: bool = False, interleave: str = "step"
) -> dict[str, Any]:
    sides = [build(cell, driver, plugin=False), build(cell, driver, plugin=True)]
    state = sides[1].state
    per_round = _alternate(sides, cell, rounds, driver, profile, interleave)
    vanilla, plugin = (_steady_median(per_round[s.name]) for s in sides)
    ratio, ratios = _steady_ratio(per_round["vanilla"], per_round["plugin"])
    return {
        "cell": cell.name, "pool_blocks": cell.pool, "prompt_tokens": cell.prompt,
        "sessions": cell.sessions, "hybrid": cell.hybrid, "rounds": rounds, "driver": driver,
        "interleave": interleave if driver == "scheduler" else "round",
        "in_flight": in_flight(cell) if driver == "scheduler" else 1,
        "vanilla_ms": vanilla * 1e3, "plugin_ms": plugin * 1e3,
        "ratio": ratio, "round_ratios": ratios,
        "hit_tokens": {s.name: s.hit for s in sides},
        "steps_per_request": {s.name: s.steps / max(1, s.requests) for s in sides},
        "blocks_predicted": state.stats().blocks_predicted,
        # what the plugin timed of itself on the scheduler path (/metrics), per request
        "plugin_own_ms": state.stats().counter("engine_us") / 1e3 / max(1, sides[1].requests),
    }  # fmt: skip


def repeated_cell(
    cell: Cell,
    runs: int,
    rounds: int,
    driver: str,
    profile: bool = False,
    interleave: str = "step",
) -> dict[str, Any]:
    """``run_cell`` ``runs`` times over (both sides built afresh each time): the median run's
    row, with every run's ratio. One run's ratio moves by up to 0.04 on a shared machine (its
    process's memory layout, the machine's load); the median of three moves less. The hits
    are the same in every run (the traffic and both sides are deterministic): a run that hit
    otherwise fails the cell."""
    rows = []
    for run in range(runs):
        if runs > 1:
            print(f"  run {run + 1}/{runs}", flush=True)
        rows.append(run_cell(cell, rounds, driver, profile, interleave))
        gc.collect()
    hits = {json.dumps(row["hit_tokens"], sort_keys=True) for row in rows}
    if len(hits) > 1:
        raise RuntimeError(f"{cell.name}: the runs hit differently: {sorted(hits)}")
    row = sorted(rows, key=lambda r: r["ratio"])[(runs - 1) // 2]
    return {**row, "runs": runs, "run_ratios": [r["ratio"] for r in rows]}


def control_ratio(cell: Cell, rounds: int, driver: str, interleave: str = "step") -> dict[str, Any]:
    """vLLM against itself, as ``run_cell`` runs the two sides (built one after the other,
    rounds alternating): how far the ratio strays with no plugin at all, on this machine now."""
    first = build(cell, driver, plugin=False)
    second = build(cell, driver, plugin=False)
    second.name = "control"
    per_round = _alternate([first, second], cell, rounds, driver, interleave=interleave)
    ratio, ratios = _steady_ratio(per_round["vanilla"], per_round["control"])
    return {"ratio": ratio, "round_ratios": ratios}


def plugin_memory(cell: Cell, rounds: int, driver: str) -> float:
    """MB the plugin's own code holds after ``rounds`` of the traffic (tracemalloc, counting
    only allocations made in ``vllm_affinity``)."""
    hasher = _hasher()
    tracemalloc.start()
    side, traffic = build(cell, driver, plugin=True), Traffic(cell)
    for _ in range(rounds):
        if driver == "scheduler":
            side.scheduler_round(traffic, hasher, in_flight(cell))
        else:
            side.manager_round(traffic, hasher, 1)
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
    parser.add_argument("--driver", choices=("scheduler", "manager"), default="scheduler")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument(
        "--runs", type=int, default=1,
        help="run each cell this many times (odd: the median run is reported, with every "
        "run's ratio)",
    )  # fmt: skip
    parser.add_argument(
        "--interleave", choices=("step", "round"), default="step",
        help="the scheduler driver's sides take turns a step at a time (default) or a round at "
        "a time",
    )  # fmt: skip
    parser.add_argument("--memory", action="store_true")
    parser.add_argument(
        "--control", action="store_true",
        help="also run vanilla against itself per cell: the ratio's spread with no plugin",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true",
        help="print where the plugin side's time goes (cProfile, 25 costliest functions)",
    )  # fmt: skip
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.runs < 1 or args.runs % 2 == 0:
        parser.error(f"--runs takes an odd number of runs (a median run), not {args.runs}")
    cells = parse_cells(args.cells, False)
    if args.hybrid:
        cells += parse_cells(args.cells, True)
    from jiuwen_replay.output import write_outputs
    from vllm_affinity.engine import apply_engine_patches

    apply_engine_patches()
    rows = []
    for cell in cells:
        print(f"{cell.name}:", flush=True)
        row = repeated_cell(
            cell, args.runs, args.rounds, args.driver, args.profile, args.interleave
        )
        if args.memory:
            row["plugin_mb"] = plugin_memory(cell, args.rounds, args.driver)
        if args.control:
            print(f"{cell.name}, vanilla against itself:", flush=True)
            row["control"] = control_ratio(cell, args.rounds, args.driver, args.interleave)
        rows.append(row)
    command = " ".join(
        ["python -m benchmarks.engine.engine_scale", *(argv if argv is not None else sys.argv[1:])]
    )
    lines = [
        f"Command: `{command}`",
        "",
        f"The {WHAT[args.driver]} per request at GPU scale (blocks of {BLOCK} tokens, prefill "
        f"chunks of {CHUNK}, {DECODE} tokens decoded per turn; vanilla: vLLM as installed)",
        "",
        "| cell | vanilla ms / request | plugin ms / request | ratio | the plugin's own ms / "
        "request | prompt tokens hit (vanilla / plugin) | plugin MB |"
        + (" vanilla against itself |" if args.control else "")
        + (" every run's ratio |" if args.runs > 1 else ""),
        "|---|---:|---:|---:|---:|---|---:|"
        + ("---:|" if args.control else "")
        + ("---|" if args.runs > 1 else ""),
    ]
    for row in rows:
        mb = f"{row['plugin_mb']:.1f}" if "plugin_mb" in row else "n/a"
        hits = row["hit_tokens"]
        lines.append(
            f"| {row['cell']} | {row['vanilla_ms']:.2f} | {row['plugin_ms']:.2f} | "
            f"x{row['ratio']:.2f} | {row['plugin_own_ms']:.2f} | "
            f"{hits['vanilla'] / 1e6:.2f}M / {hits['plugin'] / 1e6:.2f}M "
            f"| {mb} |"
            + (f" x{row['control']['ratio']:.2f} |" if "control" in row else "")
            + (
                " " + ", ".join(f"x{r:.3f}" for r in row["run_ratios"]) + " |"
                if args.runs > 1
                else ""
            )
        )
    lines += ["", "The ratio is the median of the steady rounds' ratios."]
    if args.runs > 1:
        lines[-1] += (
            f" Each cell ran {args.runs} times (both sides built afresh): its row is the run "
            "with the median ratio, and every run's ratio is listed in run order."
        )
    if args.control:
        lines[-1] += (
            " Vanilla against itself: the same measurement with vLLM as installed on both sides "
            "(no plugin anywhere), the spread of the ratio on this machine in this run."
        )
    write_outputs(args.out, "engine_scale", {"config": vars(args), "rows": rows},
                  "\n".join(lines) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
