"""Pure core: the start that sibling subagents' first prompts share (no vLLM import).

A coding agent starts many subagents with the same instructions (system prompt and tools), and
their first user messages often start alike too: Claude Code opens each with a shared system
reminder, the project's CLAUDE.md and context. A subagent's end releases its own blocks as dead,
but the blocks of that shared start are what the next sibling hits. So the engine learns, per
family of siblings, the hash-chain prefix that every sibling's first prompt has shared so far,
and an end keeps at least that much.

A family is keyed by its instructions where they are known (the hash of the block that ends
them: siblings of different leads with the same instructions learn together), else by the
parent. One sibling alone says nothing yet (its whole prompt would look shared); from the
second on, the learned start is the common prefix of all of them. Memory is bounded: at most
``max_families`` families, least recently seen first out, each keeping at most
``max_blocks`` hashes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .tokens import common_prefix_length


@dataclass(slots=True)
class _Family:
    start: tuple[Hashable, ...]  # the prefix every first prompt seen so far shares
    siblings: int


class SiblingStarts:
    """Per family, the shared start of its subagents' first prompts, in hash blocks."""

    def __init__(self, max_families: int = 1024, max_blocks: int = 256) -> None:
        if max_families < 1 or max_blocks < 1:
            raise ValueError("max_families and max_blocks must be at least 1")
        self._families: OrderedDict[Hashable, _Family] = OrderedDict()
        self._max_families = max_families
        self._max_blocks = max_blocks

    def __len__(self) -> int:
        return len(self._families)

    def observe(self, family: Hashable, first_prompt: Sequence[Hashable]) -> int:
        """A new sibling's first prompt (its block-hash chain): returns how many leading hash
        blocks every sibling of ``family`` has shared so far, this one included (0 while it is
        the first)."""
        chain = tuple(first_prompt[: self._max_blocks])
        known = self._families.get(family)
        if known is None:
            self._families[family] = _Family(chain, 1)
            while len(self._families) > self._max_families:
                self._families.popitem(last=False)
            return 0
        self._families.move_to_end(family)
        known.start = known.start[: common_prefix_length(known.start, chain)]
        known.siblings += 1
        return len(known.start)

    def shared(self, family: Hashable) -> int:
        """The family's learned shared start in hash blocks (0 until a second sibling)."""
        known = self._families.get(family)
        return len(known.start) if known is not None and known.siblings > 1 else 0
