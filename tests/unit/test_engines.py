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
    assert state_from_capabilities(None) is EngineState.POST  # seed-contract server


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


def test_missing_route_withdraws_only_the_in_request_state() -> None:
    d = directory(Clock())
    d.probe_answered(ROOT, EngineState.IN_REQUEST)
    d.probe_answered(ROOT, None, route_missing=False)  # a network error: nothing learned
    assert d.state(ROOT) is EngineState.IN_REQUEST
    d.probe_answered(ROOT, None, route_missing=True)
    assert d.state(ROOT) is EngineState.UNKNOWN
    d.learn(ROOT, EngineState.POST)  # a seed-contract server answered the POST
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
