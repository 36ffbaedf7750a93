"""A comparison: the same trace on each side, in rounds, summarised, with the simulator beside.

Sides run one after another (alternating which goes first, round by round), each run with
prompt content of its own, so one server can host both sides without one warming the other's
cache. Where the server renders prompts (``/tokenize``) and says its pool size (vLLM's
``cache_config_info``), the simulator replays the exact tokens in the order they were sent,
under the policy the side ran (LRU without the plugin, LRU + release with it, + lifecycle when
the run sent next-use hints), and gives the infinite-cache and Belady bounds for that pool.
"""

from __future__ import annotations

import math
import re
import secrets
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import httpx

from vllm_affinity.core.lifecycle import ends_task

from .runner import (
    IDLE_AFTER_S,
    CallRecord,
    ReplayOptions,
    RunResult,
    Target,
    metrics_text,
    run,
    windows,
)
from .simulator import CapacityError, Request, simulate
from .trace import Trace, TraceRequest, next_call_gaps, next_use_hints


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def summarize(result: RunResult) -> dict[str, Any]:
    ok = [c for c in result.calls if c.error is None]
    prompt = sum(c.prompt_tokens for c in ok)
    cached = sum(c.cached_tokens or 0 for c in ok)
    reported = any(c.cached_tokens is not None for c in ok)
    ttft = [c.ttft for c in ok if c.ttft is not None]
    pre_send = [c.pre_send for c in ok if c.pre_send is not None]
    spans: dict[str, list[float]] = {}
    for c in result.calls:
        first, last = spans.get(c.session, [c.sent, c.done])
        spans[c.session] = [min(first, c.sent), max(last, c.done)]
    completion = [last - first for first, last in spans.values()]
    hook = result.hook
    summary: dict[str, Any] = {
        "side": result.target.name,
        "hooked": result.target.hooked,
        "agent_headers": result.target.agent_headers,
        "calls": len(result.calls),
        "errors": len(result.calls) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached if reported else None,
        "computed_tokens": prompt - cached if reported else None,
        "hit_rate": round(cached / prompt, 4) if reported and prompt else None,
        "server_hit_rate": round(result.server_hits / result.server_queries, 4)
        if result.server_queries
        else None,
        "ttft_ms_p50": _ms(percentile(ttft, 50)),
        "ttft_ms_p90": _ms(percentile(ttft, 90)),
        "ttft_ms_p99": _ms(percentile(ttft, 99)),
        "ttft_ms_mean": _ms(sum(ttft) / len(ttft)) if ttft else None,
        # where the TTFT goes (``latency.py``): the client before the wire, its event loop, and
        # vLLM's own TTFT, queue and prefill
        "pre_send_ms_p50": _ms(percentile(pre_send, 50)),
        "pre_send_ms_p90": _ms(percentile(pre_send, 90)),
        "loop_lag_ms_p99": _ms(percentile(result.loop_lags, 99)),
        "loop_lag_s_total": round(sum(result.loop_lags), 2),
        "server": result.server_latency,
        "client_cpu_s": None if result.client_cpu_s is None else round(result.client_cpu_s, 1),
        "client_gc": result.client_gc,
        "by_computed": by_computed(ok) if reported else None,
        "session_s_p50": round(percentile(completion, 50) or 0.0, 2),
        "session_s_p90": round(percentile(completion, 90) or 0.0, 2),
        "wall_s": round(result.wall_s, 1),
        "calls_per_s": round(len(ok) / result.wall_s, 2) if result.wall_s else None,
    }
    if result.target.hooked:
        summary["engine_state"] = hook.get("engine_state")
        in_request, post = hook.get("releases.in_request", 0), hook.get("releases.ok", 0)
        total = hook.get("releases.total", 0)
        summary["releases"] = {
            "in_request": in_request,
            "post": post,
            # refused (a server without the plugin answers 404), failed or dropped
            "not_applied": total - in_request - post,
            "total": total,
        }
    errors = [c.error for c in result.calls if c.error]
    if errors:
        summary["first_error"] = errors[0]
    return summary


#: buckets of tokens a call computed (its prompt less what the cache gave), for ``by_computed``
COMPUTED_BUCKETS: tuple[tuple[str, int, int], ...] = (
    ("0-32", 0, 32),
    ("33-128", 33, 128),
    ("129-512", 129, 512),
    ("513+", 513, 1 << 40),
)


def by_computed(calls: Sequence[CallRecord]) -> dict[str, Any]:
    """The client's TTFT per bucket of tokens each call computed: two sides with equal TTFT
    per bucket differ in TTFT only by how their misses fall on calls (the policy), not by
    per-call cost."""
    computed = [c.prompt_tokens - (c.cached_tokens or 0) for c in calls]
    out: dict[str, Any] = {
        "computed_p50": percentile(computed, 50),
        "computed_p90": percentile(computed, 90),
        "computed_p99": percentile(computed, 99),
    }
    for name, low, high in COMPUTED_BUCKETS:
        ttft = [
            c.ttft
            for c, n in zip(calls, computed, strict=True)
            if low <= n <= high and c.ttft is not None
        ]
        out[name] = {
            "calls": len(ttft),
            "ttft_ms_p50": _ms(percentile(ttft, 50)),
            "ttft_ms_p90": _ms(percentile(ttft, 90)),
        }
    return out


def paired_ttft(base: Sequence[CallRecord], other: Sequence[CallRecord]) -> dict[str, Any] | None:
    """``other``'s TTFT against ``base``'s, call by call, over the calls that computed the same
    tokens on both sides (the same trace call, sent on the same schedule): what a side adds per
    call, apart from what its cache policy changes and from the load both runs saw. Two runs of
    one side give this measurement's floor."""
    by_index = {c.index: c for c in base if c.error is None and c.ttft is not None}
    diffs = []
    for c in other:
        b = by_index.get(c.index)
        if b is None or c.error is not None or c.ttft is None:
            continue
        if c.cached_tokens is None or b.cached_tokens is None:
            continue
        if c.prompt_tokens - c.cached_tokens == b.prompt_tokens - b.cached_tokens:
            diffs.append(c.ttft - b.ttft)
    if not diffs:
        return None
    return {
        "calls": len(diffs),
        "median_ms": _ms(statistics.median(diffs)),
        "mean_ms": _ms(statistics.fmean(diffs)),
    }


def pool_of(root_url: str, api_key: str) -> tuple[int, int] | None:
    """(KV blocks a cache can use, block size) from vLLM's ``cache_config_info`` metric, where
    it answers. ``num_gpu_blocks`` counts the null block, which vLLM's ``BlockPool`` takes
    for itself at start and never caches: one block fewer hold prompts."""
    text = metrics_text(root_url, api_key)
    for line in (text or "").splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            try:
                return int(labels["num_gpu_blocks"]) - 1, int(labels["block_size"])
            except (KeyError, ValueError):
                return None
    return None


def picker_on(root_url: str, api_key: str) -> bool:
    """Whether the server's engines run the predicted-return picker (``/affinity/stats``;
    False where the plugin does not answer)."""
    try:
        response = httpx.get(
            root_url + "/affinity/stats", headers={"Authorization": f"Bearer {api_key}"}, timeout=30
        )
        engines = response.json()["engines"] if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False
    return any(isinstance(e, dict) and e.get("predict_return") for e in engines)


def tokenize(
    root_url: str, options: ReplayOptions, prompts: Sequence[list[dict[str, Any]]]
) -> list[tuple[int, ...]] | None:
    """Each window's exact prompt tokens, rendered by the server (``/tokenize``), or None."""
    out = []
    headers = {"Authorization": f"Bearer {options.api_key}"}
    with httpx.Client(timeout=60, headers=headers) as client:
        for window in prompts:
            body = {"model": options.model, "messages": window, "add_generation_prompt": True}
            try:
                response = client.post(root_url + "/tokenize", json=body)
            except httpx.HTTPError:
                return None
            if response.status_code != 200:
                return None
            out.append(tuple(response.json()["tokens"]))
    return out


def finishes(trace: Trace, options: ReplayOptions) -> list[str]:
    """How the plugin sees each call end, as the simulator's ``finish``: a replayed call is cut
    at its token budget (``length``: no signal), so only the hint says idle (``stop``) or live
    (``tool_calls``); a session the replay ends after its last call is ``end``, and so is a
    subagent whose hint says it is done (the plugin releases a subagent whose task ended)."""
    hints = next_use_hints(trace.requests, options.next_use, IDLE_AFTER_S, options.speed)
    gaps = next_call_gaps(trace.requests)
    out = []
    for request, hint, gap in zip(trace.requests, hints, gaps, strict=True):
        subagent = parent_of(request, options) is not None
        if gap is None and options.end_sessions:
            out.append("end")
        elif hint is not None and hint >= IDLE_AFTER_S:
            # a subagent's task ends when the hint says it is done (as its answer would)
            out.append("end" if subagent and ends_task(hint) else "stop")
        else:
            out.append("tool_calls")
    return out


def sim_requests(
    trace: Trace,
    options: ReplayOptions,
    tokens: Sequence[tuple[int, ...]] | None = None,
    hinted: bool = True,
) -> list[Request]:
    """The trace's calls as the simulator's requests: each call's prompt (``tokens``, else the
    trace's block ids), how the plugin sees it end (``finishes``), and, where the side sends
    them (``hinted``: the hook does, a coding agent's own headers do not), its hint."""
    ended = finishes(trace, options)
    hints = next_use_hints(trace.requests, options.next_use, IDLE_AFTER_S, options.speed)
    prompts = tokens if tokens is not None else [tuple(r.blocks) for r in trace.requests]
    return [
        Request(r.session, t, f, r.at, hint if hinted else None, parent_of(r, options))
        for r, t, f, hint in zip(trace.requests, prompts, ended, hints, strict=True)
    ]


def parent_of(request: TraceRequest, options: ReplayOptions) -> str | None:
    """The parent the plugin learns for a call: the hook names it (``options.parents``)."""
    named = options.parents and request.parent not in (None, request.session)
    return request.parent if named else None


def policy_of(summary: dict[str, Any], options: ReplayOptions) -> str:
    policy = _policy_of(summary, options)
    # the picker (VLLM_AFFINITY_PREDICT_RETURN, on as shipped; off with the lifecycle) acts on
    # the call order alone where no hint and no end says more
    if summary.get("predict_return") and policy in ("lifecycle", "lru_release"):
        return "lifecycle+return-unguarded"
    return policy


def _policy_of(summary: dict[str, Any], options: ReplayOptions) -> str:
    if summary.get("agent_headers"):  # the server tells rewrites from the windows, and
        # with ``next_use`` reads answers from how calls finish (``ANSWER_STOPS``)
        return "lifecycle" if options.next_use != "none" else "lru_release"
    if summary.get("engine_state") not in ("in_request", "post"):
        return "lru"  # no plugin answered: vanilla's policy
    lifecycle = options.next_use != "none" or options.end_sessions
    return "lifecycle" if lifecycle else "lru_release"


def simulated(
    trace: Trace,
    options: ReplayOptions,
    result: RunResult,
    summary: dict[str, Any],
    tokens: Sequence[tuple[int, ...]] | None = None,
) -> dict[str, Any] | None:
    """The simulator on the trace's tokens in this run's send order, with the server's pool.

    ``tokens``: the rendered prompts of any run of this trace (every run's prompts have the
    same lengths and the same sharing, only other words); rendered here when not given."""
    target = result.target
    pool = pool_of(target.root_url, options.api_key)
    if pool is None:
        return None
    if tokens is None:
        tokens = tokenize(target.root_url, options, windows(trace, options, nonce=0))
    if tokens is None:
        return None
    capacity, block = pool
    if "predict_return" not in summary:
        summary = {**summary, "predict_return": picker_on(target.root_url, options.api_key)}
    requests = sim_requests(trace, options, tokens, hinted=target.hooked)
    in_order = [requests[i] for i in result.sent_order()]
    generated = options.max_output_tokens or 1
    policy = policy_of(summary, options)
    out: dict[str, Any] = {"policy": policy, "pool_blocks": capacity, "block_size": block}
    for name in (policy, "infinite", "belady"):
        try:
            rate = simulate(in_order, capacity, name, block, generated)["hit_rate"]
        except CapacityError as exc:
            return {"error": str(exc)}
        out["hit_rate" if name == policy else name] = round(rate, 4)
    real = summary["server_hit_rate"] or summary["hit_rate"]
    if real is not None:
        out["sim_minus_real"] = round(out["hit_rate"] - real, 4)
    return out


def compare(
    trace: Trace,
    targets: Sequence[Target],
    options: ReplayOptions,
    rounds: int = 1,
    simulate_runs: bool = True,
) -> dict[str, Any]:
    """Every side once per round (first side alternating), summarised; see the module."""
    runs: list[dict[str, Any]] = []
    # content of each run's own, also against other replays on the same server (``nonce``)
    nonce = secrets.randbelow(1 << 30) * 1024
    rendered: dict[str, list[tuple[int, ...]] | None] = {}  # per server, rendered once
    for round_index in range(rounds):
        order = list(targets) if round_index % 2 == 0 else list(reversed(targets))
        calls: dict[str, list[CallRecord]] = {}
        for target in order:
            nonce += 1
            say(f"round {round_index + 1}/{rounds}: {target.name} ({target.base_url}) ...")
            result = run(trace, target, options, nonce)
            summary = summarize(result)
            summary["round"] = round_index + 1
            if simulate_runs:
                if target.root_url not in rendered:
                    prompts = windows(trace, options, nonce=0)
                    rendered[target.root_url] = tokenize(target.root_url, options, prompts)
                tokens = rendered[target.root_url]
                check = simulated(trace, options, result, summary, tokens) if tokens else None
                if check is not None:
                    summary["simulator"] = check
            summary["per_call"] = [
                [c.index, _ms(c.ttft), c.prompt_tokens, c.cached_tokens] for c in result.calls
            ]
            runs.append(summary)
            calls[target.name] = result.calls
            say(f"  {target.name}: {headline(summary)}")
        baseline = calls[targets[0].name]
        for summary in runs[-len(order) :]:
            if summary["side"] != targets[0].name:
                summary["ttft_paired"] = paired_ttft(baseline, calls[summary["side"]])
    return {"trace": trace.describe(), "options": _options(options), "runs": runs}


def headline(summary: dict[str, Any]) -> str:
    parts = [f"hit rate {summary['hit_rate']}"]
    if summary.get("simulator", {}).get("hit_rate") is not None:
        parts.append(f"(simulator {summary['simulator']['hit_rate']})")
    parts.append(f"computed {summary['computed_tokens']} tokens")
    parts.append(f"TTFT p50 {summary['ttft_ms_p50']} ms, p90 {summary['ttft_ms_p90']} ms")
    if summary["errors"]:
        parts.append(f"{summary['errors']} errors ({summary.get('first_error')})")
    if "releases" in summary:
        r = summary["releases"]
        parts.append(f"releases {r['in_request']} in-request, {r['post']} POST")
    return ", ".join(parts)


def _options(options: ReplayOptions) -> dict[str, Any]:
    out = dict(vars(options))
    out.pop("api_key", None)
    out.pop("progress", None)
    return out
