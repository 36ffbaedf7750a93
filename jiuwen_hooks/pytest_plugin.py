"""pytest plugin (entry point ``pytest11``): fixtures for testing agents that use the hook.

- ``jiuwen_engine``: a started ``LocalEngine`` (real loopback HTTP server recording releases).
- ``jiuwen_telemetry``: a ``TelemetryCapture`` (in-memory span exporter and metric reader).
- ``jiuwen_hook_options``: options for ``jiuwen_hook``; override it in a conftest to change them.
- ``jiuwen_hook``: ``jiuwen_hooks.install()`` with the capture's providers; uninstalled after.
"""

from __future__ import annotations

from collections.abc import Iterator
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
def jiuwen_hook(
    jiuwen_telemetry: TelemetryCapture, jiuwen_hook_options: dict[str, Any]
) -> Iterator[jiuwen_hooks.Hook]:
    jiuwen_hooks.uninstall()  # a leftover from a test that did not clean up
    hook = jiuwen_hooks.install(
        tracer_provider=jiuwen_telemetry.tracer_provider,
        meter_provider=jiuwen_telemetry.meter_provider,
        **jiuwen_hook_options,
    )
    yield hook
    jiuwen_hooks.uninstall()
