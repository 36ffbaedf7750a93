"""The engine adapter on the real vLLM KVCacheManager under churn: any sequence of requests
(shared prefixes, parallel requests of one session), decoding, finishing, aborting, preemption
and resumption, releases, idle sessions and session-table eviction keeps every invariant of
``PoolAffinity.check`` (the one ``GET /affinity/check`` runs), and an idle pool ends clean."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from vllm_parts import BLOCK, bind_as_scheduled, make_manager, make_request, state_of

from vllm_affinity.engine import apply_engine_patches

apply_engine_patches()

SESSIONS = "abcde"
PREFIXES = [list(range(p * 1000, p * 1000 + 2 * BLOCK)) for p in range(3)]


class ChurnMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = make_manager(24)
        self.state = state_of(self.manager)
        self.state.sessions._max_sessions = 3  # eviction happens too
        self.running: list[Any] = []
        self.preempted: list[Any] = []
        self.serial = 0

    def _schedule(self, request: Any) -> bool:
        """Prefill as the scheduler would; False (nothing allocated) when the pool is full."""
        computed, num_computed = self.manager.get_computed_blocks(request)[:2]
        blocks = self.manager.allocate_slots(
            request, request.num_tokens - num_computed, num_computed, computed
        )
        if blocks is None:
            return False
        bind_as_scheduled(self.manager, request, blocks, first=True)
        request.num_computed_tokens = request.num_tokens
        self.manager.cache_blocks(request, request.num_tokens)
        return True

    @rule(
        session=st.sampled_from(SESSIONS),
        prefix=st.integers(0, 2),
        body=st.integers(0, 3 * BLOCK),
    )
    def new_request(self, session: str, prefix: int, body: int) -> None:
        self.serial += 1
        tokens = PREFIXES[prefix] + [50_000 + self.serial * 100 + i for i in range(body)]
        request = make_request(tokens, session=session)
        self.state.on_new_request(request, release_on_divergence=False)  # Scheduler.add_request
        if self._schedule(request):
            self.running.append(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), n=st.integers(1, BLOCK + 2))
    def decode(self, data: st.DataObject, n: int) -> None:
        request = data.draw(st.sampled_from(self.running))
        for _ in range(n):
            request.append_output_token_ids(7)
            blocks = self.manager.allocate_slots(request, 1)
            if blocks is None:  # the scheduler preempts it
                self._preempt(request)
                return
            bind_as_scheduled(self.manager, request, blocks, first=False)
            request.num_computed_tokens += 1
            self.manager.cache_blocks(request, request.num_computed_tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_or_abort(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.running))
        self.running.remove(request)
        self.manager.free(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self._preempt(data.draw(st.sampled_from(self.running)))

    def _preempt(self, request: Any) -> None:
        """What the scheduler does: free the blocks, recompute from scratch when resumed."""
        self.running.remove(request)
        self.manager.free(request)
        request.num_computed_tokens = 0
        self.preempted.append(request)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.preempted))
        if self._schedule(request):
            self.preempted.remove(request)
            self.running.append(request)

    @rule(session=st.sampled_from(SESSIONS + "z"), first=st.integers(0, 5))
    def release(self, session: str, first: int) -> None:
        self.state.release(session, first)

    @rule(session=st.sampled_from(SESSIONS + "z"))
    def idle(self, session: str) -> None:
        self.state.idle_session(session)

    @invariant()
    def consistent(self) -> None:
        assert self.state.check(idle=False) == []

    def teardown(self) -> None:
        for request in self.running:
            self.manager.free(request)
        assert self.state.check(idle=True) == []


TestChurn = ChurnMachine.TestCase
TestChurn.settings = settings(
    max_examples=int(os.environ.get("JIUWEN_CHURN_EXAMPLES", "150")),
    stateful_step_count=40,
    deadline=None,
)
