"""The process-wide installed hook (install/uninstall symmetry lives in ``jiuwen_hooks``).

The modules the hook's wrappers live in (``_context``, ``_compressor``) reach the installed hook
through here, by what they call on it (``InstalledHook``), so none of them imports ``_hook``:
imports in the package only go down, from ``_install`` and ``_hook`` to the modules they use."""

from __future__ import annotations

import threading
from typing import Any, Protocol


class InstalledHook(Protocol):
    """What the package's modules call on the installed ``Hook``."""

    def after_compress(self, label: str, messages_in: Any, result: Any) -> None: ...

    def end_session(self, session_id: str) -> None: ...

    def uninstall(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


lock = threading.RLock()
_installed: InstalledHook | None = None


def installed() -> InstalledHook | None:
    return _installed


def set_installed(hook: InstalledHook | None) -> None:
    global _installed
    _installed = hook
