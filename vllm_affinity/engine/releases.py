"""Applying release verdicts (``Releases``): a hint's or a compaction's release, a rewrite's
side and retried branches, a retry's settlement, openJiuwen's restore.

A release moves a session's blocks that no later prompt of it can hit to the RELEASED segment
(reused before any live block), in every KV-cache group, decided at once: the blocks a chain
(a prompt's block hashes) can still hit are kept, and so are blocks other sessions hold
(``core/sessions.py``). Each call counts one release, whatever branches it covers.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from jiuwen_kv_protocol.models import EngineRelease, EngineRestore, ReleaseMode

from ..core import (
    HOLE,
    ReleaseResult,
    ReleaseSelection,
    Segment,
    SessionBlocks,
    first_stale_block,
)
from ..core.compaction import retried_branch, side_branch
from ..core.groups import KVGroup
from ..core.request_keys import DENSE_KINDS
from .bindings import Bindings, OverBindings
from .fail_open import ERRORS
from .pool_context import PoolContext


class Releases(OverBindings):
    """Every path that releases a session's blocks."""

    def __init__(self, ctx: PoolContext, bindings: Bindings) -> None:
        super().__init__(ctx, bindings)
        #: A side branch's instruction length (its latest request's ``HEAD_KEY``).
        self._side_heads: OrderedDict[str, int] = OrderedDict()

    def release(self, session: str, first_block: int, mode: ReleaseMode = "post") -> EngineRelease:
        """Release the session's latest blocks after its first ``first_block`` hash blocks
        (block indices, for a one-group model), in every group."""
        return self.release_groups(
            session, [g.block_of(first_block) for g in self._ctx.groups], mode
        )

    def release_groups(
        self,
        session: str,
        first_blocks: Sequence[int],
        mode: ReleaseMode,
        also: Sequence[ReleaseSelection] = (),
    ) -> EngineRelease:
        """Release the session's latest blocks of each group from that group's block index in
        ``first_blocks`` on (and the blocks ``also`` selected, in the same release)."""
        self._bindings.catch_up(session)
        selections = [
            table.select_release(session, first)
            for table, first in zip(self.tables, first_blocks, strict=True)
        ]
        return self._apply(selections, first_blocks, mode, also)

    def release_divergent(
        self,
        session: str,
        chain: list[Any],
        mode: ReleaseMode,
        require_common_prefix: bool = False,
        also: Sequence[ReleaseSelection] = (),
        keep_tokens: int = 0,
    ) -> EngineRelease:
        """Release the session's latest blocks, in every group, from the first one ``chain`` (a
        prompt's block hashes) cannot hit. ``require_common_prefix``: a chain that shares not
        even one block with the session's cache is a different prompt (template, salt), not a
        cut of it: answer ``record_mismatch`` and release nothing. ``also``: blocks selected
        elsewhere, released with these. ``keep_tokens``: every block holding the session's
        first that many tokens is kept, the one straddling their end included."""
        started = time.perf_counter()
        record = self.sessions.latest.get(session)
        if record is None:
            result = self._apply([ReleaseSelection(status="unknown_session")], (0,), mode, also)
        else:
            firsts = [
                max(first, group.blocks_holding(keep_tokens))
                for first, group in zip(
                    self._first_stale(session, chain), self._ctx.groups, strict=True
                )
            ]
            if require_common_prefix and chain and not self._any_hit(session, firsts):
                result = self._apply([ReleaseSelection(status="record_mismatch")], (0,), mode)
            else:
                result = self.release_groups(session, firsts, mode, also)
            result.prompt_tokens = record.num_prompt_tokens
        # time spent in the engine core on this path (what a hinted request adds to its step)
        self.counters.add(f"release_us_{mode}", round((time.perf_counter() - started) * 1e6))
        return result

    def release_rewritten(self, session: str, chain: list[Any], head: int = 0) -> EngineRelease:
        """A compaction told from the agent's own requests (``core/compaction.py``): the main
        thread's blocks ``chain`` cannot hit, also when ``chain`` shares no block with them (the
        agent said the old window is gone), and a retry's replaced window past what ``chain``
        hits, in one release, decided now. ``head``: the new window's instructions, in tokens.

        The session's side branch goes in the same release. One that started with the whole
        old prompt (Qwen Code's suggestion: the window and one message) goes whole. One with a
        prompt of its own (a memory extractor or opencode's summarizer under its own system
        prompt, the Codex CLI's tool-less compaction request) keeps its instructions and the
        part of the conversation the new window still carries, as long as it was in the old
        window (the Codex CLI keeps its environment and the user's turns; the next compaction
        request sends them again): what ``chain`` hits of the old window past the
        instructions, one block more for the two renderings' differences."""
        also: list[ReleaseSelection] = []
        side, retried = side_branch(session), retried_branch(session)
        side_head = self._side_heads.get(side, 0)
        dead = self._dead_blocks([(session, 0), (side, side_head), (retried, 0)], chain)
        if side in self.sessions.latest:
            self._side_heads.pop(side, None)
            if self._carried_conversation(side, session):
                firsts = [0] * len(self.tables)
            else:
                kept = self._first_stale(session, chain)
                firsts = [
                    self._side_keeps(group, side_head, max(0, f * group.block_size - head))
                    for f, group in zip(kept, self._ctx.groups, strict=True)
                ]
            also += [t.select_release(side, f) for t, f in zip(self.tables, firsts, strict=True)]
            for table in self.tables:
                table.forget(side)
        if retried in self.sessions.latest:  # a retry's replaced window: what chain cannot hit
            firsts = self._first_stale(retried, chain)
            also += [t.select_release(retried, f) for t, f in zip(self.tables, firsts, strict=True)]
            for table in self.tables:
                table.forget(retried)
        result = self.release_divergent(session, chain, "compaction", also=also)
        blocks, released = self.pool.blocks, Segment.RELEASED
        self.counters.add("compaction_blocks_dead", len(dead))
        self.counters.add(
            "compaction_dead_released",
            sum(self.queue.headed_for(blocks[b]) is released for b in dead),
        )
        return result

    def _dead_blocks(self, branches: Sequence[tuple[str, int]], chain: list[Any]) -> set[int]:
        """The audit of a rewrite, apart from the rule that decides it: the cached blocks of
        the ``(branch, instruction tokens kept)`` records, past those instructions, whose hash
        is nowhere in ``chain`` (no later prompt of the session can hit them). What share of
        them the rewrite released is ``/metrics``' figure of how much a compaction freed."""
        hashes = set(chain)
        strip, blocks = self._ctx.strip_group, self.pool.blocks
        dead: set[int] = set()
        for group, table in zip(self._ctx.groups, self.tables, strict=True):
            for branch, head in branches:
                record = table.latest.get(branch)
                recorded = table.still_recorded(branch)
                if record is None or recorded is None:
                    continue
                keep = group.blocks_holding(head)
                for index in (np.flatnonzero(recorded[keep:]) + keep).tolist():
                    block_hash = blocks[record.block_ids[index]].block_hash
                    if block_hash is not None and strip(block_hash) not in hashes:
                        dead.add(record.block_ids[index])
        return dead

    @staticmethod
    def _side_keeps(group: KVGroup, side_head: int, carried: int) -> int:
        """The side branch's blocks kept at a rewrite: its instructions (the block straddling
        their end included) and ``carried`` tokens more, one block more for those (they are
        the new window's rendering of the items, the side's may differ by a few tokens)."""
        if carried == 0:
            return group.blocks_holding(side_head)
        return group.blocks_holding(side_head + carried) + 1

    def _carried_conversation(self, branch: str, session: str) -> bool:
        """Whether ``branch``'s latest request started with every whole block of ``session``'s
        latest prompt (in the first group that holds both): the conversation, not only the
        instructions they share (the Codex CLI's compaction request shares its developer prompt,
        190 of 371 blocks, its tools rendered apart)."""
        for table, group in zip(self.tables, self._ctx.groups, strict=True):
            side = table.latest.get(branch)
            main = table.latest.get(session)
            if side is None or main is None or not main.block_ids:
                continue
            shared = 0
            for side_id, main_id in zip(side.block_ids, main.block_ids, strict=False):
                if side_id != main_id or side_id == HOLE:
                    break
                shared += 1
            whole = min(len(main.block_ids), main.num_prompt_tokens // group.block_size)
            return shared > 0 and shared >= whole
        return False

    def restore_divergent(self, session: str, chain: list[Any]) -> EngineRestore:
        """openJiuwen's ``prefetch``: the session's blocks from the first one ``chain`` cannot
        hit (in every group), demoted by an earlier release and not reused since, go back to
        the most-recently-used end of NORMAL. Blocks already reused are gone: this server has
        no second tier to load them from."""
        if session not in self.sessions.latest:
            status, firsts, restored = "unknown_session", [0], 0
        else:
            firsts = self._first_stale(session, chain)
            blocks = self.pool.blocks
            restored = sum(
                self.queue.restore(blocks[b])
                for table, first in zip(self.tables, firsts, strict=True)
                for b in table.unreused(session, first)
            )
            status = "ok"
        self.counters.add("restores", 1)
        self.counters.add("blocks_restored", restored)
        return EngineRestore(status=status, blocks_restored=restored, first_stale_block=firsts[0])

    def _first_stale(self, session: str, chain: list[Any]) -> list[int]:
        """Per group, the index of the session's first block ``chain`` cannot hit."""
        self._bindings.catch_up(session)
        firsts = []
        for group, table in zip(self._ctx.groups, self.tables, strict=True):
            if group.kind in DENSE_KINDS:
                firsts.append(self._dense_first_stale(group, table, session, chain))
                continue
            whole = self._all_hit(group, table, session, chain)
            firsts.append(
                first_stale_block(self._entries(group, table, session), chain)
                if whole is None
                else whole
            )
        return firsts

    def _dense_first_stale(
        self, group: KVGroup, table: SessionBlocks, session: str, chain: list[Any]
    ) -> int:
        """``first_stale_block`` for a full-attention group, in a few comparisons, not a walk.
        The entries that still hold what the record recorded are prefix-closed against
        ``chain`` (once one differs, every later one does), so a binary search over each run
        of them finds the first that differs; an entry handed out since is compared on its
        own. A session away while the pool ran short has such entries in a record of
        thousands (a walk there cost 4 ms a call at full size)."""
        record = table.latest.get(session)
        live = table.still_recorded(session)
        if record is None or live is None:
            return 0
        blocks, block_ids = self.pool.blocks, record.block_ids

        def serves(index: int) -> bool:
            return self._serves(group, blocks[block_ids[index]], index, chain)

        start, size = 0, len(block_ids)
        for gone in [*np.flatnonzero(~live).tolist(), size]:
            low, high = start, gone  # every entry here holds its recorded content
            if low < high and not serves(high - 1):
                while low < high:
                    middle = (low + high) // 2
                    if serves(middle):
                        low = middle + 1
                    else:
                        high = middle
                return low
            if gone == size or not serves(gone):
                return gone
            start = gone + 1
        return size

    def _all_hit(
        self, group: KVGroup, table: SessionBlocks, session: str, chain: list[Any]
    ) -> int | None:
        """``first_stale_block``'s answer when ``chain`` hits the session's whole record (an
        agent's next call mostly does): its length, read from its last block alone, since hash
        chains are prefix-closed and every block still holds what it recorded; None otherwise
        (the walk decides). A record of thousands of blocks costs one comparison, not a walk."""
        record = table.latest.get(session)
        if record is None or not table.unchanged(session):
            return None
        blocks, block_ids = self.pool.blocks, record.block_ids
        answer = last = len(block_ids)  # the first tail block without a hash (the walk's stop)
        while last > 0:
            last -= 1
            if block_ids[last] == HOLE:
                continue
            block = blocks[block_ids[last]]
            if block.block_hash is not None:
                break
            answer = last  # a partial block, or a decoded one not full yet: never hit
        else:
            return None
        return answer if self._serves(group, block, last, chain) else None

    def _end(self, group: KVGroup, block: Any, index: int) -> int:
        """How many of the prompt's hash blocks the record's block at ``index`` covers from the
        prompt's start: its hash's own length where vLLM says it (a Mamba state cached inside
        its block), else its block's end."""
        tokens = getattr(block, "block_hash_num_tokens", None)
        return tokens // self.pool.hash_block_size if tokens else (index + 1) * group.scale

    def _serves(self, group: KVGroup, block: Any, index: int, chain: list[Any]) -> bool:
        """Whether the record's block at ``index`` holds ``chain``'s hash at its end."""
        if block.block_hash is None:
            return False
        end = self._end(group, block, index)
        return end <= len(chain) and self._ctx.strip_group(block.block_hash) == chain[end - 1]

    def _any_hit(self, session: str, firsts: Sequence[int]) -> bool:
        """Whether ``firsts`` (from ``_first_stale``) keep at least one block of some group."""
        for table, first in zip(self.tables, firsts, strict=True):
            record = table.latest.get(session)
            if record is not None and any(b != HOLE for b in record.block_ids[:first]):
                return True
        return False

    def _entries(
        self, group: KVGroup, table: SessionBlocks, session: str
    ) -> list[tuple[Any, int] | None]:
        """The session's record in ``group`` as ``first_stale_block`` reads it: per index, no
        block (a hole), or the block's hash (without its group id) and how many hash blocks it
        covers from the prompt's start."""
        record = table.latest.get(session)
        if record is None:
            return []
        # a group that drops blocks mid-request (sliding window, Mamba) also has blocks vLLM
        # handed out again, and blocks it never cached: holes, not a divergence (its hits need
        # no unbroken run from the start, so the blocks past them still serve the prompt)
        sparse = group.kind not in DENSE_KINDS
        recorded = table.still_recorded(session) if sparse else None
        blocks, strip = self.pool.blocks, self._ctx.strip_group
        entries: list[tuple[Any, int] | None] = []
        for index, block_id in enumerate(record.block_ids):
            if block_id == HOLE or (recorded is not None and not recorded[index]):
                entries.append(None)
                continue
            block = blocks[block_id]
            block_hash = block.block_hash
            if block_hash is None and sparse:
                entries.append(None)
                continue
            end = self._end(group, block, index)
            entries.append((None if block_hash is None else strip(block_hash), end))
        return entries

    def _apply(
        self,
        selections: Sequence[ReleaseSelection],
        first_blocks: Sequence[int],
        mode: ReleaseMode,
        also: Sequence[ReleaseSelection] = (),
    ) -> EngineRelease:
        """Release every group's selected blocks (and ``also``'s, counted as one release).
        ``selections`` holds one selection per group, in group order; ``also`` whole rounds
        of them (one per branch released with the session)."""
        groups = len(self._ctx.group_counts)
        if len(also) % groups:
            raise ValueError(f"{len(also)} selections are not whole rounds of {groups} groups")
        moved = pending = 0
        for per_group in (selections, also):
            for index, selection in enumerate(per_group):
                counts = self._ctx.group_counts[index % groups]
                results = Counter(
                    self.queue.release(self.pool.blocks[b]) for b in selection.block_ids
                )
                if self._ctx.tiers and results[ReleaseResult.MOVED]:
                    self._release_copies(selection.block_ids)
                counts["blocks_released"] += (
                    results[ReleaseResult.MOVED] + results[ReleaseResult.PENDING]
                )
                moved += results[ReleaseResult.MOVED]
                pending += results[ReleaseResult.PENDING]
        status = selections[0].status
        self.counters.add("releases", 1)
        self.counters.add(f"releases_{status}", 1)
        self.counters.add(f"releases_{mode}", 1)
        self.counters.add("blocks_moved", moved)
        self.counters.add("blocks_pending", pending)
        self.counters.add(f"block_released_{mode}", moved + pending)
        return EngineRelease(
            status=status,
            block_released=moved + pending,
            moved=moved,
            pending=pending,
            kept_shared=sum(s.kept_shared for s in [*selections, *also]),
            first_stale_block=first_blocks[0],
        )

    def _release_copies(self, block_ids: Sequence[int]) -> None:
        """The offload tiers' copies of the released blocks now queued as RELEASED (not the
        ones still in use: a request may yet bind them) go first there too."""
        blocks, released = self.pool.blocks, Segment.RELEASED
        hashes = [
            blocks[b].block_hash for b in block_ids if self.queue.segment_of(blocks[b]) is released
        ]
        for tier in self._ctx.tiers:
            try:
                self.counters.add("offload_blocks_released", tier.release(hashes))
            except Exception as exc:  # the GPU's release stands; the tier keeps its order
                ERRORS.caught("offload", exc)

    def note_side_head(self, branch: str, head: int) -> None:
        """The instruction length of a side branch's latest request (bounded, oldest out)."""
        self._side_heads[branch] = head
        self._side_heads.move_to_end(branch)
        while len(self._side_heads) > self._ctx.max_sessions:
            self._side_heads.popitem(last=False)

    def settle_retry(self, retried: str, chain: list[Any]) -> None:
        """The window after a retry says which branch the thread continues: the replaced
        window's blocks this prompt cannot hit are dead (the blocks the main thread still holds
        stay), in every group."""
        self.release_divergent(retried, chain, "compaction")
        for table in self.tables:
            table.forget(retried)
