"""Hook overhead per chat call on append-only turns, hooked vs unhooked, side by side.

Both sides run in one process against the same loopback ``LocalEngine`` with the real openai
client, in alternating rounds (so machine noise hits both alike); the figure is the ratio of
median per-call times. The pure diff cost (``Hook.before_call``) is timed separately to show
that it grows linearly with the window.

    python benchmarks/hook_overhead.py [--rounds 7] [--out benchmarks/results/hook_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import openai
from _common import write_json

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine

SIZES = (10, 100, 1000)
CALLS = {10: 200, 100: 200, 1000: 60}


def window(n: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are an agent. " * 10}]
    for i in range(1, n):
        role = "user" if i % 2 else "assistant"
        msgs.append({"role": role, "content": f"message {i} " + "lorem ipsum dolor " * 10})
    return msgs


def one_round(client: openai.OpenAI, n: int, calls: int, session: str) -> float:
    """Median seconds per call over ``calls`` append-only turns starting at ``n`` messages."""
    msgs = window(n)
    times = []
    with jiuwen_hooks.session(session):
        for i in range(calls):
            msgs.append({"role": "user", "content": f"turn {i}"})
            start = time.perf_counter()
            client.chat.completions.create(model="m", messages=msgs, max_tokens=1)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def diff_cost(n: int, repeats: int = 300) -> float:
    """Seconds per ``before_call`` (canonicalise + diff + inject) on an append-only turn with an
    ``n``-message window: each repeat primes a fresh session with ``n - 1`` messages, then times
    the call that appends the n-th."""
    hook = jiuwen_hooks.install()
    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k")
    completions = client.chat.completions
    msgs = window(n)
    total = 0.0
    for i in range(repeats):
        with jiuwen_hooks.session(f"diff-{i}"):
            hook.before_call(completions, {"model": "m", "messages": msgs[:-1]})
            start = time.perf_counter()
            hook.before_call(completions, {"model": "m", "messages": msgs})
            total += time.perf_counter() - start
    jiuwen_hooks.uninstall()
    client.close()
    return total / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/hook_overhead.json")
    args = parser.parse_args()
    results: dict[str, Any] = {"rounds": args.rounds, "sizes": {}}
    with (
        LocalEngine() as engine,
        openai.OpenAI(base_url=engine.base_url, api_key="k", max_retries=0) as client,
    ):
        one_round(client, 10, 20, "warm-up")
        for n in SIZES:
            plain, hooked = [], []
            for r in range(args.rounds):
                plain.append(one_round(client, n, CALLS[n], f"plain-{n}-{r}"))
                jiuwen_hooks.install()
                try:
                    hooked.append(one_round(client, n, CALLS[n], f"hooked-{n}-{r}"))
                finally:
                    jiuwen_hooks.uninstall()
                engine.clear()
                print(f"  window {n:>4}: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
            p, h = statistics.median(plain), statistics.median(hooked)
            cost = diff_cost(n)
            results["sizes"][n] = {
                "unhooked_ms": round(p * 1e3, 3),
                "hooked_ms": round(h * 1e3, 3),
                "ratio": round(h / p, 4),
                "before_call_us": round(cost * 1e6, 1),
                "before_call_us_per_message": round(cost * 1e6 / n, 3),
            }
            print(f"window {n:>4}: {json.dumps(results['sizes'][n])}", flush=True)
    write_json(args.out, results, echo=False)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
