"""vLLM adapter, engine side: the instructions' checkpoint of a hybrid model's request.

The ``KVCacheManager.get_computed_blocks`` wrap (``engine.py``) hands its answer here. A
request whose API server said where its instructions end (``CHECKPOINT_KEY``, in tokens: see
``instructions.py``) and that will compute across that position gets it as its junction
(vLLM's ``shared_prefix_boundary``, the third value of the answer): vLLM's scheduler then ends a
prefill chunk there and its sliding-window and Mamba managers keep that state, as they do for a
prefix on its second appearance (``core/checkpoints.py`` says why). A request that reaches past
a checkpoint it shares keeps the checkpoint's blocks recent in the free queue.

A session's answer is where its next call comes back (an agent sends the window, the answer
and what follows): vLLM keeps a sliding window's state at the prompt's end only, so the answer
would be computed again on every call. While a session's request decodes, the
``KVCacheCoordinator.cache_blocks`` wrap (``patches.py``) makes its computed end the junction
for that call (``return_point``): each answer block the window covers is cached as it fills,
so the window at the answer's end is there when the session comes back. Only where every
sparse group is a sliding window (a Mamba state is kept at block ends vLLM chooses).

Nothing of vLLM's is rewritten: the wrap changes one value of the answer, and the blocks are
found with vLLM's own per-group lookup.
"""

from __future__ import annotations

from typing import Any

from ..core.checkpoints import Checkpoints, checkpoint_position, instructions_end, junction
from ..core.counters import Counters
from ..core.groups import KVGroup
from ..core.queue import SegmentedFreeBlockQueue
from ..core.request_keys import DENSE_KINDS
from .request_view import keys_of


def has_sparse_groups(groups: tuple[KVGroup, ...]) -> bool:
    """Whether some group keeps state only at some positions (sliding window, Mamba, ...)."""
    return any(group.kind not in DENSE_KINDS for group in groups)


class InstructionCheckpoints:
    """One engine's checkpoints (attached to its pool when the model has a sparse group)."""

    def __init__(
        self,
        queue: SegmentedFreeBlockQueue,
        groups: tuple[KVGroup, ...],
        counters: Counters,
        max_entries: int,
    ) -> None:
        self._queue = queue
        self._sparse = [group.index for group in groups if group.kind not in DENSE_KINDS]
        self._counters = counters
        self.known = Checkpoints(max_entries)
        self._span: int | None = None  # the state's span in tokens, read on first use
        #: Keep the window at each answer's end (``return_point``): sliding windows only.
        self.answers = bool(self._sparse) and all(
            group.kind == "sliding_window" for group in groups if group.kind not in DENSE_KINDS
        )

    def return_point(self, coordinator: Any, request: Any, tokens: int) -> int:
        """Where a session's decoding request would come back if its answer ended now: its
        computed tokens down to a block (0: not an answer being decoded, or not kept)."""
        if not self.answers or tokens <= request.num_prompt_tokens:
            return 0
        alignment = coordinator.scheduler_block_size
        point: int = tokens // alignment * alignment
        return point if point > request.num_prompt_tokens else 0

    def on_lookup(self, coordinator: Any, request: Any, answer: tuple[Any, int, int]) -> Any:
        """vLLM's prefix lookup for ``request`` (blocks, computed tokens, junction), with the
        instructions' end as the junction where the request will compute across it."""
        instructions = keys_of(request).checkpoint
        if not instructions:
            return answer
        blocks, computed, vllm_junction = answer
        alignment = coordinator.scheduler_block_size
        prompt = request.num_prompt_tokens
        span = self._state_span(coordinator)
        position = checkpoint_position(instructions, alignment, computed, prompt, span)
        if position:
            if position > vllm_junction and not getattr(request, "_jiuwen_checkpoint", 0):
                request._jiuwen_checkpoint = position  # counted once (a lookup may repeat)
                self._counters.add("checkpoints_marked")
            self.known.forget(self._key(coordinator, request, position))  # being made now
            return blocks, computed, junction(vllm_junction, position)
        position = instructions_end(instructions, alignment, span)
        if 0 < position <= computed:
            self._keep_recent(coordinator, request, position)
        return answer

    def _keep_recent(self, coordinator: Any, request: Any, position: int) -> None:
        """The request shares the checkpoint at ``position`` but its hit reaches past it, so
        vLLM touches none of the checkpoint's sparse blocks: move them to the most recently
        used end of the free queue, as if it had."""
        key = self._key(coordinator, request, position)
        if key is None:
            return
        blocks = self.known.blocks(key)
        if blocks is None:  # not known: vLLM's lookup, once ([]: no state there)
            blocks = self._find(coordinator, request, position)
            self.known.remember(key, blocks)
        refreshed = sum(self._queue.refresh(block) for block in blocks if block.ref_cnt == 0)
        if refreshed:
            self._counters.add("checkpoint_blocks_refreshed", refreshed)

    def _state_span(self, coordinator: Any) -> int:
        """The tokens the sparse groups' state at one position spans in the pool: a sliding
        window's (vLLM's spec), a Mamba state's block; summed over the groups (once)."""
        if self._span is None:
            span = 0
            for index in self._sparse:
                manager = coordinator.single_type_managers[index]
                spec = coordinator.kv_cache_config.kv_cache_groups[index].kv_cache_spec
                window = getattr(spec, "sliding_window", None)
                span += max(window or 0, manager.block_size)
            self._span = span
        return self._span

    @staticmethod
    def _key(coordinator: Any, request: Any, position: int) -> Any:
        """The checkpoint's key: the prompt's block hash at ``position`` (None: not hashed).
        The hash block size is the pool's: every coordinator has one (a unitary one, for a
        model whose every layer is a sliding window, keeps no copy of its own)."""
        hash_blocks = position // coordinator.block_pool.hash_block_size
        if not 0 < hash_blocks <= len(request.block_hashes):
            return None
        return request.block_hashes[hash_blocks - 1]

    def _find(self, coordinator: Any, request: Any, position: int) -> list[Any]:
        """The sparse groups' blocks that hold the state at ``position`` (vLLM's own per-group
        lookup); none when some group keeps no state there."""
        hits, lengths = hits_per_group(coordinator, request.block_hashes, position)
        found: list[Any] = []
        for index in self._sparse:
            if lengths[index] != position:
                return []
            found += [block for block in hits[index] if not block.is_null]
        return found


def hits_per_group(
    coordinator: Any, block_hashes: list[Any], length: int
) -> tuple[tuple[list[Any], ...], tuple[int, ...]]:
    """vLLM's longest hit of each group up to ``length`` tokens: a hybrid coordinator answers
    per group; a unitary one (a single group, e.g. every layer a sliding window) has only its
    one lookup, whose hit is its group's."""
    per_group = getattr(coordinator, "find_longest_cache_hit_per_group", None)
    if per_group is not None:
        return per_group(block_hashes, length)  # type: ignore[no-any-return]
    hits, hit_length = coordinator.find_longest_cache_hit(block_hashes, length)[:2]
    return tuple(hits), (hit_length,) * len(hits)
