"""wrapt patches with exact removal: each wrapper is spliced out of its chain on removal, so
wrappers stacked by other libraries (before or after ours) keep working."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import wrapt

from ._telemetry import logger

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
        self._applied: list[tuple[Any, str, Any]] = []  # (owner, name, wrapt.FunctionWrapper)

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
