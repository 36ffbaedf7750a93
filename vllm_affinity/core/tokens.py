"""Pure core: token-prefix and block-hash-chain math of a release."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens two prompts share: the first stale token index."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def first_divergent_block(cached: Iterable[Hashable | None], chain: Sequence[Hashable]) -> int:
    """Index of the first of a session's cached blocks that a prompt with block-hash chain
    ``chain`` cannot hit: the first whose hash is missing (uncached, partial or reused), differs
    from the chain at the same index, or lies beyond it. Hash chains are prefix-closed, so every
    later block is stale too. Exact whatever the chat template does to earlier turns."""
    count = 0
    for index, block_hash in enumerate(cached):
        if block_hash is None or index >= len(chain) or block_hash != chain[index]:
            return index
        count = index + 1
    return count
