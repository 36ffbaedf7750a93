"""Filler text: prompts of a predictable size for the small model (a window of words, the
same for the same seed)."""

from __future__ import annotations

import random
from typing import Any

#: Words for filler text: prompts of a predictable size for the small model (~2.4 tokens/pair).
FILLER_WORDS = [
    "weather",
    "city",
    "wind",
    "rain",
    "sunny",
    "cloud",
    "forecast",
    "tool",
    "result",
    "agent",
    "plan",
    "step",
    "file",
    "read",
    "write",
    "search",
    "error",
    "value",
    "key",
    "list",
    "item",
    "build",
    "test",
    "deploy",
    "commit",
    "branch",
    "merge",
    "log",
    "trace",
]


def filler_text(rng: random.Random, pairs: int) -> str:
    """``pairs`` "word number" pairs drawn from ``rng``."""
    return " ".join(f"{rng.choice(FILLER_WORDS)} {rng.randint(0, 999)}" for _ in range(pairs))


def filler_window(seed: int, words: int) -> list[dict[str, Any]]:
    """A 4-message window (system, user, assistant, tool) of about ``words`` filler pairs."""
    rng = random.Random(seed)
    return [
        {"role": "system", "content": f"You are agent {seed}."},
        {"role": "user", "content": filler_text(rng, words // 2)},
        {"role": "assistant", "content": "Looking it up."},
        {"role": "tool", "tool_call_id": "c1", "content": filler_text(rng, words // 2)},
    ]
