"""``install()`` / ``uninstall()``: idempotent, symmetric, and exact about what they restore."""

from __future__ import annotations

import inspect
from typing import Any

from . import _state
from ._compressor import compressor_wrapper, parse_dotted
from ._hook import Hook
from ._options import Options
from ._patch import CHAT_METHODS, CHAT_MODULE, Patches, async_chat_wrapper, chat_wrapper, resolve
from ._telemetry import logger
from ._version import __version__


def install(**options: Any) -> Hook:
    """Patch the openai client (and any compressors named in ``compressors``) process-wide.

    Options are keyword arguments or ``JIUWEN_*`` environment variables (see the README).
    Calling it again returns the hook already installed. With ``enabled=False`` nothing is patched.
    """
    with _state.lock:
        current = _state.installed()
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
        patches = Patches()
        try:
            for path in CHAT_METHODS:
                if path.startswith("Async"):
                    wrapper = async_chat_wrapper(hook.before_call, hook.asettle)
                else:
                    wrapper = chat_wrapper(hook.before_call, hook.settle)
                patches.wrap(CHAT_MODULE, path, wrapper)
            for dotted in hook.options.compressors:
                module, attribute = parse_dotted(dotted)
                found = resolve(module, attribute)
                if found is None:
                    raise ValueError(f"jiuwen_hooks: compressor {dotted!r} not found")
                is_async = inspect.iscoroutinefunction(found[2])
                patches.wrap(module, attribute, compressor_wrapper(attribute, is_async))
        except BaseException:
            patches.remove_all()
            hook.close()
            raise
        hook.patches = patches
        _state.set_installed(hook)
        return hook


def uninstall() -> None:
    """Remove every patch ``install()`` made, flush background releases, close HTTP clients."""
    with _state.lock:
        hook = _state.installed()
        if hook is None:
            return
        _state.set_installed(None)
        if hook.patches is not None:
            hook.patches.remove_all()
        hook.close()


def stats() -> dict[str, int]:
    """A snapshot of the installed hook's counters (empty when not installed)."""
    hook = _state.installed()
    return hook.stats() if hook is not None else {}
