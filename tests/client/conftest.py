"""Fixtures the router tests share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from jiuwen_hooks.testing import LocalEngine


@pytest.fixture
def engines() -> Iterator[list[LocalEngine]]:
    """Three recording servers (advertising in-request releases), stopped afterwards."""
    started = [LocalEngine(in_request=True).start() for _ in range(3)]
    yield started
    for engine in started:
        with contextlib.suppress(OSError):
            engine.stop()
