"""Release handling latency for windows of about 1k, 8k and 32k tokens.

One server with the plugin (32k context). For each size a session sends its window once (so its
blocks are cached), then ``POST /release_kv_cache`` for a rewrite at the middle message is timed
end to end over HTTP, several times (the first moves blocks, the rest find nothing left: the
rendering and engine round trip cost the same). The server's own split (``render_ms``: the two
chat-template renders and tokenisations; ``engine_ms``: the engine-core call) is reported too.

    python benchmarks/release_latency.py [--repeats 7]
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
from _common import write_json

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/release_latency.json")
    args = parser.parse_args()
    server = VLLMServer(plugin=True, num_blocks=1100, max_model_len=32768, api_key="bench")
    results: dict[str, Any] = {}
    print(f"starting the server (log {server.log_path}) ...", file=sys.stderr, flush=True)
    with server:
        client = openai.OpenAI(base_url=server.base_url, api_key="bench", max_retries=0)
        for label, target in TARGETS.items():
            session = f"latency-{label}"
            window = build_window(target, seed=target)
            start = time.perf_counter()
            reply = client.chat.completions.create(
                model=SERVED_NAME,
                messages=window,
                max_tokens=1,
                extra_body={"cache_salt": session},
                extra_headers={"X-Session-ID": session},
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
                response = httpx.post(
                    server.root_url + "/release_kv_cache", json=body, headers=server.headers(),
                    timeout=120,
                )  # fmt: skip
                latencies.append(time.perf_counter() - t0)
                data = response.json()
                renders.append(data["render_ms"])
                engines.append(data["engine_ms"])
                released.append(data["block_released"])
            results[label] = {
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
    write_json(args.out, results, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
