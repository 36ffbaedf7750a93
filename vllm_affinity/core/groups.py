"""Pure core: the KV-cache groups of a model, as the session table sees them (no vLLM import).

A hybrid model (gpt-oss and Gemma 3: sliding-window beside full-attention layers; Qwen3-Next,
Nemotron-H, Granite 4: linear attention beside full attention) has one KV-cache group per kind of
layer. vLLM gives each request one block table per group, all drawn from one block pool, and
hashes blocks per group at the group's own block size (a multiple of the pool's hash block size).
A session's blocks are therefore tracked per group (one ``SessionBlocks`` each), and every
release, idle, protect and restore acts on every group, each from its own first stale block.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV-cache group: vLLM's group index, its kind (from its spec class: ``full_attention``,
    ``sliding_window``, ``mamba``, ``mla_attention``, ...), its block size in tokens and in hash
    blocks (``scale``: a request's block hashes are at the pool's hash block size), and a
    sliding window's size in tokens."""

    index: int
    kind: str
    block_size: int
    scale: int = 1  # block_size // the pool's hash block size
    window: int = 0  # a sliding window's tokens (0: not a sliding window)

    def __post_init__(self) -> None:
        if self.scale < 1 or self.block_size < 1:
            raise ValueError(
                f"group {self.index}: block size {self.block_size}, scale {self.scale}"
            )

    def block_of(self, hash_blocks: int) -> int:
        """The index of this group's block that holds hash block ``hash_blocks`` (the first
        block of a cut at that many hash blocks, straddling or not)."""
        return hash_blocks // self.scale

    def blocks_holding(self, tokens: int) -> int:
        """How many of this group's blocks hold the first ``tokens`` tokens, the one that
        straddles their end included."""
        return -(-tokens // self.block_size)


def kind_of(spec_class_name: str) -> str:
    """``SlidingWindowSpec`` → ``sliding_window``: a stable label for metrics and docs."""
    name = spec_class_name.removesuffix("Spec")
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def decode_bound_at_free(groups: tuple[KVGroup, ...], dense_kinds: frozenset[str]) -> int:
    """How many tokens a request may decode with none of its blocks dropped before it frees
    them, so that its growth can wait for its free: any number where every group is full
    attention; a sliding window drops a block once the window has passed it, so up to the
    smallest window less a block (a decode step adds fewer tokens than a block); none where a
    group drops blocks otherwise (a Mamba group's states)."""
    bound = sys.maxsize
    for group in groups:
        if group.kind in dense_kinds:
            continue
        if group.kind != "sliding_window" or group.window <= group.block_size:
            return 0
        bound = min(bound, group.window - group.block_size)
    return bound
