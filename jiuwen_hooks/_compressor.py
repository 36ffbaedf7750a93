"""Compressor adapter: wraps user functions that rewrite a message list.

The wrapper looks the installed hook up at call time, so ``@compressor`` can decorate functions
at import time, before ``install()``; with no hook installed it is a plain pass-through. The
rewritten list may be returned, or the input list may be mutated in place (then the function
may return ``None`` or anything that is not a list).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar, overload

import wrapt

from . import _state

F = TypeVar("F", bound=Callable[..., Any])


def _messages_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs["messages"] if "messages" in kwargs else (args[0] if args else None)


def compressor_wrapper(label: str, is_async: bool) -> Callable[..., Any]:
    if is_async:

        def async_wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            async def call() -> Any:
                messages_in = _messages_argument(args, kwargs)
                result = await wrapped(*args, **kwargs)
                hook = _state.installed()
                if hook is not None:
                    hook.after_compress(label, messages_in, result)
                return result

            return call()

        return async_wrapper

    def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        messages_in = _messages_argument(args, kwargs)
        result = wrapped(*args, **kwargs)
        hook = _state.installed()
        if hook is not None:
            hook.after_compress(label, messages_in, result)
        return result

    return wrapper


def label_of(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


@overload
def compressor(func: F, *, name: str | None = None) -> F: ...
@overload
def compressor(func: None = None, *, name: str | None = None) -> Callable[[F], F]: ...


def compressor(func: Any = None, *, name: str | None = None) -> Any:
    """Mark a function that rewrites an agent's history (its first argument, or ``messages=``).

    Use bare (``@compressor``) or with a label (``@compressor(name="micro_compact")``); the label
    appears in the release span's reason as ``compressor:<name>``. Sync and async functions work.
    """
    if func is None:
        return lambda f: compressor(f, name=name)
    wrapper = compressor_wrapper(name or label_of(func), inspect.iscoroutinefunction(func))
    return wrapt.FunctionWrapper(func, wrapper)


def parse_dotted(path: str) -> tuple[str, str]:
    """``"pkg.mod:func"`` or ``"pkg.mod:Class.method"`` → (module, attribute path)."""
    module, sep, attribute = path.partition(":")
    if not sep or not module or not attribute:
        raise ValueError(
            f"jiuwen_hooks: compressor path {path!r} must look like 'package.module:function' "
            "or 'package.module:Class.method'"
        )
    return module, attribute
