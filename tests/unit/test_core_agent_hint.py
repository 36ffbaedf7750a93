"""openJiuwen's ``agent_hint`` (pure core): what is accepted, and what is refused with a reason."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_affinity.core.agent_hint import AgentHint, AgentHintError


def managed(*edits: dict[str, Any]) -> dict[str, Any]:
    return {
        "session_id": "s",
        "parent_session_id": "p",
        "context_management": {"manage_request": True, "edits": list(edits)},
    }


def test_a_plain_hint_names_the_session_only() -> None:
    hint = AgentHint.parse({"session_id": "s", "parent_session_id": "p", "future_key": 1})
    assert (hint.session_id, hint.parent_session_id) == ("s", "p")
    assert not hint.manage_request and hint.action is None


def test_range_edits_map_to_their_starts() -> None:
    hint = AgentHint.parse(
        managed(
            {"type": "evict", "target": "messages", "start": 4, "end": 9},
            {"type": "evict", "target": "tools", "start": 1, "end": 2},
        )
    )
    assert hint.manage_request and hint.action == "evict"
    assert (hint.start_of("messages"), hint.start_of("tools"), hint.start_of("session")) == (
        4,
        1,
        None,
    )


def test_a_session_edit_starts_at_zero() -> None:
    hint = AgentHint.parse(managed({"type": "offload", "target": "session"}))
    assert hint.start_of("session") == 0 and hint.start_of("messages") is None


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ([], "must be an object"),
        ({"session_id": 3}, "session_id"),
        ({"parent_session_id": "p"}, "session_id"),
        (managed(), "edits"),
        (managed({"type": "evict", "target": "messages", "start": 3, "end": 3}), "start < end"),
        (managed({"type": "evict", "target": "messages", "start": -1, "end": 3}), "start"),
        (managed({"type": "evict", "target": "tools", "start": 0}), "start < end"),
        (managed({"type": "evict", "target": "session", "end": 3}), "no start/end"),
        (managed({"type": "evict", "target": "history"}), "target"),
        (managed({"type": "evict", "target": "session", "extra": 1}), "extra"),
        (
            managed(
                {"type": "evict", "target": "messages", "start": 0, "end": 1},
                {"type": "offload", "target": "tools", "start": 0, "end": 1},
            ),
            "same action",
        ),
        (
            managed(
                {"type": "evict", "target": "messages", "start": 0, "end": 1},
                {"type": "evict", "target": "messages", "start": 2, "end": 3},
            ),
            "one edit per target",
        ),
        (
            {
                "session_id": "s",
                "context_management": {
                    "manage_request": False,
                    "edits": [{"type": "evict", "target": "session"}],
                },
            },
            "manage_request: true",
        ),
    ],
)
def test_malformed_hints_are_refused_with_a_reason(value: Any, reason: str) -> None:
    with pytest.raises(AgentHintError, match=reason):
        AgentHint.parse(value)
