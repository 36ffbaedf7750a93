"""Which parents wait on running subagents (pure core)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from vllm_affinity.core.subagents import FamilyChange, Subagents


def test_a_parent_is_protected_from_its_first_child_to_its_last_end() -> None:
    family = Subagents()
    assert family.call("lead", None) == FamilyChange()
    assert family.call("sub-1", "lead") == FamilyChange(protect="lead")
    assert family.call("sub-2", "lead") == FamilyChange()  # already protected
    assert family.call("sub-1", "lead") == FamilyChange()  # its next call
    assert family.waiting("lead") and family.parent_of("sub-2") == "lead"
    assert family.ended("sub-1") == FamilyChange()
    assert family.ended("sub-2") == FamilyChange(unprotect=("lead",))
    assert not family.waiting("lead") and len(family) == 0
    assert family.ended("sub-2") == FamilyChange()  # told twice: nothing more


def test_the_parent_calling_again_drops_children_that_never_ended() -> None:
    family = Subagents()
    family.call("sub-1", "lead")
    assert family.call("lead", None) == FamilyChange(unprotect=("lead",))
    assert family.parent_of("sub-1") is None and family.check() == []


def test_a_child_moving_to_another_parent_lets_the_first_go() -> None:
    family = Subagents()
    family.call("sub", "a")
    assert family.call("sub", "b") == FamilyChange(protect="b", unprotect=("a",))


def test_bounded_least_recently_started_child_first_out() -> None:
    family = Subagents(max_children=2)
    family.call("x", "p")
    family.call("y", "q")
    assert family.call("z", "r") == FamilyChange(protect="r", unprotect=("p",))
    assert len(family) == 2 and family.check() == []


class FamilyMachine(RuleBasedStateMachine):
    """Any sequence of calls and ends keeps the two tables consistent, and every protect is
    matched by exactly one unprotect before the next protect of the same parent."""

    def __init__(self) -> None:
        super().__init__()
        self.family = Subagents(max_children=3)
        self.protected: set[str] = set()

    def _apply(self, change: FamilyChange) -> None:
        for parent in change.unprotect:
            assert parent in self.protected
            self.protected.discard(parent)
        if change.protect is not None:
            assert change.protect not in self.protected
            self.protected.add(change.protect)

    @rule(session=st.sampled_from("abcdef"), parent=st.sampled_from([None, *"abcdef"]))
    def call(self, session: str, parent: str | None) -> None:
        self._apply(self.family.call(session, parent))

    @rule(child=st.sampled_from("abcdef"))
    def ended(self, child: str) -> None:
        self._apply(self.family.ended(child))

    @invariant()
    def consistent(self) -> None:
        assert self.family.check() == []
        assert self.protected == {p for p in "abcdef" if self.family.waiting(p)}


TestFamilyMachine = FamilyMachine.TestCase
TestFamilyMachine.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


def test_a_childs_instruction_length_lives_while_it_runs() -> None:
    table = Subagents(max_children=2)
    table.call("a", "lead", head=3)
    table.call("a", "lead")  # a later call that did not say: the length stays
    table.call("b", "lead", head=5)
    assert (table.head_of("a"), table.head_of("b"), table.head_of("lead")) == (3, 5, 0)
    table.ended("a")
    assert table.head_of("a") == 0 and table.check() == []
    table.call("c", "lead2", head=1)
    table.call("d", "lead2", head=1)  # over the bound: b, the oldest, goes with its length
    assert table.head_of("b") == 0 and table.check() == []
    table.call("lead2", None)  # the parent called again: its children are gone
    assert table.head_of("c") == table.head_of("d") == 0 and table.check() == []
