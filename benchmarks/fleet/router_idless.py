"""Agents that name no session (aider, Qwen Code by default, chat UIs) over two plugin replicas
behind vLLM's own router: which policy keeps a conversation where its prefix is cached.

Each conversation is scripted as such an agent talks: one system prompt shared by all, a task,
then per turn the model's answer sent back and a tool's output; half-way, a compaction (the
window replaced by the system prompt and a summary). No request carries a session header. The
turns of all conversations interleave (one call at a time: each call's replica is told by the
replicas' counters). For every policy the replicas start fresh, and the same conversations run.
Reported per policy: prompt tokens computed (not read from a prefix cache), the fleet's
prefix-cache hit rate, the share of turns served where the conversation's previous turn was,
and per replica the tokens computed.

    pip install vllm-router==0.1.17   # make test installs it in .venv-router
    python -m benchmarks.fleet.router_idless \
        [--policies round_robin,consistent_hash,cache_aware,kv_aware]
        [--conversations 8] [--turns 6] [--num-blocks 192]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from jiuwen_replay.output import write_outputs
from vllm_affinity.testing import SERVED_NAME, VLLMServer, filler_text

from .vllm_router import POLICIES, ROUTER_VERSION, Router, event_replica, router_binary, served_by

RESULTS = Path(__file__).resolve().parents[1] / "results"


@dataclass
class Conversation:
    name: str
    system: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    served: list[int] = field(default_factory=list)

    def window(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.system}, *self.messages]


def script(conversations: int, seed: int = 7) -> list[Conversation]:
    system = "You are a coding agent. " + filler_text(random.Random(seed), 300)
    out = []
    for i in range(conversations):
        task = f"Task {i}: " + filler_text(random.Random(seed * 100 + i), 60)
        out.append(Conversation(f"c{i}", system, [{"role": "user", "content": task}]))
    return out


def ask_model(
    router: Router, replicas: list[VLLMServer], talk: Conversation,
    extra: list[dict[str, Any]], max_tokens: int, observe: bool,
) -> str:  # fmt: skip
    """One call of ``talk`` (its window and ``extra``) through the router; with ``observe``
    (nothing else in flight), its replica noted."""
    body = {"model": SERVED_NAME, "messages": [*talk.window(), *extra], "max_tokens": max_tokens}

    def send() -> httpx.Response:
        return httpx.post(router.url + "/v1/chat/completions", json=body, timeout=300)

    if observe:
        replica, answer = served_by(replicas, send)
        talk.served.append(replica)
    else:
        response = send()
        response.raise_for_status()
        answer = response.json()
    return answer["choices"][0]["message"]["content"] or "ok"


def counters(server: VLLMServer) -> dict[str, float]:
    return {
        "prompt": server.metric("vllm:prompt_tokens_total"),
        "hits": server.metric("vllm:prefix_cache_hits_total"),
        "calls": server.metric("vllm:request_success_total", finished_reason="length")
        + server.metric("vllm:request_success_total", finished_reason="stop"),
        "chains": server.metric("vllm_affinity_implicit_sessions_total", outcome="started"),
        "queries": server.metric("vllm:prefix_cache_queries_total"),
    }


def run_policy(
    binary: str, policy: str, turns: int, conversations: int, num_blocks: int, observe: bool
) -> dict[str, Any]:
    replicas = [
        event_replica(num_blocks=num_blocks, max_model_len=4096, cpu_cores=str(i)) for i in range(2)
    ]
    for replica in replicas:
        replica.start(wait=False)
    try:
        for replica in replicas:
            replica.wait_healthy()
        start = [counters(r) for r in replicas]
        talks = script(conversations)
        with Router(binary, replicas, POLICIES[policy]) as router:

            def step(talk: Conversation, turn: int) -> None:
                if turn == turns // 2:  # the compaction: the summary replaces the window
                    ask = {"role": "user", "content": "Summarize the conversation so far."}
                    summary = ask_model(router, replicas, talk, [ask], 96, observe)
                    talk.messages = [{"role": "user", "content": f"Summary:\n{summary}"}]
                text = ask_model(router, replicas, talk, [], 24, observe)
                tool = f"output {turn}: " + filler_text(
                    random.Random(turn * 31 + len(talk.name)), 60
                )
                talk.messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": tool},
                ]

            if observe:  # turns interleaved, one call at a time
                for turn in range(turns):
                    for talk in talks:
                        step(talk, turn)
            else:  # every conversation on a thread of its own, as agents run side by side

                def converse(talk: Conversation) -> None:
                    for turn in range(turns):
                        step(talk, turn)

                threads = [threading.Thread(target=converse, args=(talk,)) for talk in talks]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
        end = [counters(r) for r in replicas]
        per_replica = []
        for i, (a, b) in enumerate(zip(start, end, strict=True)):
            delta = {k: b[k] - a[k] for k in a}
            per_replica.append(
                {
                    "replica": i,
                    "prompt_tokens": int(delta["prompt"]),
                    "computed_tokens": int(delta["queries"] - delta["hits"]),
                    "hit_tokens": int(delta["hits"]),
                    "calls": int(delta["calls"]),
                    "conversations_started": int(delta["chains"]),
                }
            )
        prompt = sum(r["prompt_tokens"] for r in per_replica)
        hits = sum(r["hit_tokens"] for r in per_replica)
        stays = sum(a == b for t in talks for a, b in zip(t.served, t.served[1:], strict=False))
        moves = sum(max(len(t.served) - 1, 0) for t in talks)
        released = sum(r.engine_stats()["block_released_compaction"] for r in replicas)
        return {
            "policy": policy, "flags": POLICIES[policy], "prompt_tokens": prompt,
            "computed_tokens": prompt - hits, "hit_rate": hits / prompt if prompt else 0.0,
            "stayed": stays / moves if moves else None, "replicas": per_replica,
            "block_released_compaction": released,
            "calls_per_replica": [r["calls"] for r in per_replica],
            # a conversation whose turn lands where its last one was not starts again there
            "conversations_started": sum(r["conversations_started"] for r in per_replica),
        }  # fmt: skip
    finally:
        for replica in replicas:
            replica.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="round_robin,consistent_hash,cache_aware,kv_aware")
    parser.add_argument("--conversations", type=int, default=7)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--num-blocks", type=int, default=192)
    parser.add_argument("--concurrent", action="store_true",
                        help="each conversation on a thread of its own (else turns interleave, "
                        "one call at a time, each call's replica told)")  # fmt: skip
    parser.add_argument("--router-bin", default=None)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    binary = router_binary(args.router_bin)
    if binary is None:
        parser.error("vllm-router not found: make test installs it (or pip install vllm-router)")
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    runs = []
    for policy in policies:
        began = time.monotonic()
        print(f"{policy}: two fresh replicas, {args.conversations} conversations ...", flush=True)
        runs.append(
            run_policy(binary, policy, args.turns, args.conversations, args.num_blocks,
                       observe=not args.concurrent)
        )  # fmt: skip
        print(f"  done in {time.monotonic() - began:.0f} s", flush=True)
    base = runs[0]["computed_tokens"]
    mode = "side by side (a thread each)" if args.concurrent else "interleaved, one call at a time"
    lines = [
        f"Id-less conversations over two plugin replicas behind vllm-router "
        f"{ROUTER_VERSION}: {args.conversations} conversations x {args.turns} turns (a "
        f"compaction half-way), {mode}, {args.num_blocks} blocks per replica",
        "",
        "| policy | prompt tokens | computed | vs first | hit rate | turns where the last one was "
        "| conversations started | calls per replica | computed per replica | blocks released |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for run in runs:
        stayed = "n/a" if run["stayed"] is None else f"{run['stayed']:.0%}"
        lines.append(
            f"| {run['policy']} | {run['prompt_tokens']:,} | {run['computed_tokens']:,} | "
            f"x{run['computed_tokens'] / base:.2f} | {run['hit_rate']:.3f} | {stayed} | "
            f"{run['conversations_started']} | {run['calls_per_replica']} | "
            f"{[r['computed_tokens'] for r in run['replicas']]} | "
            f"{run['block_released_compaction']} |"
        )
    lines += [
        "",
        f"Made by `python -m benchmarks.fleet.router_idless{' --concurrent' * args.concurrent}`. "
        "A conversation whose turn lands on a replica that did not serve its last one starts "
        "again there (the plugin links its turns by the answers they carry back).",
    ]
    stem = "router_idless_concurrent" if args.concurrent else "router_idless"
    result = {"config": vars(args), "runs": runs}
    write_outputs(args.out, stem, result, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
