"""Chat windows from block ids: equal ids give equal text, so sharing is reproduced exactly.

Each block id becomes a fixed run of words (one token each for common tokenizers, seeded by the
id and the run's ``nonce``, so two runs on one server share nothing). A window is a list of user
messages, one a *turn*: the blocks a request added to what an earlier prompt already had. A
session's next request keeps the messages of its previous one that lie wholly in the prefix they
share and adds the rest as one new message, so the hook's diff sees an append as an append and a
rewrite as a release from the first changed message, as with a real agent. A session's first
request takes the messages of the longest earlier prompt it starts with (the shared system
prompt, a subagent's brief), so prefixes shared across sessions render to the same tokens.
Where the trace says how many leading blocks are the actor's instructions, they can be one
system message, as agents send them (``window(blocks, instructions)``).

Pure: no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

#: Words that are one token each (with their leading space) in the project's small model and in
#: the usual byte-level BPE vocabularies.
WORDS = (
    "the", "a", "weather", "city", "wind", "rain", "sunny", "cloud", "forecast", "tool",
    "result", "agent", "plan", "step", "file", "read", "write", "search", "error", "value",
    "key", "list", "item", "user", "call", "json",
)  # fmt: skip


class WindowBuilder:
    """Turns each request's block ids into chat messages (see the module)."""

    def __init__(self, tokens_per_block: int, nonce: int = 0) -> None:
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
        self.tokens_per_block = tokens_per_block
        self.nonce = nonce
        self._text: dict[int, str] = {}
        #: Chain key of a prompt prefix that ends where a message ends → (the key where that
        #: message starts, or None, and the message's blocks).
        self._boundaries: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def text(self, block: int) -> str:
        text = self._text.get(block)
        if text is None:
            rng = random.Random(hash((self.nonce, block)))
            text = " " + " ".join(rng.choice(WORDS) for _ in range(self.tokens_per_block))
            self._text[block] = text
        return text

    def turns(self, blocks: Sequence[int]) -> list[tuple[int, ...]]:
        """The blocks of each message of the window for ``blocks``."""
        chain: list[int] = []
        key = 0
        for b in blocks:
            key = hash((key, b))
            chain.append(key)
        start = next((k for k in range(len(blocks), 0, -1) if chain[k - 1] in self._boundaries), 0)
        kept: list[tuple[int, ...]] = []
        cursor: int | None = chain[start - 1] if start else None
        while cursor is not None:
            cursor, turn = self._boundaries[cursor]
            kept.append(turn)
        kept.reverse()
        if start < len(blocks):
            new = tuple(blocks[start:])
            self._boundaries[chain[-1]] = (chain[start - 1] if start else None, new)
            kept.append(new)
        return kept

    def window(self, blocks: Sequence[int], instructions: int = 0) -> list[dict[str, Any]]:
        """The chat messages for a prompt of ``blocks``; its first ``instructions`` blocks, when
        given, are one system message (the agent's instructions), the rest user messages."""
        if 0 < instructions < len(blocks):
            key = 0
            for b in blocks[:instructions]:
                key = hash((key, b))
            self._boundaries.setdefault(key, (None, tuple(blocks[:instructions])))
        turns = self.turns(blocks)
        # a window of the instructions alone stays a user message (a chat needs one)
        system = instructions > 0 and len(turns) > 1 and len(turns[0]) == instructions
        return [
            {
                "role": "system" if system and index == 0 else "user",
                "content": "".join(self.text(b) for b in turn),
            }
            for index, turn in enumerate(turns)
        ]
