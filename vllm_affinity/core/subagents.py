"""Pure core: which parent sessions wait on running subagents (no vLLM import).

A coding agent's lead hands a task to subagents and waits: its whole context is needed again
the moment they answer, while every other session's cache competes with it for the pool. The
engine protects a waiting parent's blocks (the queue's PROTECTED segment, reused after every
other cached block) from its first running child's first call until its last child ends its
task or the parent calls again, whichever comes first.

A child is *running* from its first call until a call of it ends its task (``stop`` /
``end_turn``); a child that never says so (it crashed, its client left) is dropped when its
parent calls again. Both tables are bounded: at most ``max_children`` children are tracked,
least recently started first out.

Each running child also keeps how many of its leading tokens its end must keep (its
instructions, system prompt and tools, which the agent's next subagents send again), and the
family its siblings' shared start is learned under (``core/siblings.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class FamilyChange:
    """What a call changed for its family: the parent to protect or to let go of, if any."""

    protect: str | None = None  # this parent just got its first running child
    unprotect: tuple[str, ...] = ()  # these parents have no running child any more


@dataclass(slots=True)
class Subagents:
    """Running children per parent, bounded."""

    max_children: int = 100_000
    _parent_of: OrderedDict[str, str] = field(default_factory=OrderedDict)  # child → parent
    _children: dict[str, set[str]] = field(default_factory=dict)  # parent → running children
    _head_of: dict[str, int] = field(default_factory=dict)  # child → its instructions' tokens
    _family_of: dict[str, Hashable] = field(default_factory=dict)  # child → its siblings' key

    def __post_init__(self) -> None:
        if self.max_children < 1:
            raise ValueError("max_children must be at least 1")

    def __len__(self) -> int:
        return len(self._parent_of)

    def parent_of(self, child: str) -> str | None:
        return self._parent_of.get(child)

    def head_of(self, child: str) -> int:
        """Leading tokens of a running child that are its instructions (0: unknown)."""
        return self._head_of.get(child, 0)

    def family_of(self, child: str) -> Hashable | None:
        """The key its siblings' shared start is learned under (``None``: not known)."""
        return self._family_of.get(child)

    def waiting(self, parent: str) -> bool:
        """Whether ``parent`` has running children (its blocks are protected)."""
        return parent in self._children

    def call(
        self, session: str, parent: str | None, head: int = 0, family: Hashable | None = None
    ) -> FamilyChange:
        """A call of ``session`` (naming its ``parent``, if it has one, its instructions'
        length in tokens and its siblings' family, if known) entered the engine."""
        unprotect = list(self._parent_back(session))
        if not parent or parent == session:
            return FamilyChange(unprotect=tuple(unprotect))
        known = self._parent_of.get(session)
        if known is not None and known != parent:
            unprotect += self.ended(session).unprotect  # the same name under another parent
        self._parent_of[session] = parent
        self._parent_of.move_to_end(session)
        if head > self._head_of.get(session, 0):
            self._head_of[session] = head
        if family is not None:
            self._family_of.setdefault(session, family)
        children = self._children.setdefault(parent, set())
        first = not children
        children.add(session)
        while len(self._parent_of) > self.max_children:  # the oldest child cannot be this one
            unprotect += self.ended(next(iter(self._parent_of))).unprotect
        return FamilyChange(protect=parent if first else None, unprotect=tuple(unprotect))

    def ended(self, child: str) -> FamilyChange:
        """``child`` ended its task; its parent is let go of when it was the last one."""
        parent = self._parent_of.pop(child, None)
        self._head_of.pop(child, None)
        self._family_of.pop(child, None)
        if parent is None:
            return FamilyChange()
        children = self._children.get(parent)
        if children is not None:
            children.discard(child)
            if not children:
                del self._children[parent]
                return FamilyChange(unprotect=(parent,))
        return FamilyChange()

    def _parent_back(self, parent: str) -> tuple[str, ...]:
        """The parent called again: its children's results are in; stop protecting it."""
        children = self._children.pop(parent, None)
        if children is None:
            return ()
        for child in children:
            self._parent_of.pop(child, None)
            self._head_of.pop(child, None)
            self._family_of.pop(child, None)
        return (parent,)

    def check(self) -> list[str]:
        """Invariant violations (empty when consistent)."""
        problems: list[str] = []
        listed = {c: p for p, cs in self._children.items() for c in cs}
        if listed != dict(self._parent_of):
            problems.append(f"children {listed} != parents {dict(self._parent_of)}")
        if any(not cs for cs in self._children.values()):
            problems.append("a parent with no running child is still waiting")
        if not self._head_of.keys() <= self._parent_of.keys():
            problems.append("an instruction length is kept for a child that is not running")
        if not self._family_of.keys() <= self._parent_of.keys():
            problems.append("a family is kept for a child that is not running")
        if len(self._parent_of) > self.max_children:
            problems.append(f"{len(self._parent_of)} children over {self.max_children}")
        return problems
