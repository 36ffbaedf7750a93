"""Pure core: token-prefix and block-hash-chain math of a release."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence


def common_prefix_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
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
    later block is stale too. Exact whatever the chat template does to earlier turns.

    The session's latest request (its prompt and answer) against the cut window's prompt, with
    block size 4; ``|`` marks a block boundary, ``^`` the first token that differs::

        cached:  | s s s u | u u u a | a a x x | x x x x | x g g   (g: generated, partial block)
        chain:   | s s s u | u u u a | a a y y | y
                                           ^
        hashes:  |   h0    |   h1    |   h2    |   h3    |  None
        chain:   |   h0    |   h1    |   h2'   |
                                       → 2: blocks 2, 3 and 4 are stale

    Block 2 holds the first differing token, so its hash differs, and the chain is shorter than
    the cache from there on. The cut's own partial block (``y``) has no hash, as in vLLM.
    """
    count = 0
    for index, block_hash in enumerate(cached):
        if block_hash is None or index >= len(chain) or block_hash != chain[index]:
            return index
        count = index + 1
    return count


def first_stale_block(
    cached: Iterable[tuple[Hashable | None, int] | None], chain: Sequence[Hashable]
) -> int:
    """``first_divergent_block`` for one KV-cache group of a hybrid model, whose blocks may span
    several of ``chain``'s hash blocks (the group's block size is a multiple of the pool's hash
    block size, at which requests carry their hashes) and whose record has holes.

    ``cached``: per index of the group's record, ``None`` where the request holds no block
    (vLLM's null block: before a sliding window, a Mamba state it kept no copy of), else the
    block's hash (``None``: not cached) and how many hash blocks that hash covers from the
    prompt's start (its block's end, or a finer boundary inside it for a Mamba state cached at
    one). Holes are skipped: each block is compared with the chain's hash at its own boundary,
    and hash chains are prefix-closed, so every block after the first stale one is stale too.
    """
    count = 0
    for index, entry in enumerate(cached):
        count = index + 1
        if entry is None:
            continue
        block_hash, end = entry
        if block_hash is None or end > len(chain) or block_hash != chain[end - 1]:
            return index
    return count
