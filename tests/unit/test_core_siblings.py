"""The shared start of sibling subagents' first prompts (pure core)."""

from __future__ import annotations

import pytest

from vllm_affinity.core.siblings import SiblingStarts


def test_the_first_sibling_says_nothing_the_next_ones_narrow_the_start() -> None:
    starts = SiblingStarts()
    assert starts.observe("lead", ["i0", "i1", "c0", "c1", "t0"]) == 0
    assert starts.shared("lead") == 0  # one prompt alone: all of it would look shared
    assert starts.observe("lead", ["i0", "i1", "c0", "c1", "u0", "u1"]) == 4
    assert starts.observe("lead", ["i0", "i1", "c0", "x0"]) == 3
    assert starts.shared("lead") == 3
    assert starts.observe("lead", ["i0", "i1", "c0", "c1", "t0"]) == 3  # never widens again
    assert starts.shared("other") == 0


def test_families_and_prompts_are_bounded() -> None:
    starts = SiblingStarts(max_families=2, max_blocks=3)
    starts.observe("a", [1, 2, 3, 4, 5])
    assert starts.observe("a", [1, 2, 3, 4, 9]) == 3  # only the first 3 hashes are kept
    starts.observe("b", [7])
    starts.observe("c", [8])  # "a" is the least recently seen: out
    assert len(starts) == 2 and starts.shared("a") == 0
    with pytest.raises(ValueError):
        SiblingStarts(max_families=0)
