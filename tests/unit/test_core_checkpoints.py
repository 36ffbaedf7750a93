"""Where a hybrid model keeps an agent's instructions (pure core)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from vllm_affinity.core.checkpoints import Checkpoints, checkpoint_position, junction


@dataclass(eq=False)
class FakeBlock:
    block_id: int
    block_hash: Any = None


def test_the_instructions_end_floored_to_the_hit_granularity() -> None:
    assert checkpoint_position(519, 32, 0, 900) == 512
    assert checkpoint_position(619, 160, 0, 900) == 480
    assert checkpoint_position(640, 160, 160, 900) == 640


def test_no_checkpoint_where_nothing_is_computed_across_it() -> None:
    # the hit already reaches it (a later turn, or a hit of the checkpoint itself)
    assert checkpoint_position(519, 32, 512, 900) == 0
    assert checkpoint_position(519, 32, 800, 900) == 0
    # the prompt ends there or before: vLLM keeps a prompt's end anyway
    assert checkpoint_position(519, 32, 0, 512) == 0
    assert checkpoint_position(519, 32, 0, 300) == 0
    # instructions shorter than one block: no state to keep
    assert checkpoint_position(20, 32, 0, 900) == 0


def test_a_bad_alignment_is_refused() -> None:
    with pytest.raises(ValueError, match="alignment"):
        checkpoint_position(519, 0, 0, 900)


def test_the_later_junction_wins() -> None:
    """vLLM's junction is often a chat template's opening every request shares: the
    instructions' end covers more. A longer shared prefix vLLM found covers more still."""
    assert junction(64, 512) == 512
    assert junction(768, 512) == 768
    assert junction(0, 0) == 0


def test_checkpoints_are_valid_while_their_blocks_keep_their_hashes() -> None:
    blocks = [FakeBlock(1, "a"), FakeBlock(2, "b")]
    known = Checkpoints(max_entries=4)
    assert known.blocks("k") is None
    known.remember("k", blocks)
    assert known.blocks("k") == blocks
    blocks[1].block_hash = "reused"  # vLLM handed the block out for other content
    assert known.blocks("k") is None
    assert len(known) == 0  # an invalid entry is forgotten


def test_checkpoints_are_bounded_least_recently_used_out() -> None:
    known = Checkpoints(max_entries=2)
    for key in "abc":
        known.remember(key, [FakeBlock(ord(key), key)])
    assert len(known) == 2 and known.blocks("a") is None
    assert known.blocks("b") is not None  # now the most recent
    known.remember("d", [FakeBlock(4, "d")])
    assert known.blocks("c") is None and known.blocks("b") is not None
    with pytest.raises(ValueError, match="max_entries"):
        Checkpoints(0)


def test_a_known_miss_is_remembered_until_forgotten() -> None:
    """No state at a checkpoint: remembered as such (no lookup on every request), until a
    request makes the checkpoint again."""
    known = Checkpoints(max_entries=4)
    known.remember("k", [])
    assert known.blocks("k") == []
    known.forget("k")
    assert known.blocks("k") is None
    known.forget("never known")  # harmless


def test_instructions_no_longer_than_the_state_get_no_checkpoint() -> None:
    """A state that spans as many tokens as the instructions saves nothing (the simulator's
    grid computed more than vanilla with one): none for them."""
    from vllm_affinity.core.checkpoints import instructions_end

    assert instructions_end(519, 32, state_span=128) == 512
    assert instructions_end(150, 32, state_span=128) == 0  # floored to 128: not longer
    assert checkpoint_position(150, 32, 0, 900, state_span=128) == 0
    assert checkpoint_position(519, 32, 0, 900, state_span=384) == 512  # three windows
