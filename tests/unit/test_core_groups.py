"""The KV-cache groups as the session tables see them (``core/groups.py``)."""

from __future__ import annotations

import sys

import pytest

from vllm_affinity.core.groups import KVGroup, decode_bound_at_free, kind_of
from vllm_affinity.core.request_keys import DENSE_KINDS

FULL = KVGroup(1, "full_attention", 16)


def test_spec_classes_read_as_kinds() -> None:
    assert kind_of("SlidingWindowSpec") == "sliding_window"
    assert kind_of("MLAAttentionSpec") == "mla_attention"


@pytest.mark.parametrize(
    ("groups", "bound"),
    [
        ((FULL,), sys.maxsize),  # nothing is dropped before the free
        ((KVGroup(0, "mla_attention", 64), FULL), sys.maxsize),
        ((KVGroup(0, "sliding_window", 16, window=128), FULL), 112),  # the window less a block
        (
            (KVGroup(0, "sliding_window", 16, window=128), KVGroup(2, "sliding_window", 32, 2, 64)),
            32,
        ),  # the tightest group decides
        ((KVGroup(0, "sliding_window", 16, window=16), FULL), 0),  # no room for a block
        ((KVGroup(0, "sliding_window", 16), FULL), 0),  # window unknown
        ((KVGroup(0, "mamba", 16), FULL), 0),  # a Mamba group drops states as it decodes
    ],
)
def test_decode_bound_at_free(groups: tuple[KVGroup, ...], bound: int) -> None:
    assert decode_bound_at_free(groups, DENSE_KINDS) == bound
