"""Framework integration tests: real framework packages (the ``frameworks`` extra) against the
recording ``LocalEngine``. Each test checks the release against what the framework actually put
on the wire, computed here independently of the hook's own diff."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine


@pytest.fixture
def engine() -> Iterator[LocalEngine]:
    jiuwen_hooks.uninstall()
    with LocalEngine() as local:
        jiuwen_hooks.install()
        yield local
        jiuwen_hooks.uninstall()
