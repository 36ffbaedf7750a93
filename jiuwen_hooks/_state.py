"""The process-wide installed hook (install/uninstall symmetry lives in ``jiuwen_hooks``)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._hook import Hook

lock = threading.RLock()
_installed: Hook | None = None


def installed() -> Hook | None:
    return _installed


def set_installed(hook: Hook | None) -> None:
    global _installed
    _installed = hook
