"""The engine's reading of the plugin's request keys: each of the type the API server writes,
anything else ignored and named (never raised inside vLLM's scheduler)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from vllm_affinity.core.request_keys import (
    CHECKPOINT_KEY,
    HEAD_KEY,
    HINT_KEY,
    NEXT_USE_KEY,
    PARENT_KEY,
    PRINCIPAL_KEY,
    RESERVED_KEYS,
    RETRY_KEY,
    REWRITE_KEY,
    RequestKeys,
    read_request_keys,
)


def test_the_values_the_api_server_writes_are_read() -> None:
    keys = read_request_keys(
        {
            HINT_KEY: "messages_released_index=2",
            REWRITE_KEY: "rewrite",
            RETRY_KEY: "retry",
            PARENT_KEY: "lead",
            PRINCIPAL_KEY: "tenant-a",
            HEAD_KEY: 512,
            NEXT_USE_KEY: 30.5,
            CHECKPOINT_KEY: 4096,
            "a_client_key": {"anything": [1]},
        }
    )
    assert keys == RequestKeys(
        hint=True,
        rewrite=True,
        retry=True,
        parent="lead",
        principal="tenant-a",
        head=512,
        next_use=30.5,
        checkpoint=4096,
    )


@pytest.mark.parametrize("extra", [None, {}, {"temperature_hint": 3}, ["not", "a", "mapping"]])
def test_no_keys_read_as_none(extra: Any) -> None:
    assert read_request_keys(extra) == RequestKeys()


MALFORMED: list[tuple[str, Any]] = [
    (HINT_KEY, 1),
    (REWRITE_KEY, None),
    (RETRY_KEY, ["retry"]),
    (PARENT_KEY, ""),
    (PARENT_KEY, 7),
    (PARENT_KEY, "p" * 5000),
    (PRINCIPAL_KEY, {"id": "x"}),
    (HEAD_KEY, "512"),
    (HEAD_KEY, -1),
    (HEAD_KEY, True),
    (HEAD_KEY, 2.5),
    (HEAD_KEY, 1 << 80),
    (NEXT_USE_KEY, "soon"),
    (NEXT_USE_KEY, math.nan),
    (NEXT_USE_KEY, math.inf),
    (NEXT_USE_KEY, -3),
    (NEXT_USE_KEY, False),
    (CHECKPOINT_KEY, "4096"),
    (CHECKPOINT_KEY, [4096]),
]


@pytest.mark.parametrize(("key", "value"), MALFORMED, ids=[f"{k}={v!r:.20}" for k, v in MALFORMED])
def test_a_malformed_value_is_ignored_and_named(key: str, value: Any) -> None:
    keys = read_request_keys({key: value, HEAD_KEY if key != HEAD_KEY else NEXT_USE_KEY: 3})
    assert keys.malformed == (key,)
    blank = RequestKeys()
    field = {
        HINT_KEY: "hint",
        REWRITE_KEY: "rewrite",
        RETRY_KEY: "retry",
        PARENT_KEY: "parent",
        PRINCIPAL_KEY: "principal",
        HEAD_KEY: "head",
        NEXT_USE_KEY: "next_use",
        CHECKPOINT_KEY: "checkpoint",
    }[key]
    assert getattr(keys, field) == getattr(blank, field)  # as if not sent
    assert keys.head == 3 or keys.next_use == 3.0  # the well-formed key beside it is read


def test_every_reserved_key_is_read() -> None:
    """A key the API server reserves but the engine does not type-check would reach it raw."""
    for key in RESERVED_KEYS:
        assert read_request_keys({key: object()}).malformed == (key,)
