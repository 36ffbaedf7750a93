"""Release handling latency for windows of about 1k, 8k and 32k tokens, on both paths.

One server with the plugin (32k context). For each size:

- POST: a session sends its window once (so its blocks are cached), then
  ``POST /release_kv_cache`` for a rewrite at the middle message is timed end to end over HTTP on
  one kept-alive connection, as the hook sends it, several times (the first moves blocks, the
  rest find nothing left: the rendering and engine round trip cost the same). The server's own
  split is reported: ``render_ms`` (one chat-template render and tokenisation of the window cut
  at the released message) and ``engine_ms`` (the engine-core call: hashing the cut, comparing
  with the session's blocks).
- in-request: another session sends the same window, then the rewritten window with
  ``X-KV-Release``; the engine's own time for that release (``release_us_in_request``, spent in
  the engine core before the request is scheduled) is read from ``/affinity/stats``: the median
  of ``--in-request-repeats`` runs. There is no extra HTTP request and no render.

    python -m benchmarks.server.release_latency [--repeats 7] [--in-request-repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

import httpx
import openai

from jiuwen_kv_protocol.headers import RELEASE_HEADER, RELEASE_PATH, SESSION_HEADER
from jiuwen_replay.output import write_json
from vllm_affinity.testing import SERVED_NAME, VLLMServer, filler_text

TARGETS = {"1k": 1_000, "8k": 8_000, "32k": 31_000}


def build_window(target_tokens: int, seed: int) -> list[dict[str, Any]]:
    """About ``target_tokens`` tokens in 20 messages (~3.45 tokens per filler pair here)."""
    rng = random.Random(seed)
    pairs = max(1, int(target_tokens / 3.5 / 19))
    window: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."}]
    for i in range(19):
        role = ("user", "assistant", "tool")[i % 3]
        text = filler_text(rng, pairs)
        message: dict[str, Any] = {"role": role, "content": text}
        if role == "tool":
            message["tool_call_id"] = f"c{i}"
        window.append(message)
    return window


def engine_counters(server: VLLMServer) -> dict[str, Any]:
    (stats,) = server.affinity_stats()["engines"]
    return stats


def in_request_release(
    server: VLLMServer, client: openai.OpenAI, session: str, window: list[dict[str, Any]]
) -> tuple[int, int]:
    """The same rewrite as the POST, carried on the next chat request instead: the engine's
    time for it (µs) and the blocks it released. Each run is a session of its own, salted, so
    that no block is shared with another run's (a shared block would be kept)."""
    headers = {SESSION_HEADER: session}
    salt = {"cache_salt": session}
    client.chat.completions.create(
        model=SERVED_NAME, messages=window, max_tokens=1, extra_headers=headers, extra_body=salt
    )
    middle = len(window) // 2
    rewritten = [*window[:middle], {"role": "user", "content": "[summary]"}]
    before = engine_counters(server)
    client.chat.completions.create(
        model=SERVED_NAME,
        messages=rewritten,
        max_tokens=1,
        extra_headers={**headers, RELEASE_HEADER: f"messages_released_index={middle}"},
        extra_body=salt,
    )
    after = engine_counters(server)

    def grew(key: str) -> int:
        return after.get(key, 0) - before.get(key, 0)

    assert grew("releases_in_request") == 1, (before, after)
    return grew("release_us_in_request"), grew("block_released_in_request")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="POSTs per size")
    parser.add_argument(
        "--in-request-repeats", type=int, default=3, help="in-request releases per size"
    )
    parser.add_argument("--out", default="benchmarks/results/release_latency.json")
    args = parser.parse_args()
    server = VLLMServer(plugin=True, num_blocks=1100, max_model_len=32768, api_key="bench")
    results: dict[str, Any] = {}
    print(f"starting the server (log {server.log_path}) ...", file=sys.stderr, flush=True)
    with server:
        client = openai.OpenAI(base_url=server.base_url, api_key="bench", max_retries=0)
        # One client for every POST, as the hook keeps one: a new httpx client costs ~50 ms
        # (its SSL context) and earlier runs, which made one per POST, measured mostly that.
        poster = httpx.Client(headers=server.headers(), timeout=120)
        for label, target in TARGETS.items():
            session = f"latency-{label}"
            window = build_window(target, seed=target)
            start = time.perf_counter()
            reply = client.chat.completions.create(
                model=SERVED_NAME,
                messages=window,
                max_tokens=1,
                extra_body={"cache_salt": session},
                extra_headers={SESSION_HEADER: session},
            )
            prefill = time.perf_counter() - start
            body = {
                "model": SERVED_NAME,
                "cache_salt": session,
                "messages": window,
                "messages_released_index": len(window) // 2,
            }
            latencies, renders, engines, released = [], [], [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                response = poster.post(server.root_url + RELEASE_PATH, json=body)
                latencies.append(time.perf_counter() - t0)
                data = response.json()
                renders.append(data["render_ms"])
                engines.append(data["engine_ms"])
                released.append(data["block_released"])
            runs = [
                in_request_release(server, client, f"latency-in-request-{label}-{run}", window)
                for run in range(args.in_request_repeats)
            ]
            results[label] = {
                "in_request_engine_us": statistics.median(us for us, _ in runs),
                "in_request_engine_us_all": [us for us, _ in runs],
                "in_request_block_released": runs[0][1],
                "prompt_tokens": reply.usage.prompt_tokens,
                "prefill_s": round(prefill, 3),
                "release_ms_p50": round(statistics.median(latencies) * 1e3, 2),
                "release_ms_max": round(max(latencies) * 1e3, 2),
                "render_ms_p50": round(statistics.median(renders), 2),
                "engine_ms_p50": round(statistics.median(engines), 2),
                "block_released_first": released[0],
            }
            print(f"{label}: {json.dumps(results[label])}", flush=True)
        client.close()
        poster.close()
    write_json(args.out, results, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
