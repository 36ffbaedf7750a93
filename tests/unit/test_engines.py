"""The pure engine directory: what the hook learns per engine root, with an injected clock."""

from __future__ import annotations

from jiuwen_hooks._engines import EngineDirectory, EngineState, state_from_capabilities

ROOT = "http://engine:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def directory(clock: Clock) -> EngineDirectory:
    return EngineDirectory(ttl=300, unsupported_ttl=60, clock=clock)


def test_unknown_until_told() -> None:
    d = directory(Clock())
    assert d.state(ROOT) is EngineState.UNKNOWN
    assert d.snapshot() == {}


def test_capabilities_decide_the_path() -> None:
    assert state_from_capabilities({"in_request_release": True}) is EngineState.IN_REQUEST
    assert state_from_capabilities({"in_request_release": "yes"}) is EngineState.POST
    # an openJiuwen 0.1.16 POST-contract server advertises nothing
    assert state_from_capabilities(None) is EngineState.POST


def test_probe_is_claimed_once_per_ttl() -> None:
    clock = Clock()
    d = directory(clock)
    assert d.claim_probe(ROOT)
    assert not d.claim_probe(ROOT)  # in flight
    d.probe_answered(ROOT, EngineState.IN_REQUEST)
    assert d.state(ROOT) is EngineState.IN_REQUEST
    clock.now += 299
    assert not d.claim_probe(ROOT)
    clock.now += 2
    assert d.claim_probe(ROOT)


def test_a_probe_that_learned_nothing_is_retried_soon_backing_off() -> None:
    """A probe timing out on a busy server must not leave every release on POST for ``ttl``:
    it is retried after 1 s, then 2, 4, ... up to ``ttl``; any answer resets the back-off."""
    clock = Clock()
    d = directory(clock)

    def next_probe_after_a_failure() -> float:
        d.probe_answered(ROOT, None)  # timed out, 5xx, 401: nothing learned
        failed_at = clock.now
        while not d.claim_probe(ROOT):
            clock.now += 0.5
        return clock.now - failed_at

    assert d.claim_probe(ROOT)
    delays = [next_probe_after_a_failure() for _ in range(11)]
    assert delays == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]
    assert d.state(ROOT) is EngineState.UNKNOWN
    d.probe_answered(ROOT, EngineState.IN_REQUEST)
    clock.now += 299.5
    assert not d.claim_probe(ROOT)  # an answer: the full ttl
    clock.now += 0.5
    assert d.claim_probe(ROOT)
    assert next_probe_after_a_failure() == 1  # the back-off starts over
    assert d.state(ROOT) is EngineState.IN_REQUEST  # and a failure changes no state


def test_missing_route_withdraws_only_the_in_request_state() -> None:
    d = directory(Clock())
    d.probe_answered(ROOT, EngineState.IN_REQUEST)
    d.probe_answered(ROOT, None, route_missing=False)  # a network error: nothing learned
    assert d.state(ROOT) is EngineState.IN_REQUEST
    d.probe_answered(ROOT, None, route_missing=True)
    assert d.state(ROOT) is EngineState.UNKNOWN
    d.learn(ROOT, EngineState.POST)  # an openJiuwen 0.1.16 POST-contract server answered
    d.probe_answered(ROOT, None, route_missing=True)  # and has no capabilities route
    assert d.state(ROOT) is EngineState.POST


def test_unsupported_cools_down_and_a_late_probe_does_not_extend_it() -> None:
    clock = Clock()
    d = directory(clock)
    assert d.claim_probe(ROOT)
    assert d.learn(ROOT, EngineState.UNSUPPORTED) is EngineState.UNKNOWN
    d.probe_answered(ROOT, None, route_missing=True)  # the probe answers after the POST
    assert d.cooling_down(ROOT)
    clock.now += 61
    assert not d.cooling_down(ROOT)  # a POST may be tried again
    assert d.state(ROOT) is EngineState.UNSUPPORTED
