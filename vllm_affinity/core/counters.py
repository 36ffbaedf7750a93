"""Pure core: the engine's counters, by declared name only (no vLLM import).

Counters cross the process boundary by name (``/affinity/stats``, ``/metrics``); a misspelt
name would count into a key nobody reads and export zeros. Here an undeclared name raises at
once, where it is counted.
"""

from __future__ import annotations

from collections.abc import Iterable


class Counters:
    """Integer counters over a fixed set of names, all starting at 0."""

    __slots__ = ("_values",)

    def __init__(self, names: Iterable[str]) -> None:
        self._values = dict.fromkeys(names, 0)

    def add(self, name: str, amount: int = 1) -> None:
        if name not in self._values:
            raise KeyError(f"undeclared counter {name!r}")
        self._values[name] += amount

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def as_dict(self) -> dict[str, int]:
        return dict(self._values)
