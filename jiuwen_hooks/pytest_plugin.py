"""pytest plugin (entry point ``pytest11``): fixtures for testing agents that use the hook.

- ``jiuwen_engine``: a started ``LocalEngine`` (real loopback HTTP server recording releases).
- ``jiuwen_telemetry``: a ``TelemetryCapture`` (in-memory span exporter and metric reader).
- ``jiuwen_hook_factory``: ``install(**options)`` for tests that choose their options (or
  install mid-test): the capture's providers unless given; uninstalled after, failed or not.
- ``jiuwen_hook_options``: options for ``jiuwen_hook``; a test sets them by indirect
  parametrisation (``@pytest.mark.parametrize("jiuwen_hook_options", [{...}])``).
- ``jiuwen_hook``: the factory's hook with ``jiuwen_hook_options``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine, TelemetryCapture


@pytest.fixture
def jiuwen_engine() -> Iterator[LocalEngine]:
    with LocalEngine() as engine:
        yield engine


@pytest.fixture
def jiuwen_telemetry() -> Iterator[TelemetryCapture]:
    capture = TelemetryCapture()
    yield capture
    capture.shutdown()


@pytest.fixture
def jiuwen_hook_options() -> dict[str, Any]:
    return {}


@pytest.fixture
def jiuwen_hook_factory(
    jiuwen_telemetry: TelemetryCapture,
) -> Iterator[Callable[..., jiuwen_hooks.Hook]]:
    def install(**options: Any) -> jiuwen_hooks.Hook:
        jiuwen_hooks.uninstall()  # one hook per process: the test's last install wins
        options.setdefault("tracer_provider", jiuwen_telemetry.tracer_provider)
        options.setdefault("meter_provider", jiuwen_telemetry.meter_provider)
        return jiuwen_hooks.install(**options)

    yield install
    jiuwen_hooks.uninstall()


@pytest.fixture
def jiuwen_hook(
    jiuwen_hook_factory: Callable[..., jiuwen_hooks.Hook], jiuwen_hook_options: dict[str, Any]
) -> jiuwen_hooks.Hook:
    return jiuwen_hook_factory(**jiuwen_hook_options)
