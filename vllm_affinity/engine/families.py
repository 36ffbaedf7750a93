"""Session families and idling (``Families``): a session that waits on its user goes to IDLE,
a subagent's end releases what its siblings will not hit, and a lead that waits on its
subagents is protected (or, with the picker on, idled when its waits outlast LRU's reach).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jiuwen_kv_protocol.models import EngineIdle, EngineRelease

from ..core import IdleResult, ReleaseSelection, Segment
from ..core.compaction import owner_of
from ..core.idle_guard import IdleGuard
from ..core.subagents import FamilyChange
from .bindings import Bindings, OverBindings
from .pool_context import PoolContext
from .releases import Releases


class Families(OverBindings):
    """Idles, subagents' ends and their leads' waits."""

    def __init__(self, ctx: PoolContext, bindings: Bindings, releases: Releases) -> None:
        super().__init__(ctx, bindings)
        self._releases = releases

    def idle_session(
        self, session: str, ends_task: bool = True, next_use: float | None = None
    ) -> EngineIdle:
        """The session waits on its user: its own blocks (every group's) go to IDLE, tail first,
        reused after released blocks and before any live session's, when the idle guard finds
        it worth it (``next_use``, the agent's hint in seconds, weighs in). Shared blocks and
        blocks in use stay.

        A subagent (a session that named a parent) whose signal ``ends_task`` (its model
        answered, or its hint says it is not back within the hour) has ended its task instead:
        its parent stops waiting on it, and with ``VLLM_AFFINITY_CHILD_END=release`` its own
        blocks are released as dead after what its siblings will hit (``_end_child``; and what
        other sessions have hit is kept: ``core/sessions.py``)."""
        self.counters.add("idles", 1)  # every signal, applied or not (a replay waits on it)
        if ends_task and self._ctx.subagents.parent_of(session) is not None:
            record = self.sessions.latest.get(session)
            result = None
            if (
                self._ctx.child_end == "release"
                and record is not None
                and record.request_id is None
            ):
                result = self._end_child(session)
            self.apply_family(self._ctx.subagents.ended(session))
            self.counters.add("children_ended", 1)
            if result is not None:
                return EngineIdle(
                    status=result.status, blocks_idled=0, kept_shared=result.kept_shared
                )
        selections = [table.select_idle(session) for table in self.tables]
        status = selections[0].status
        if status == "ok" and not self._worth_idling(self._ctx.idle_guard, session, next_use):
            self.counters.add("idles_returns_soon", 1)
            return EngineIdle(status="returns_soon", blocks_idled=0, kept_shared=0)
        moved = self._move_to_idle(selections)
        self.counters.add(f"idles_{status}", 1)
        return EngineIdle(
            status=status,
            blocks_idled=moved,
            kept_shared=sum(selection.kept_shared for selection in selections),
        )

    def _end_child(self, session: str) -> EngineRelease:
        """A subagent's end: its blocks are released as dead after what its siblings will hit
        (its instructions, the block straddling their end, and the start its siblings' first
        prompts have shared so far: ``core/siblings.py``), in every group."""
        keep = self._ctx.subagents.head_of(session)
        family = self._ctx.subagents.family_of(session)
        if family is not None:
            keep = max(keep, self._ctx.siblings.shared(family) * self.pool.hash_block_size)
        firsts = [group.blocks_holding(keep) for group in self._ctx.groups]
        kept = sum(
            len(table.unreused(session, 0)) - len(table.unreused(session, first))
            for table, first in zip(self.tables, firsts, strict=True)
        )
        self.counters.add("blocks_kept_instructions", kept)
        if self._ctx.returns is not None:  # what it keeps is for its siblings: not the picker's
            self._ctx.returns.forget(session)
        return self._releases.release_groups(session, firsts, "child_end")

    def sibling_family(self, parent: str, head: int, chain: Sequence[Any]) -> Any:
        """The key a new child's siblings are learned under: the hash of the block that ends
        its instructions, when the API server measured them, else its parent."""
        end = head // self.pool.hash_block_size
        return ("instructions", chain[end - 1]) if 0 < end <= len(chain) else ("parent", parent)

    def _move_to_idle(self, selections: Sequence[ReleaseSelection]) -> int:
        """Idle every group's selected blocks (one selection per group); how many moved."""
        blocks, moved = self.pool.blocks, 0
        for counts, selection in zip(self._ctx.group_counts, selections, strict=True):
            group_moved = sum(
                self.queue.idle(blocks[b]) is IdleResult.MOVED for b in selection.block_ids
            )
            counts["blocks_idled"] += group_moved
            moved += group_moved
        self.counters.add("blocks_idled", moved)
        return moved

    def _worth_idling(self, guard: IdleGuard | None, session: str, next_use: float | None) -> bool:
        """``guard``'s verdict (``core/idle_guard.py``; none: always), noting the absence it
        starts."""
        if guard is None:
            return True
        worth = guard.worth_idling(session, next_use)
        guard.went_idle(session, self.queue.cached_reused, self.queue.num_cached, next_use)
        return worth

    def apply_family(self, change: FamilyChange) -> None:
        for parent in change.unprotect:
            self._unprotect(parent)
        if change.protect is not None:
            waiting = self._protect if self._ctx.protect_cap > 0 else self._idle_waiting
            waiting(change.protect)

    def _idle_waiting(self, parent: str) -> None:
        """With the picker on: a parent that waits on its first running subagent gives its own
        blocks up first (IDLE, tail first) when its wait guard finds its waits outlast LRU's
        reach (an idle guard of its own: a lead's waits are not its user's absences), unless
        its last call said when it is back (the picker then knows). A lead waits while its
        subagent runs tens of calls, and the call order alone reads it as back in a few: on
        the Claude Code trace at 0.1x this closes 69% of the LRU → Belady gap in the
        simulator, against 65% (``docs/decisions.md``). Its last child's end, or its own next
        call, puts them back (``_unprotect``)."""
        guard, returns = self._ctx.wait_guard, self._ctx.returns
        if guard is None or returns is None or returns.hinted(owner_of(parent)):
            return
        if not self._worth_idling(guard, parent, None):
            return
        moved = self._move_to_idle([table.select_idle(parent) for table in self.tables])
        self.counters.add("waits_idled", 1)
        self.counters.add("blocks_idled_waiting", moved)

    def _protect(self, parent: str) -> None:
        """The parent's blocks (prefix first, the part a hit needs; group by group) go to
        PROTECTED, within the cap; blocks in use or already demoted by a release stay as they
        are."""
        room = self._ctx.protect_cap - self.queue.segment_sizes()["protected"]
        if room <= 0:
            return
        blocks, moved = self.pool.blocks, 0
        for block_id in self._unreused(parent):
            if moved >= room:
                break
            moved += self.queue.protect(blocks[block_id])
        self.counters.add("protects", 1)
        self.counters.add("blocks_protected", moved)

    def _unprotect(self, parent: str) -> None:
        """The parent stops waiting: its PROTECTED blocks (and, with the picker on, its IDLE
        ones: ``_idle_waiting``) go back to the most-recently-used end of NORMAL (it calls
        again soon)."""
        blocks = self.pool.blocks
        marked = (
            {Segment.PROTECTED}
            if self._ctx.wait_guard is None
            else {Segment.PROTECTED, Segment.IDLE}
        )
        for block_id in self._unreused(parent):
            block = blocks[block_id]
            if self.queue.segment_of(block) in marked:
                self.queue.restore(block)

    def _unreused(self, session: str) -> list[int]:
        return [b for table in self.tables for b in table.unreused(session, 0)]
