"""Pure core: where a hybrid model keeps an agent's instructions (no vLLM import).

A sliding-window or linear-attention (Mamba) group can resume a prompt only where it kept that
group's state: vLLM keeps it at each prompt's end and at one *junction* per request, the longest
prefix that another request already cached in full attention (``shared_prefix_boundary``). So a
prefix becomes a junction on its second appearance and hits from its third: the request that
starts a compacted window, a subagent's first call and a new session's first call recompute the
instructions they share with earlier requests.

The plugin knows where a request's instructions end (``instructions.py``: the tokens two renders
with different user messages share). Making that position the request's junction, from the
first request that computes across it, keeps the state there at once; later requests with the
same instructions hit it. ``Checkpoints`` remembers which blocks hold each such state, so a
request that reaches past it (a session's later turns hit their own prompt ends, not the
checkpoint) can keep it as recent as the last request that shares it: LRU takes it only after
the blocks no such request used more lately. Bound: one checkpoint per distinct instructions
(``max_entries``, least recently used out), each the blocks vLLM's own junction would keep
(a window's worth per sliding-window group, one state per Mamba group); instructions no longer
than that state are not kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any


def instructions_end(instructions: int, alignment: int, state_span: int = 0) -> int:
    """Where a checkpoint for ``instructions`` (their length in tokens) lies: their end,
    floored to ``alignment`` (the granularity of a hit). 0, none, when the instructions are not
    longer than ``state_span``, the tokens the sparse groups' state there spans in the pool (a
    sliding window's, a Mamba state's block, summed over the groups): such a state costs as
    many blocks as it saves (measured: the simulator's grid computed more than vanilla in a
    cell where it was kept)."""
    if alignment < 1:
        raise ValueError(f"alignment {alignment}: expected a positive number of tokens")
    position = instructions // alignment * alignment
    return position if position > state_span else 0


def checkpoint_position(
    instructions: int, alignment: int, computed: int, prompt: int, state_span: int = 0
) -> int:
    """The position, in tokens, at which a request should keep its sparse groups' state for
    its ``instructions`` (``instructions_end``). 0 when there is nothing to keep: none, the
    request's hit (``computed`` tokens) already reaches it, or the prompt ends there (vLLM
    keeps a prompt's end anyway)."""
    position = instructions_end(instructions, alignment, state_span)
    return position if computed < position < prompt else 0


def junction(vllm_junction: int, checkpoint: int) -> int:
    """The one junction a request may carry: vLLM's (a prefix another request shares) or the
    instructions' end, whichever is later. A later junction covers more of the prompt; vLLM's,
    when earlier, is often only a chat template's opening every request shares."""
    return max(vllm_junction, checkpoint)


class Checkpoints:
    """The blocks that hold each instructions' checkpoint, by the prompt's block hash at its
    position (the hash chain names the whole prefix, salt included). An entry is valid while
    each of its blocks still carries the hash it had when found (a reused block has another)."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries {max_entries}: expected at least 1")
        self._max_entries = max_entries
        self._entries: OrderedDict[Hashable, tuple[tuple[Any, Any], ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def blocks(self, key: Hashable) -> list[Any] | None:
        """The blocks of ``key``'s checkpoint, or None when unknown or no longer valid (one of
        them was reused: the state is gone). ``[]``: known to hold no state (remembered so, so
        that the lookup is not repeated on every request; ``forget`` it when one is made)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if any(block.block_hash != block_hash for block, block_hash in entry):
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return [block for block, _ in entry]

    def forget(self, key: Hashable) -> None:
        """A request is making ``key``'s checkpoint (again): what was known of it is stale."""
        self._entries.pop(key, None)

    def remember(self, key: Hashable, blocks: Sequence[Any]) -> None:
        """``blocks`` hold ``key``'s checkpoint now (the least recently used entry goes)."""
        self._entries[key] = tuple((block, block.block_hash) for block in blocks)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
