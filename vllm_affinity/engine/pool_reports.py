"""What the pool reports (``PoolReports``): its stats (counters and sizes, read every refresh
of ``/metrics``, so never a walk over every record) and its invariant check
(``/affinity/check``, bounded so that it cannot stall the scheduler).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jiuwen_kv_protocol.models import EngineStats, GroupStats, Segments

from .bindings import Bindings, OverBindings
from .fail_open import ERRORS
from .pool_context import PoolContext

#: What one bounded check (``/affinity/check``, between two scheduler steps) walks at most: a
#: rotating slice of this many blocks of a larger pool, and the session records (their holder
#: counts, each group's bindings) only while there are at most this many (a walk of every
#: record is ~1 s at 100k sessions).
CHECK_BLOCKS = 16_384
CHECK_RECORDS = 4_096


class PoolReports(OverBindings):
    """The pool's stats and checks."""

    def __init__(self, ctx: PoolContext, bindings: Bindings) -> None:
        super().__init__(ctx, bindings)
        #: Where the next bounded check's slice of blocks starts, and what the last covered.
        self._check_cursor = 0
        self.check_scope: dict[str, Any] = {}

    def group_stats(self, exact: bool = False, bindings: int | None = None) -> list[GroupStats]:
        """Per group, its counts. Its bindings: with one group, the pool's (one numpy pass, or
        ``bindings`` when the caller made it); with several, counted record by record only
        when ``exact`` (``/affinity/check``): a walk over every record, 0.6 s at 100k
        sessions, has no place on the stats' path."""
        tables = self.tables
        single = None
        if len(tables) == 1:
            single = self._bindings.raw_states.bindings() if bindings is None else bindings
        return [
            GroupStats(
                group=group.index,
                kind=group.kind,
                block_size=group.block_size,
                bindings=table.bindings if exact and single is None else single,
                **counts,
            )
            for group, table, counts in zip(
                self._ctx.groups, tables, self._ctx.group_counts, strict=True
            )
        ]

    def spent_in_utility(self, ns: int) -> None:
        """An engine utility call took ``ns`` nanoseconds between two scheduler steps: counted
        in the plugin's engine time, with the longest such call."""
        self._ctx.engine_ns += ns
        us = ns // 1000
        self.counters.add("utility_calls")
        self.counters.add("utility_us", us)
        longest = self.counters["utility_us_max"]
        if us > longest:
            self.counters.add("utility_us_max", us - longest)

    def stats(self, exact: bool = False) -> EngineStats:
        """The counters and sizes (``exact``: each group's bindings too, ``group_stats``)."""
        # one pass over the pool (its handouts settled), read once
        bindings = self._bindings.block_states.bindings()
        return EngineStats(
            segments=Segments(**self.queue.segment_sizes()),
            pending=self.queue.num_pending,
            released_reused=self.queue.released_reused,
            released_hit=self.queue.released_hit,
            protected_reused=self.queue.protected_reused,
            children=len(self._ctx.subagents),
            sessions=len(self.sessions),
            bindings=bindings,
            sessions_evicted=self.sessions.evicted,
            num_blocks=self.pool.num_gpu_blocks,
            groups=self.group_stats(exact, bindings),
            predict_return=self._ctx.returns is not None,
            engine_errors=dict(ERRORS.counts),
            malformed_args=dict(ERRORS.malformed),
            **{
                **self.counters.as_dict(),
                "engine_us": (self._ctx.engine_ns + self.queue.picker_ns) // 1000,
                "engine_steps": self._ctx.steps,
                "offload_blocks_parked": self.queue.parked,
            },
        )

    def check(self, idle: bool, bounded: bool = False) -> list[str]:
        """Invariant violations of the pool, the queue and the session tables (empty when all
        hold). ``idle``: no request is running, so nothing may be in use or pending.
        ``bounded``: at most ``CHECK_BLOCKS`` blocks (the next slice of a larger pool, calls
        rotating over it) and the holder counts only up to ``CHECK_RECORDS`` records;
        ``check_scope`` says what the call covered."""
        queue = self.queue
        records = sum(len(table.latest) for table in self.tables)
        holders = not bounded or records <= CHECK_RECORDS
        problems = self._ctx.subagents.check()
        if holders:
            problems += self.tables[0].check(self.tables[1:])
        known = [set(table.latest) for table in self.tables]
        if any(k != known[0] for k in known):
            problems.append("the groups' session tables know different sessions")
        sizes = queue.segment_sizes()
        if sum(sizes.values()) != queue.num_free_blocks:
            problems.append(f"segments {sizes} do not sum to {queue.num_free_blocks} free")
        blocks = self.pool.blocks
        if not bounded or len(blocks) <= CHECK_BLOCKS:
            start, stop = 0, len(blocks)
            in_use = self._check_all_blocks(problems)
        else:
            start = self._check_cursor
            stop = min(len(blocks), start + CHECK_BLOCKS)
            self._check_cursor = 0 if stop == len(blocks) else stop
            in_use = self._check_blocks(blocks[start:stop], problems)
        if idle and (in_use or queue.num_pending or self._bindings.bound):
            problems.append(
                f"idle, yet {in_use} blocks in use, {queue.num_pending} pending, "
                f"{len(self._bindings.bound)} requests bound"
            )
        self.check_scope = {"blocks": [start, stop], "of": len(blocks), "holders": holders}
        return problems

    def _check_all_blocks(self, problems: list[str]) -> int:
        """Every block against the queue's own walk; the blocks in use."""
        free = {b.block_id for b in self.queue.get_all_free_blocks()}
        in_use = 0
        for block in self.pool.blocks:
            if block.is_null:
                continue
            in_use += block.ref_cnt > 0
            if (block.ref_cnt == 0) != (block.block_id in free):
                where = "in" if block.block_id in free else "not in"
                problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt}, {where} queue")
        real = sum(1 for b in self.pool.blocks if not b.is_null)
        if len(free) + in_use != real:
            problems.append(f"{len(free)} free + {in_use} in use != {real} blocks")
        return in_use

    def _check_blocks(self, blocks: Sequence[Any], problems: list[str]) -> int:
        """``blocks`` against their own queue links; the blocks of them in use."""
        in_use = 0
        for block in blocks:
            if block.is_null:
                continue
            in_use += block.ref_cnt > 0
            queued = self.queue.holds(block)
            if (block.ref_cnt == 0) != queued:
                where = "in" if queued else "not in"
                problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt}, {where} queue")
        return in_use
