"""Offline prefix-cache simulator: the same block-hash trace under several eviction policies.

- ``infinite``: nothing is ever evicted (upper bound of the trace);
- ``lru``: vLLM-like: uncached blocks are reused first, then cached blocks in LRU order, a
  finished request's blocks freed tail first (so its tail is evicted first);
- ``lru_release``: ``lru`` plus the release: when a session's window is rewritten, its previous
  request's blocks from the first stale block on (unless another session still uses them) are
  evicted before any other cached block;
- ``lifecycle``: ``lru_release`` plus the session's state: when a request ends its burst
  (``finish == "stop"``: the session waits for its user), its blocks (those no other session
  holds, as the plugin's ``SessionBlocks.select_idle``) go to an IDLE segment, evicted after
  the released blocks and before the live LRU ones, when the plugin's idle guard finds the
  session's last absence outlasted LRU's reach (``vllm_affinity/core/idle_guard.py``, on the
  same clock: cached blocks evicted); a session inside a tool call
  (``tool_calls``) keeps its blocks in LRU; a session the agent ended (``finish == "end"``,
  ``jiuwen_hooks.end_session``) is released whole;
- ``belady``: evict the cached block whose next use is farthest in the future (deeper blocks
  first on ties, so the cache stays prefix-closed: a child is never used before its parent).

Two oracles measure what ``lifecycle`` misses against Belady (neither can run for real: each
knows the future):

- ``lifecycle+early``: a session's blocks that its *next* call will not use are released as
  soon as its current call ends, not when the next call arrives (the compaction known one tool
  call ahead);
- ``lifecycle+order``: the IDLE segment evicts the blocks of the idle session that returns
  last first (who comes back first, known);
- ``lifecycle+both``: the two together.

Candidates on signals a server has, for the tight pools where ``lifecycle`` is furthest
from Belady (``benchmarks/lifecycle/belady_gap.py`` compares them; ``docs/decisions.md``):

- ``lifecycle+loop``: a call that ends in a tool call also idles its session, behind an idle
  guard of its own (its absences are tool calls, not users): the session whose tool loop
  outlasts LRU's reach gives its blocks up first (the API server would have to say "tool call");
- ``lifecycle+reach``: the same on every call end, tool call or answer, as the engine alone
  sees them (no signal from the API server);
- ``lifecycle+reuse``: the live (NORMAL) blocks are evicted by predicted return instead of LRU:
  a session is expected back its last absence (in calls) after its last call, an overdue one
  as long again as it has been away; a block shared by several sessions is due when the first
  of them is;
- ``lifecycle+return``: the same prediction in the shape an engine could run it
  (``vllm_affinity/core/returns.py``): only where LRU's victim is a block one session alone
  holds, a block of the session due back last (its own, tail first) goes instead;
  ``lifecycle+return`` does so only while a guard of bets against LRU's choice trusts it
  (``jiuwen_replay/returns.py``). Both idle a parent that waits on its subagents (a request's
  ``parent``) behind a wait guard of its own, as the plugin with its picker does, and put its
  blocks back with the live ones when its last subagent ends.

Requests are processed one at a time, as the benchmark replays them. Hits follow vLLM's rules:
the longest prefix of full blocks found in the cache, at most ``(prompt_tokens - 1) // block``
blocks (the last token is always computed). Physical blocks are modelled, so a recomputed block
whose hash is still cached elsewhere takes a second block, as in vLLM.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_affinity.core import common_prefix_length
from vllm_affinity.core.idle_guard import IdleGuard
from vllm_affinity.core.returns import ReturnPredictor, swap_for

from .returns import ReturnBets

POLICIES = ("infinite", "lru", "lru_release", "lifecycle", "belady")
ORACLES = ("lifecycle+early", "lifecycle+order", "lifecycle+both")
#: Candidates on signals a server has (no oracle): see the module's docstring.
PREDICTORS = (
    "lifecycle+loop",
    "lifecycle+reach",
    "lifecycle+reuse",
    "lifecycle+return",
    "lifecycle+return-unguarded",
)
_RETURN = ("lifecycle+return", "lifecycle+return-unguarded")
#: The policies that release a session's stale blocks when its window is rewritten.
RELEASING = ("lru_release", "lifecycle", *ORACLES, *PREDICTORS)
_LIFECYCLE = ("lifecycle", *ORACLES, *PREDICTORS)
_LOOP = ("lifecycle+loop", "lifecycle+reach")
_EARLY = ("lifecycle+early", "lifecycle+both")
_ORDERED_IDLE = ("lifecycle+order", "lifecycle+both")


@dataclass(frozen=True)
class Request:
    session: str
    tokens: tuple[int, ...]
    #: ``tool_calls`` (the session returns after its tool), ``stop`` (it waits for a user) or
    #: ``end`` (the agent ended the session: it never returns).
    finish: str = "tool_calls"
    #: Seconds from the start of the trace (timed traces).
    at: float = 0.0
    #: The agent's ``X-KV-Next-Use`` hint, seconds (the idle guard weighs it), if it sent one.
    next_use: float | None = None
    #: The session that started this one (a subagent's parent), where the client named it.
    parent: str | None = None
    #: The answer's tokens, where the trace says them (its full blocks are cached after the
    #: call, as vLLM caches sampled tokens; else ``generated`` uncached tokens stand for it).
    answer: tuple[int, ...] = ()


def block_hashes(tokens: Sequence[int], block: int) -> list[int]:
    out, parent = [], 0
    for i in range(len(tokens) // block):
        parent = hash((parent, tuple(tokens[i * block : (i + 1) * block])))
        out.append(parent)
    return out


class CapacityError(RuntimeError):
    pass


class _Cache:
    def __init__(
        self, capacity: int, policy: str, hashes: list[list[int]], block: int, idle_guard: bool
    ) -> None:
        self.capacity, self.policy, self.block = capacity, policy, block
        self.free = capacity
        self.hash_of: dict[int, int] = {}
        self.depth_of: dict[int, int] = {}
        self.by_hash: dict[int, set[int]] = {}
        self.order: OrderedDict[int, None] = OrderedDict()
        self.released: OrderedDict[int, None] = OrderedDict()
        self.idle: OrderedDict[int, None] = OrderedDict()
        self.owners: dict[int, set[str]] = {}
        self.latest: dict[str, list[int]] = {}
        self.latest_set: dict[str, set[int]] = {}
        self.ids = itertools.count()
        self.now = 0
        self.evictions = 0  # cached blocks evicted so far: the idle guard's clock
        self.guard = IdleGuard() if idle_guard and policy in _LIFECYCLE else None
        self.loop_guard = IdleGuard() if policy in _LOOP else None
        self.last_call: dict[str, int] = {}  # lifecycle+reuse: each session's last call
        self.gap: dict[str, int] = {}  # and its last absence, in calls
        self.gap_prior = 1  # the last absence of any session
        self.returns = ReturnPredictor() if policy in _RETURN else None
        # with the picker: a parent waiting on its subagents idles behind a guard of its own
        self.wait_guard = IdleGuard() if policy in _RETURN else None
        self.running: dict[str, set[str]] = {}  # waiting parent → its running children
        self.parent_of: dict[str, str] = {}  # running child → its parent
        self.bets = ReturnBets() if policy == "lifecycle+return" else None
        self.uses: dict[int, list[int]] = {}
        #: Belady's victims at full size: a lazy max-heap of (next use, depth, LRU place) per
        #: queued block (an entry is current while its block's ``placed`` matches and its next
        #: use has not passed); the same victim as the max over ``order``, in O(log n).
        self.farthest: list[tuple[int, int, int, int]] = []
        self.placed: dict[int, int] = {}
        self.places = itertools.count()
        if policy == "belady" or policy in _ORDERED_IDLE:
            for index, request_hashes in enumerate(hashes):
                for h in request_hashes:
                    self.uses.setdefault(h, []).append(index)

    def _rank(self, b: int) -> None:
        """Belady: (re)file a queued block under its next use from now."""
        entry = (-self._next_use(self.hash_of[b]), -self.depth_of[b], self.placed[b], b)
        heapq.heappush(self.farthest, entry)

    def _farthest(self) -> int:
        """Belady's victim: the queued block used farthest ahead, the deepest, then the
        least recently queued (the max over ``order`` by (next use, depth), first in LRU)."""
        while True:
            nxt, _, place, b = heapq.heappop(self.farthest)
            if self.placed.get(b) == place and b in self.order:
                if -nxt == self._next_use(self.hash_of[b]):
                    return b
                self._rank(b)  # its next use passed unhit (a broken prefix): refile it

    def _next_use(self, h: int) -> int:
        uses = self.uses.get(h, ())
        lo, hi = 0, len(uses)
        while lo < hi:  # first use strictly after now
            mid = (lo + hi) // 2
            if uses[mid] <= self.now:
                lo = mid + 1
            else:
                hi = mid
        return uses[lo] if lo < len(uses) else 1 << 60

    def _predicted(self, b: int) -> float:
        """When a block's sessions are expected back: each one's last call plus its last
        absence (in calls), the soonest of its sessions."""
        best = 1 << 60
        for s in self.owners.get(b, ()):
            last = self.last_call.get(s, 0)
            gap = self.gap.get(s, self.gap_prior)
            due = last + gap
            if due < self.now:  # overdue: expect as long again
                due = self.now + (self.now - last)
            best = min(best, due)
        return best

    def _sole(self, b: int) -> str | None:
        owners = self.owners.get(b)
        return next(iter(owners)) if owners is not None and len(owners) == 1 else None

    def _own_tail(self, session: str) -> int | None:
        """The session's deepest queued block that it alone holds."""
        for b in reversed(self.latest.get(session, [])):
            if b in self.order and self._sole(b) == session:
                return b
        return None

    def _back_last_or_lru(self) -> int:
        """lifecycle+return, as the plugin's picker (``PoolAffinity.pick``): where LRU's victim
        is a block one session alone holds, the deepest own block of the session predicted
        back last instead, if that is later than the victim's session (and, for the guarded
        form, while the bets trust it: ``jiuwen_replay/returns.py``)."""
        assert self.returns is not None
        head = next(iter(self.order))
        spared = self._sole(head)
        if spared is None or head not in self.latest_set[spared]:
            return head  # shared, or no session's latest request holds it: LRU's (as the plugin)
        spared_due = self.returns.due(spared)
        for chosen in self.returns.back_last_first():
            if not swap_for(self.returns.due(chosen), spared_due):
                return head
            victim = self._own_tail(chosen)
            if victim is None:
                continue
            if self.bets is None:
                return victim
            trusted = self.bets.trusted()
            self.bets.bet(chosen, spared)
            return victim if trusted else head
        return head

    def _evict_one(self) -> None:
        if self.released:
            victim, _ = self.released.popitem(last=False)
        elif self.idle and self.policy in _ORDERED_IDLE:
            victim = max(
                self.idle, key=lambda b: (self._next_use(self.hash_of[b]), self.depth_of[b])
            )
            del self.idle[victim]
        elif self.idle:
            victim, _ = self.idle.popitem(last=False)
        elif not self.order:
            raise CapacityError("the pool cannot hold one request")
        elif self.returns is not None:
            victim = self._back_last_or_lru()
            del self.order[victim]
        elif self.policy == "lifecycle+reuse":
            victim = max(self.order, key=lambda b: (self._predicted(b), self.depth_of[b]))
            del self.order[victim]
        elif self.policy == "belady":
            victim = self._farthest()
            del self.order[victim]
        else:
            victim, _ = self.order.popitem(last=False)
        self.evictions += 1
        h = self.hash_of.pop(victim)
        self.depth_of.pop(victim)
        self.placed.pop(victim, None)
        self.by_hash[h].discard(victim)
        if not self.by_hash[h]:
            del self.by_hash[h]
        self.owners.pop(victim, None)
        self.free += 1

    def release(self, session: str, first_block: int) -> None:
        for b in self.latest.get(session, [])[first_block:]:
            owners = self.owners.get(b)
            if owners is None or session not in owners:
                continue
            owners.discard(session)
            if not owners and (b in self.order or b in self.idle):
                self.order.pop(b, None)
                self.idle.pop(b, None)
                self.released[b] = None

    def finished(self, session: str, finish: str, next_use: float | None = None) -> None:
        """The lifecycle policy's signal: how the session's request ended (and its hint)."""
        if self.policy not in _LIFECYCLE:
            return
        if finish == "end" and session in self.parent_of:
            self._child_ended(session)
        if finish == "end":
            self.release(session, 0)
        elif self.policy == "lifecycle+reach":  # every end, as the engine sees it
            self.idle_session(session, self.loop_guard)
            if finish == "stop":
                self.idle_session(session, self.guard, next_use)
        elif finish == "stop":
            self.idle_session(session, self.guard, next_use)
        elif self.loop_guard is not None:
            self.idle_session(session, self.loop_guard)

    def idle_session(
        self, session: str, guard: IdleGuard | None, next_use: float | None = None
    ) -> None:
        """As the plugin does: the session's blocks that no other session holds, tail first,
        when the idle guard finds it worth it (``vllm_affinity/core/idle_guard.py``)."""
        if guard is not None:
            worth = guard.worth_idling(session, next_use)
            cached = len(self.order) + len(self.idle) + len(self.released)
            guard.went_idle(session, self.evictions, cached, next_use)
            if not worth:
                return
        for b in reversed(self.latest.get(session, [])):  # the tail goes first, as in LRU
            if b in self.order and self.owners.get(b) == {session}:
                del self.order[b]
                self.idle[b] = None

    def _family_call(self, session: str, parent: str | None) -> None:
        """As the plugin's ``Subagents``: a parent's call ends its wait; a child's first call
        starts its parent's, whose blocks go to IDLE when its wait guard finds it worth it
        (``Families._idle_waiting``)."""
        for child in self.running.pop(session, ()):
            self.parent_of.pop(child, None)
        if parent is None or parent == session or session in self.parent_of:
            return
        self.parent_of[session] = parent
        first = parent not in self.running
        self.running.setdefault(parent, set()).add(session)
        if first and not (self.returns is not None and self.returns.hinted(parent)):
            self.idle_session(parent, self.wait_guard)

    def _child_ended(self, child: str) -> None:
        """A subagent ended its task: when it was its parent's last, the parent is due now,
        and its idle blocks go back to the most-recently-used end of the live ones
        (``Families._unprotect``)."""
        parent = self.parent_of.pop(child)
        children = self.running.get(parent, set())
        children.discard(child)
        if children:
            return
        self.running.pop(parent, None)
        for b in self.latest.get(parent, []):
            if b in self.idle:
                del self.idle[b]
                self.order[b] = None

    def request(
        self,
        session: str,
        hashes: list[int],
        tokens: int,
        generated: int,
        next_use: float | None = None,
        parent: str | None = None,
    ) -> int:
        """Serve one request (``next_use``: its hint; ``parent``: the session that started
        it); returns the number of prompt tokens hit."""
        for guard in (self.guard, self.loop_guard, self.wait_guard):
            if guard is not None:
                guard.came_back(session, self.evictions)
        if self.wait_guard is not None:
            self._family_call(session, parent)
        if self.returns is not None:
            self.returns.called(session, next_use)
        if self.bets is not None:
            self.bets.called(session)
        if self.policy == "belady":  # this call is a use of its hashes: their next one moves on
            for h in hashes:
                for b in self.by_hash.get(h, ()):
                    if b in self.order:
                        self._rank(b)
        used: list[int] = []
        for h in hashes[: (tokens - 1) // self.block]:
            copies = self.by_hash.get(h)
            if not copies:
                break
            used.append(next(iter(copies)))
        for b in used:  # in use now: not evictable
            self.order.pop(b, None)
            self.released.pop(b, None)
            self.idle.pop(b, None)
        need = -(-(tokens + generated) // self.block) - len(used)
        if need > self.capacity - len(used):
            raise CapacityError(
                f"a request needs {need + len(used)} blocks, pool has {self.capacity}"
            )
        while self.free < need:
            self._evict_one()
        self.free -= need
        full = hashes[len(used) :]
        new_cached = []
        for depth, h in enumerate(full, start=len(used)):
            b = next(self.ids)
            self.hash_of[b], self.depth_of[b] = h, depth
            self.by_hash.setdefault(h, set()).add(b)
            new_cached.append(b)
        self.free += need - len(new_cached)  # partial tail and generated tokens: uncached
        blocks = used + new_cached
        for b in reversed(blocks):  # vLLM frees a request tail first
            self.order[b] = None
            if self.policy == "belady":
                self.placed[b] = next(self.places)
                self._rank(b)
        for b in blocks:
            self.owners.setdefault(b, set()).add(session)
        self.latest[session] = blocks
        self.latest_set[session] = set(blocks)
        if session in self.last_call:
            self.gap[session] = self.gap_prior = self.now - self.last_call[session]
        self.last_call[session] = self.now
        self.now += 1
        return len(used) * self.block


def simulate(
    requests: Sequence[Request],
    capacity: int,
    policy: str,
    block: int = 32,
    generated: int = 4,
    idle_guard: bool = True,
) -> dict[str, float]:
    """Hit rate of ``requests`` under ``policy`` with a pool of ``capacity`` blocks
    (``idle_guard``: the lifecycle policies act on an idle only when the plugin's guard would,
    as shipped; ``VLLM_AFFINITY_IDLE_GUARD``)."""
    hits = hits_per_request(requests, capacity, policy, block, generated, idle_guard)
    hit, queries = sum(hits), sum(len(r.tokens) for r in requests)
    return {"hit_tokens": hit, "query_tokens": queries, "hit_rate": hit / queries if queries else 0}


def hits_per_request(
    requests: Sequence[Request],
    capacity: int,
    policy: str,
    block: int = 32,
    generated: int = 4,
    idle_guard: bool = True,
) -> list[int]:
    """Prompt tokens each request hits under ``policy`` (``simulate``'s arguments): what
    ``jiuwen_replay.gap`` compares call by call between two policies."""
    known = POLICIES + ORACLES + PREDICTORS
    if policy not in known:
        raise ValueError(f"unknown policy {policy!r}; expected one of {known}")
    hashes = [block_hashes(r.tokens + r.answer, block) for r in requests]
    capacity = 1 << 40 if policy == "infinite" else capacity
    cache = _Cache(capacity, policy, hashes, block, idle_guard)
    previous: dict[str, tuple[int, ...]] = {}
    following: dict[int, int] = {}  # index → the same session's next request (the oracle)
    last: dict[str, int] = {}
    for index, request in enumerate(requests):
        if request.session in last:
            following[last[request.session]] = index
        last[request.session] = index
    hits: list[int] = []
    for index, (request, request_hashes) in enumerate(zip(requests, hashes, strict=True)):
        before = previous.get(request.session)
        if policy in RELEASING and before is not None:
            stale = common_prefix_length(before, request.tokens)
            if stale < len(before):  # rewritten, not appended: release the stale tail
                cache.release(request.session, stale // block)
        served = cache.request(
            request.session,
            request_hashes,
            len(request.tokens),
            len(request.answer) or generated,
            request.next_use,
            request.parent,
        )
        hits.append(served)
        cache.finished(request.session, request.finish, request.next_use)
        if policy in _EARLY and index in following:
            upcoming = requests[following[index]].tokens
            stale = common_prefix_length(request.tokens, upcoming)
            if stale < len(request.tokens):
                cache.release(request.session, stale // block)
        previous[request.session] = request.tokens
    return hits


def working_set(requests: Sequence[Request], block: int = 32) -> int:
    """Peak number of distinct blocks in the sessions' latest prompts (shared blocks once)."""
    latest: dict[str, set[int]] = {}
    peak = 0
    for request in requests:
        latest[request.session] = set(block_hashes(request.tokens, block))
        peak = max(peak, len(set().union(*latest.values())))
    return peak


def gap_closed(results: dict[str, dict[str, float]], policy: str = "lru_release") -> float | None:
    """Share of the LRU → Belady hit-rate gap that ``policy`` closes."""
    lru, rel, opt = (results[p]["hit_rate"] for p in ("lru", policy, "belady"))
    return (rel - lru) / (opt - lru) if opt > lru else None
