"""Hook overhead per model call on append-only turns, hooked vs unhooked, side by side, for the
three APIs (Chat Completions and Responses through the openai SDK, Messages through the
anthropic SDK).

Both sides run in one process against the same loopback ``LocalEngine`` with the real SDK
clients, in alternating rounds (so machine noise hits both alike); the figure is the ratio of
median per-call times. The pure diff cost (``Hook.before_call``) is timed separately to show
that it grows linearly with the window.

    python -m benchmarks.client.hook_overhead [--rounds 7] \
        [--out benchmarks/results/hook_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import anthropic
import openai

import jiuwen_hooks
from jiuwen_hooks._context import ModelCall
from jiuwen_hooks.testing import LocalEngine
from jiuwen_replay.output import write_json

APIS = ("chat", "responses", "messages")

SIZES = (10, 100, 1000)
CALLS = {10: 200, 100: 200, 1000: 60}


def window(n: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are an agent. " * 10}]
    for i in range(1, n):
        role = "user" if i % 2 else "assistant"
        msgs.append({"role": role, "content": f"message {i} " + "lorem ipsum dolor " * 10})
    return msgs


def body(api: str, msgs: list[dict[str, str]]) -> dict[str, Any]:
    """The same window as either API's request: Responses takes the system message as
    ``instructions`` and the rest as ``input`` items."""
    if api == "chat":
        return {"model": "m", "messages": msgs, "max_tokens": 1}
    if api == "messages":  # Anthropic: the system prompt apart, as Responses' instructions
        return {"model": "m", "system": msgs[0]["content"], "messages": msgs[1:], "max_tokens": 1}
    return {
        "model": "m",
        "instructions": msgs[0]["content"],
        "input": msgs[1:],
        "max_output_tokens": 1,
    }


Clients = tuple[openai.OpenAI, anthropic.Anthropic]


def one_round(clients: Clients, api: str, n: int, calls: int, session: str) -> float:
    """Median seconds per call over ``calls`` append-only turns starting at ``n`` messages."""
    msgs = window(n)
    openai_client, anthropic_client = clients
    send: Any = {
        "chat": openai_client.chat.completions.create,
        "responses": openai_client.responses.create,
        "messages": anthropic_client.messages.create,
    }[api]
    times = []
    with jiuwen_hooks.session(session):
        for i in range(calls):
            msgs.append({"role": "user", "content": f"turn {i}"})
            kwargs = body(api, msgs)
            start = time.perf_counter()
            send(**kwargs)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def diff_cost(api: str, n: int, repeats: int = 300) -> float:
    """Seconds per ``before_call`` (canonicalise + diff + inject) on an append-only turn with an
    ``n``-message window: each repeat primes a fresh session with ``n - 1`` messages, then times
    the call that appends the n-th."""
    hook = jiuwen_hooks.install(in_request=False)
    msgs = window(n)
    base = "http://127.0.0.1:9/v1"
    shorter = ModelCall(api, body(api, msgs[:-1]), base_url=base, api_key="k")
    longer = ModelCall(api, body(api, msgs), base_url=base, api_key="k")
    total = 0.0
    for i in range(repeats):
        with jiuwen_hooks.session(f"diff-{i}"):
            hook.before_call(lambda: shorter)
            start = time.perf_counter()
            hook.before_call(lambda: longer)
            total += time.perf_counter() - start
    jiuwen_hooks.uninstall()
    return total / repeats


def measure(clients: Clients, engine: LocalEngine, api: str, n: int, rounds: int) -> dict[str, Any]:
    """Alternating rounds, unhooked first in even rounds and hooked first in odd ones."""
    plain: list[float] = []
    hooked: list[float] = []
    for r in range(rounds):
        for hook_on in (r % 2 == 1, r % 2 == 0):
            if hook_on:
                jiuwen_hooks.install(in_request=False)
            try:
                side = hooked if hook_on else plain
                side.append(one_round(clients, api, n, CALLS[n], f"{hook_on}-{api}-{n}-{r}"))
            finally:
                jiuwen_hooks.uninstall()
        engine.clear()
        print(f"  {api} window {n:>4}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    p, h = statistics.median(plain), statistics.median(hooked)
    cost = diff_cost(api, n)
    return {
        "unhooked_ms": round(p * 1e3, 3),
        "hooked_ms": round(h * 1e3, 3),
        "ratio": round(h / p, 4),
        "before_call_us": round(cost * 1e6, 1),
        "before_call_us_per_message": round(cost * 1e6 / n, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/hook_overhead.json")
    parser.add_argument("--apis", default=",".join(APIS))
    args = parser.parse_args()
    results: dict[str, Any] = {"rounds": args.rounds, "apis": {}}
    with (
        LocalEngine() as engine,
        openai.OpenAI(base_url=engine.base_url, api_key="k", max_retries=0) as openai_client,
        anthropic.Anthropic(base_url=engine.root_url, api_key="k", max_retries=0) as claude,
    ):
        clients = (openai_client, claude)
        for api in args.apis.split(","):
            one_round(clients, api, 10, 20, "warm-up")
            sizes = results["apis"][api] = {}
            for n in SIZES:
                sizes[n] = measure(clients, engine, api, n, args.rounds)
                print(f"{api:>9} window {n:>4}: {json.dumps(sizes[n])}", flush=True)
    write_json(args.out, results, echo=False)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
