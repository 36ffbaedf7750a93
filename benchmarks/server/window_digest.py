"""What reading a window costs the API server per request: the compaction rule's digests of
every message (``Window.of``), in full and through the memo the server keeps
(``core.compaction.DigestMemo``: only messages it has not seen are serialised and hashed), and
the implicit sessions' read of the same window (``ChainWindow.of``) and their link of it when it
carries no answer they know (a conversation's first request, a one-shot request, a compacted
window: the stretches of the principal's last answers searched for in its user messages, the
costliest case), and the memory the chains keep per answer.

One session's window grows by a turn (an answer and a tool result) per round; each round parses
the request body afresh (as vLLM does: new string objects every request) and times each reader
on it, alternating their order. Medians per window size (tokens at about 4 characters each) and
the memo's ratio to the full digest are reported.

    python -m benchmarks.server.window_digest [--rounds 40]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jiuwen_replay.output import write_outputs
from vllm_affinity.core.answer_chains import RECENT_ANSWERS, Answer, AnswerChains, ChainWindow
from vllm_affinity.core.compaction import DigestMemo, Window
from vllm_affinity.testing import filler_text

TOOLS = [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}]


def grown_window(tokens: int, rng: random.Random) -> list[dict[str, Any]]:
    """A system prompt and turns of about 400 tokens each, up to ``tokens``."""
    window = [{"role": "system", "content": filler_text(rng, 700)}]  # ~2.8k tokens
    while sum(len(m["content"]) for m in window) < tokens * 4:
        role = ("user", "assistant")[len(window) % 2]
        window.append({"role": role, "content": filler_text(rng, 100)})
    return window


def timed(read: Callable[[list[dict[str, Any]]], Any], body: str) -> float:
    messages = json.loads(body)
    started = time.perf_counter()
    read(messages)
    return (time.perf_counter() - started) * 1000


def measure(tokens: int, rounds: int) -> dict[str, Any]:
    rng = random.Random(tokens)
    window = grown_window(tokens, rng)
    memo = DigestMemo()
    chains = AnswerChains()
    for n in range(RECENT_ANSWERS):  # other conversations' long answers, none in this window
        chain, _ = chains.chain_of("p", ChainWindow.of([{"role": "user", "content": str(n)}], None))
        chains.record("p", chain, Answer(filler_text(rng, 500)))
    readers: dict[str, Callable[[list[dict[str, Any]]], Any]] = {
        "full_ms": lambda m: Window.of(m, TOOLS),
        "memo_ms": lambda m: Window.of(m, TOOLS, memo),
        "chain_ms": lambda m: ChainWindow.of(m, TOOLS),
        "link_ms": lambda m: chains.chain_of("p", ChainWindow.of(m, TOOLS)),
    }
    times: dict[str, list[float]] = {name: [] for name in readers}
    readers["memo_ms"](json.loads(json.dumps(window)))  # the session's earlier turns, seen
    for index in range(rounds):
        window += [
            {"role": "assistant", "content": filler_text(rng, 30)},
            {"role": "user", "content": filler_text(rng, 60)},
        ]
        body = json.dumps(window)
        order = list(readers.items())
        for name, read in order if index % 2 else order[::-1]:
            times[name].append(timed(read, body))
    result: dict[str, Any] = {"tokens": tokens, "messages": len(window)}
    result.update({name: round(statistics.median(t), 3) for name, t in times.items()})
    result["memo_ratio"] = round(result["memo_ms"] / result["full_ms"], 3)
    return result


def bytes_per_answer(answers: int = 2000) -> int:
    """What the chains keep per recorded answer of about 2k characters (its text's link and its
    stretches), measured with ``tracemalloc``."""
    rng = random.Random(7)
    texts = [filler_text(rng, 250) for _ in range(answers)]
    chains = AnswerChains()
    names = [
        chains.chain_of(f"p{n}", ChainWindow.of([{"role": "user", "content": "x"}], None))[0]
        for n in range(answers)
    ]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for n, (name, text) in enumerate(zip(names, texts, strict=True)):
        chains.record(f"p{n}", name, Answer(text))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return round(used / answers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default="benchmarks/results/window_digest.json")
    args = parser.parse_args(argv)
    runs = [measure(tokens, args.rounds) for tokens in (8_000, 32_000, 128_000)]
    lines = [
        "| window (tokens) | messages | full digest (ms) | with the memo (ms) | ratio | "
        "implicit sessions' read (ms) | their link, no known answer (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        lines.append(
            f"| {run['tokens']:,} | {run['messages']} | {run['full_ms']} | {run['memo_ms']} | "
            f"{run['memo_ratio']} | {run['chain_ms']} | {run['link_ms']} |"
        )
    per_answer = bytes_per_answer()
    lines.append(f"\nMemory per recorded answer (each principal's first): {per_answer} bytes.")
    result = {"runs": runs, "bytes_per_answer": per_answer}
    out = Path(args.out)
    write_outputs(out.parent, out.stem, result, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
