"""``install()`` / ``uninstall()``: the one-liners around the process's ``Hook``, idempotent and
symmetric (the hook owns its patches; see ``Hook.install``)."""

from __future__ import annotations

from typing import Any, cast

from . import _state
from ._hook import Hook
from ._options import Options
from ._telemetry import logger
from ._version import __version__


def install(**options: Any) -> Hook:
    """Patch the openai client (and any compressors named in ``compressors``) process-wide.

    Options are keyword arguments or ``JIUWEN_*`` environment variables (see the README).
    Calling it again returns the hook already installed. With ``enabled=False`` nothing is patched.
    """
    with _state.lock:
        current = installed()
        if current is not None:
            if options:
                logger.warning(
                    "jiuwen_hooks: already installed; new options ignored (uninstall first)"
                )
            return current
        hook = Hook(Options.resolve(options), __version__)
        if not hook.options.enabled:
            logger.info("jiuwen_hooks: disabled by option; nothing patched")
            return hook
        return hook.install()


def uninstall() -> None:
    """Remove every patch ``install()`` made, flush background releases, close HTTP clients."""
    with _state.lock:
        hook = _state.installed()
        if hook is not None:
            hook.uninstall()


def installed() -> Hook | None:
    """The hook ``install()`` put in place, or ``None``."""
    return cast("Hook | None", _state.installed())


def stats() -> dict[str, Any]:
    """A snapshot of the installed hook's counters (empty when not installed)."""
    hook = _state.installed()
    return hook.stats() if hook is not None else {}


def end_session(session_id: str) -> None:
    """The agent ended ``session_id`` for good: release its whole KV cache (the blocks other
    sessions share are kept) and forget it. Call it only when the session will not come back:
    many agents enter ``session()`` once per turn, so leaving that context is not an end.
    Does nothing when the hook is not installed or the session is unknown; never raises."""
    hook = _state.installed()
    if hook is not None:
        hook.end_session(session_id)
