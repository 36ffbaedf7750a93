"""openai adapter: wrapt patches of the chat-completion methods, with exact removal.

Patched on the classes, so clients created before ``install()`` are covered, and so are
``with_raw_response`` / ``with_streaming_response`` accessors created after it. A contextvar guard
makes nested patched calls (``parse`` → ``create`` in some SDK versions) pass straight through, so
one model call never releases twice.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import wrapt

from ._telemetry import logger

_in_call: ContextVar[bool] = ContextVar("jiuwen_hooks_in_call", default=False)

CHAT_MODULE = "openai.resources.chat.completions"
CHAT_METHODS = (
    "Completions.create",
    "Completions.parse",
    "AsyncCompletions.create",
    "AsyncCompletions.parse",
)

Wrapper = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]


def resolve(module: str, path: str) -> tuple[Any, str, Any] | None:
    """``(owner, attribute, current value)`` for ``module`` + dotted ``path``, or ``None``."""
    owner: Any = importlib.import_module(module)
    *parents, attribute = path.split(".")
    for name in parents:
        owner = getattr(owner, name, None)
        if owner is None:
            return None
    if inspect.isclass(owner):
        value = owner.__dict__.get(attribute)  # only methods the class defines itself
    else:
        value = getattr(owner, attribute, None)
    return (owner, attribute, value) if value is not None else None


class Patches:
    """The wrappers one ``install()`` put in place, removable in any order with others'."""

    def __init__(self) -> None:
        self._applied: list[tuple[Any, str, wrapt.FunctionWrapper]] = []

    def wrap(self, module: str, path: str, wrapper: Wrapper) -> bool:
        found = resolve(module, path)
        if found is None:
            return False
        owner, attribute, _ = found
        self._applied.append(
            (owner, attribute, wrapt.wrap_function_wrapper(owner, attribute, wrapper))
        )
        return True

    def remove_all(self) -> None:
        """Splice each wrapper out of its chain (wrapt's ``unwrap_object``), newest first."""
        while self._applied:
            owner, attribute, ours = self._applied.pop()
            try:
                removed = wrapt.unwrap_object(owner, attribute, ours, missing_ok=True)
            except wrapt.WrapperNotOutermostError:
                removed = None
            if removed is None:
                logger.warning(
                    "jiuwen_hooks: %s.%s was replaced by something that is not a wrapt wrapper; "
                    "left as it is",
                    getattr(owner, "__name__", owner),
                    attribute,
                )


def chat_wrapper(before: Callable[..., Any], settle: Callable[..., Any]) -> Wrapper:
    """Wrapper for the synchronous ``create``/``parse``: ``before`` prepares the call (session,
    diff, headers) and ``settle`` does what must precede it (a POST release, or waiting for a
    compressor's release on the wire); then the real call."""

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _in_call.get():
            return wrapped(*args, **kwargs)
        prepared = before(instance, kwargs)
        if prepared is None:
            return wrapped(*args, **kwargs)
        settle(prepared)
        token = _in_call.set(True)
        try:
            return wrapped(*args, **prepared.kwargs)
        finally:
            _in_call.reset(token)

    return wrapper


def async_chat_wrapper(before: Callable[..., Any], asettle: Callable[..., Any]) -> Wrapper:
    """Wrapper for ``AsyncCompletions.create``/``parse``: as ``chat_wrapper``, awaited."""

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _in_call.get():
            return wrapped(*args, **kwargs)

        async def call() -> Any:
            prepared = before(instance, kwargs)
            if prepared is None:
                return await wrapped(*args, **kwargs)
            await asettle(prepared)
            token = _in_call.set(True)
            try:
                return await wrapped(*args, **prepared.kwargs)
            finally:
                _in_call.reset(token)

        return call()

    return wrapper
