"""What does the plugin give at full size? An agent trace at 1x tokens through vLLM's real
``Scheduler`` at GPU pool sizes (no model), vanilla beside the plugin.

Each trace request becomes a request of its full prompt (the trace's ``input_tokens``; block ids
made into tokens, equal ids equal tokens) with its recorded output (capped at ``--max-output``
decode steps). The model's answer is what the session's next prompt carries at those positions
(the sampled tokens are read from it), so an answer's blocks are hit by the next call as on a
real server, not left dead by the replay.
Requests enter in the trace's time order, ``--in-flight`` at a time, a session's next call after
its last one finished (an agent waits for its answer). The plugin side is the engine as a server
runs it with ``VLLM_AFFINITY_RELEASE_ON_DIVERGENCE=true``: a request that diverges from its
session's last one (a compaction) releases the stale blocks in the engine's own add-request
path, and a session's last call ends with its idle signal (the lifecycle's). Vanilla is vLLM as
installed (every plugin wrapper set aside); on a hybrid pool a third side is vanilla with
vLLM's own alternative, a retention interval (``--prefix-cache-retention-interval 480``: a
sliding-window state every 480 tokens; it acts on no full-attention group, so a one-group pool
has no such side). With ``--cpu-tier CHUNKS`` both sides run vLLM's
``OffloadingConnector`` (scheduler side; the test harness completes its copies at once) with a
CPU tier of that many blocks.

Reported per pool: prompt tokens sent, hit on the GPU, loaded from the CPU tier, computed
(sent - hit - loaded), the share of vanilla's computed tokens each side saves, the plugin's
releases and ``released_hit``; the bound beside them (no CPU tier): Belady's eviction (the
block used farthest ahead goes first) in ``jiuwen_replay``'s simulator on the same prompts and
answers, one call at a time (on a hybrid pool, the whole pool given to full attention: what no
policy there can beat), and the share of vanilla's gap to it the plugin closes; the
scheduler's time per step on each side and the plugin's own. The sides run in one process, a
scheduler step of each in turn (the first changing every turn), so a change in the machine's
speed falls on each alike; where they hit differently they do different work, and the
plugin's own time is the like-for-like figure.

The pools (16-token blocks, ``--gpu-memory-utilization 0.9``, bf16 KV cache):

- ``llama-8b-h100``: Llama-3.1-8B (32 layers, 8 KV heads of 128) on one H100 80 GB: 72 GB less
  16 GB of weights, 128 KiB of KV per token: 26,700 blocks (427k tokens);
- ``llama-8b-h200``: the same on one H200 141 GB: 127 GB less 16 GB: 55,500 blocks;
- ``qwen-32b-fp8-h100``: Qwen2.5-32B with FP8 weights (64 layers, 8 KV heads of 128) on one
  H100: 72 GB less 33 GB, 256 KiB per token: 9,500 blocks (152k tokens);
- ``gpt-oss-120b-h200`` (hybrid: a 128-token sliding window beside full attention):
  gpt-oss-120b (36 layers, 8 KV heads of 64; MXFP4 weights, ~65 GB) on one H200 141 GB: 62 GB
  at 576 KiB per block of a group's 18 layers: 105,000 blocks;
- ``gpt-oss-20b-l4`` (hybrid, the same shape): gpt-oss-20b (24 layers; ~13 GB of MXFP4 weights)
  on one L4 24 GB: 7.5 GB at 384 KiB per block of a group's 12 layers: 20,000 blocks.

    python -m benchmarks.engine.trace_engine [--trace PATH] [--format agentinfer]
        [--pools llama-8b-h100,qwen-32b-fp8-h100] [--no-bound] [--in-flight 8] [--max-output 256]
        [--cpu-tier BLOCKS] [--limit N] [--out benchmarks/results/trace_engine]

A pool may also be ``BLOCKS`` or ``hybrid:BLOCKS``. ``--trace`` defaults to the Claude Code
trace of the ``agentinfer`` package (PyPI ``agentinfer==0.2.0``; its wheel's
``agentbench/data/agentinfer_trace_requests.jsonl`` alone is enough: ``--trace`` that file);
``--trace synthetic`` is ``jiuwen_replay.synthetic.FULL_SIZE`` (16 leads of 43 calls, 64
subagents, windows to ~130k tokens, 16 compactions: the agent study's shape, made here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.engine.engine_scale import (
    BLOCK,
    MAX_MODEL_LEN,
    Cell,
    kv_cache_config,
    unpatched,
)

RESULTS = Path(__file__).resolve().parents[1] / "results"
#: vLLM's own alternative on a hybrid pool: a sliding-window state every this many tokens.
RETENTION_INTERVAL = 480
#: (side, the plugin on, retention interval): the interval side runs on hybrid pools only.
SIDES = (
    ("vanilla", False, 0),
    ("vanilla+interval", False, RETENTION_INTERVAL),
    ("plugin", True, 0),
)


@dataclass(frozen=True)
class Pool:
    """A GPU pool a deployment has: its blocks, and the model and card it stands for."""

    name: str
    blocks: int
    stands_for: str
    hybrid: bool = False


POOLS = {
    pool.name: pool
    for pool in (
        Pool("llama-8b-h100", 26_700, "Llama-3.1-8B bf16 on one H100 80 GB"),
        Pool("llama-8b-h200", 55_500, "Llama-3.1-8B bf16 on one H200 141 GB"),
        Pool("qwen-32b-fp8-h100", 9_500, "Qwen2.5-32B FP8 weights on one H100 80 GB"),
        Pool("gpt-oss-20b-l4", 20_000, "gpt-oss-20b on one L4 24 GB", hybrid=True),
        Pool("gpt-oss-120b-h200", 105_000, "gpt-oss-120b on one H200 141 GB", hybrid=True),
    )
}


def pool_of(name: str) -> Pool:
    """A named pool, or ``BLOCKS`` / ``hybrid:BLOCKS`` (a pool of that many blocks)."""
    if name in POOLS:
        return POOLS[name]
    hybrid = name.startswith("hybrid:")
    size = name.removeprefix("hybrid:")
    if not size.isdigit() or int(size) < 2:
        raise ValueError(f"unknown pool {name!r}: one of {sorted(POOLS)}, BLOCKS or hybrid:BLOCKS")
    return Pool(name, int(size), f"a pool of {int(size):,} blocks", hybrid)


@dataclass
class Side:
    """One side's scheduler and what it served."""

    name: str
    engine: Any
    state: Any  # the plugin's PoolAffinity (None: vanilla)
    sent: int = 0
    hit: int = 0
    loaded: int = 0
    steps: int = 0
    seconds: float = 0.0
    finished: list[str] = field(default_factory=list)


def kv_config(pool: Pool, tensor: bool) -> Any:
    """``engine_scale``'s layout (one full-attention group, or gpt-oss's shape) at the pool's
    size; ``tensor``: with the backing tensor an offloader sizes its tier from."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    config = kv_cache_config(Cell(pool.blocks, 0, 0, pool.hybrid))
    if not tensor:
        return config
    page = config.kv_cache_groups[-1].kv_cache_spec.page_size_bytes
    size = page * pool.blocks
    layout = KVCacheTensor(size=size, layers=["layer0"], layer_stride=size, block_stride=page)
    return replace(config, kv_cache_tensors=[layout])


def build(
    name: str, pool: Pool, plugin: bool, in_flight: int, cpu_tier: int, interval: int
) -> Side:
    from vllm.config import KVTransferConfig

    from vllm_affinity.engine import affinity_of
    from vllm_affinity.testing.scheduling import scheduler

    transfer = None
    if cpu_tier:
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

        chunk = max(kv_config(pool, True).kv_cache_tensors[0].block_stride,
                    CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)  # fmt: skip
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": chunk * cpu_tier},
        )  # fmt: skip
    config = replace(kv_config(pool, bool(cpu_tier)), prefix_cache_retention_interval=interval)
    with unpatched() if not plugin else nullcontext():
        engine = scheduler(
            config, max_model_len=MAX_MODEL_LEN,
            max_num_seqs=in_flight, max_num_batched_tokens=8192, block_size=BLOCK,
            kv_transfer_config=transfer,
        )  # fmt: skip
    state = affinity_of(engine.kv_cache_manager.block_pool)
    assert (state is not None) == plugin
    if state is not None:
        state.idle_guard = None  # a replay's idles are the trace's session ends
    return Side(name, engine, state)


def prompt_of(request: Any, block_tokens: int) -> list[int]:
    """The request's prompt: ``block_tokens`` tokens per block id (equal ids, equal tokens),
    cut to its recorded length."""
    tokens = [t for b in request.blocks for t in range(b * block_tokens, (b + 1) * block_tokens)]
    length = request.input_tokens or len(tokens)
    return tokens[: min(length, len(tokens))]


def answers(trace: Any, max_output: int) -> Iterator[tuple[int, list[int], list[int]]]:
    """Each call's index, prompt and answer: the answer's tokens are what the session's next
    prompt carries at their places (the model said what the agent sends back)."""
    after: dict[int, int] = {}
    seen: dict[str, int] = {}
    for n, call in enumerate(trace.requests):
        if call.session in seen:
            after[seen[call.session]] = n
        seen[call.session] = n
    for n, call in enumerate(trace.requests):
        prompt = prompt_of(call, trace.block_tokens)
        steps = max(1, min(max_output, call.output_tokens))
        following = prompt_of(trace.requests[after[n]], trace.block_tokens) if n in after else []
        tail = following[len(prompt) : len(prompt) + steps]
        yield n, prompt, tail + [7] * (steps - len(tail))


def bounds(trace: Any, pool: Pool, max_output: int) -> dict[str, int]:
    """Computed prompt tokens in ``jiuwen_replay``'s simulator, one call at a time: LRU (as
    vLLM) and Belady (the bound), the pool's blocks all given to full attention."""
    from jiuwen_replay.simulator import Request, simulate

    calls = [
        Request(trace.requests[n].session, tuple(prompt), answer=tuple(answer))
        for n, prompt, answer in answers(trace, max_output)
    ]
    out = {}
    for policy in ("lru", "belady"):
        result = simulate(calls, pool.blocks, policy, BLOCK)
        out[policy] = int(result["query_tokens"] - result["hit_tokens"])
    return out


def done_report(output: Any) -> Any:
    """What the offloader's workers would report: every copy of the step done."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput

    meta = output.kv_connector_metadata
    if not isinstance(meta, OffloadingConnectorMetadata):
        return None
    jobs = {**meta.load_jobs, **meta.store_jobs}
    return KVConnectorOutput(
        finished_recving={job.req_id for job in meta.load_jobs.values()} or None,
        kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(jobs, 1)),
    )


def _sampled(request: Any, answer: list[int]) -> list[int]:
    """The token a request whose prompt is computed samples: its answer's next one."""
    if request.num_computed_tokens < request.num_tokens:
        return []
    at = request.num_tokens - request.num_prompt_tokens
    return [answer[at] if at < len(answer) else 7]


def replay(side: Side, trace: Any, in_flight: int, max_output: int) -> Iterator[None]:
    """The trace through the side's scheduler (see the module's docstring), a step per
    ``next``: the caller runs the two sides' steps in turn."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    last_call = {r.session: n for n, r in enumerate(trace.requests)}
    calls = answers(trace, max_output)  # one call's prompt at a time: full size is large
    upcoming = next(calls, None)
    #: request id -> (trace index, session, its answer)
    running: dict[str, tuple[int, str, list[int]]] = {}
    busy: set[str] = set()
    engine, clock = side.engine, time.perf_counter
    context = unpatched if side.state is None else nullcontext
    while upcoming is not None or running:
        while (
            upcoming is not None
            and len(running) < in_flight
            and trace.requests[upcoming[0]].session not in busy
        ):
            index, prompt, answer = upcoming
            upcoming = next(calls, None)
            call = trace.requests[index]
            request = Request(
                request_id=f"{side.name}{index}", prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=len(answer), ignore_eos=True),
                pooling_params=None, block_hasher=hasher, session_id=call.session,
            )  # fmt: skip
            side.sent += len(prompt)
            running[request.request_id] = (index, call.session, answer)
            busy.add(call.session)
            with context():
                start = clock()
                engine.add_request(request)
                side.seconds += clock() - start
        with context():
            start = clock()
            output = engine.schedule()
            requests = engine.requests
            ids = list(output.num_scheduled_tokens)
            runner = ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[_sampled(requests[r], running[r][2]) for r in ids],
            )  # fmt: skip
            runner.kv_connector_output = done_report(output)
            outputs = engine.update_from_output(output, runner)
            side.seconds += clock() - start
        side.steps += 1
        for batch in outputs.values():
            for out in batch.outputs:
                if out.prefill_stats is not None:
                    side.hit += out.prefill_stats.num_local_cached_tokens
                    side.loaded += out.prefill_stats.num_external_cached_tokens
                if out.finish_reason is None:
                    continue
                index, session, _ = running.pop(out.request_id)
                busy.discard(session)
                if last_call[session] == index and side.state is not None:
                    side.state.idle_session(session)  # the session's end: its idle signal
        if side.steps % 4000 == 0:
            done = (upcoming[0] if upcoming else len(trace.requests)) - len(running)
            print(f"    {side.name}: {done}/{len(trace.requests)} requests", flush=True)
        yield


def run_pool(
    pool: Pool, trace: Any, in_flight: int, max_output: int, cpu_tier: int, bound: bool
) -> dict:
    row: dict[str, Any] = {"pool": pool.name, "blocks": pool.blocks, "stands_for": pool.stands_for,
                           "hybrid": pool.hybrid, "cpu_tier_blocks": cpu_tier}  # fmt: skip
    sides = [
        build(name, pool, plugin, in_flight, cpu_tier, interval)
        for name, plugin, interval in SIDES
        if pool.hybrid or not interval
    ]
    names = ", ".join(side.name for side in sides)
    print(f"  {pool.name}: {names}, a step of each in turn ...", flush=True)
    steps = [replay(side, trace, in_flight, max_output) for side in sides]
    turn = 0
    while steps:  # the first side changes every turn: a change in the machine's speed
        turn += 1  # falls on each alike
        for step in list(steps if turn % 2 else reversed(steps)):
            if next(step, StopIteration) is StopIteration:
                steps.remove(step)
    vanilla = sides[0].sent - sides[0].hit - sides[0].loaded
    for side in sides:
        computed = side.sent - side.hit - side.loaded
        row[side.name] = {
            "sent": side.sent, "hit": side.hit, "loaded": side.loaded, "computed": computed,
            "saved": 1 - computed / vanilla if vanilla else 0.0,
            "steps": side.steps, "ms_per_step": side.seconds * 1e3 / max(1, side.steps),
        }  # fmt: skip
        if side.state is not None:
            stats = side.state.stats()
            row[side.name].update(
                released=stats.counter("blocks_moved") + stats.counter("blocks_pending"),
                released_hit=stats.released_hit, idled=stats.counter("blocks_idled"),
                own_ms_per_step=stats.counter("engine_us") / 1e3 / max(1, side.steps),
                offload_released=stats.counter("offload_blocks_released"),
            )  # fmt: skip
    if bound and not cpu_tier:
        print(f"  {pool.name}: the Belady bound (simulator) ...", flush=True)
        row["bound"] = bounds(trace, pool, max_output)
        gap = vanilla - row["bound"]["belady"]
        row["gap_closed"] = (vanilla - row["plugin"]["computed"]) / gap if gap > 0 else None
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| pool | stands for | side | sent | hit (GPU) | loaded (CPU) | computed | saved "
        "| gap to Belady closed | released (hit again) | ms / step (plugin's own) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        lead = f"| {row['pool']} | {row['stands_for']} "
        for name, _, _ in SIDES:
            if name not in row:
                continue
            side, plugin = row[name], name == "plugin"
            saved = f"{side['saved']:.1%}" if name != "vanilla" else ""
            closed = row.get("gap_closed") if plugin else None
            released = f"{side['released']:,} ({side['released_hit']})" if plugin else ""
            own = f" ({side['own_ms_per_step']:.3f})" if plugin else ""
            lines.append(
                f"{lead}| {name} | {side['sent']:,} | {side['hit']:,} | {side['loaded']:,} "
                f"| {side['computed']:,} | {saved} | {'' if closed is None else f'{closed:.0%}'} "
                f"| {released} | {side['ms_per_step']:.2f}{own} |"
            )
        if "bound" in row:
            belady = row["bound"]["belady"]
            saved = 1 - belady / row["vanilla"]["computed"]
            lines.append(f"{lead}| Belady (bound) | | | | {belady:,} | {saved:.1%} | 100% | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trace", help="the trace file, or 'synthetic' (default: agentinfer's Claude Code)"
    )
    parser.add_argument("--format", default="agentinfer")
    parser.add_argument("--pools", default="llama-8b-h100,qwen-32b-fp8-h100")
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--cpu-tier", type=int, default=0, help="CPU tier blocks (0: none)")
    parser.add_argument("--limit", type=int, default=0, help="the first N requests (0: all)")
    parser.add_argument("--no-bound", action="store_true", help="leave out the Belady bound")
    parser.add_argument("--out", default=str(RESULTS / "trace_engine"))
    args = parser.parse_args(argv)
    from jiuwen_replay.formats import TraceFormatError, agentinfer_trace_path, read_trace
    from jiuwen_replay.synthetic import FULL_SIZE, generate

    try:  # bad input first, before vLLM loads
        pools = [pool_of(name) for name in args.pools.split(",")]
        if args.trace == "synthetic":
            trace = generate(FULL_SIZE)
        else:
            trace = read_trace(args.trace or agentinfer_trace_path(), args.format)
        if args.limit:
            trace = replace(trace, requests=trace.requests[: args.limit])
    except (TraceFormatError, ValueError) as exc:
        print(f"trace_engine: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_AFFINITY_RELEASE_ON_DIVERGENCE", "true")  # before the patches
    from vllm_affinity.engine import apply_engine_patches

    apply_engine_patches()
    print(f"trace: {json.dumps(trace.describe())}", flush=True)
    rows = [
        run_pool(pool, trace, args.in_flight, args.max_output, args.cpu_tier, not args.no_bound)
        for pool in pools
    ]
    from jiuwen_replay.output import write_json

    out = Path(args.out)
    write_json(
        out.with_suffix(".json"), {"rows": rows}, echo=False,
        trace=trace.describe(), in_flight=args.in_flight, max_output=args.max_output,
        cpu_tier_blocks=args.cpu_tier,
    )  # fmt: skip
    command = " ".join(["python -m benchmarks.engine.trace_engine", *sys.argv[1:]])
    text = table(rows)
    out.with_suffix(".md").write_text(
        f"`{command}`: the trace at 1x tokens through vLLM's real Scheduler (no model), "
        f"{args.in_flight} requests in flight, answers up to {args.max_output} tokens"
        f"{f', a CPU tier of {args.cpu_tier:,} blocks on both sides' if args.cpu_tier else ''}."
        f"\n\n{text}\n"
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
