"""Pure core: token-diff and block-index math of a release."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens two prompts share: the first stale token index."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def first_stale_block(first_stale_token: int, block_size: int) -> int:
    """Index of the first KV block holding a stale token: a block is valid only when every token
    in it is, so the block containing the first stale token is stale."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return first_stale_token // block_size
