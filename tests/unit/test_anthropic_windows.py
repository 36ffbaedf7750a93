"""The Anthropic Messages window (pure): ``system`` first, content blocks as plain JSON, prompt
caching markers ignored, and the release body the plugin's contract takes."""

from __future__ import annotations

from typing import Any

import pytest

from jiuwen_hooks._diff import diff_windows
from jiuwen_hooks._release import EngineTarget, release_payload
from jiuwen_hooks._sessions import ReleasePlan
from jiuwen_hooks._windows import api_of, messages_body, messages_window, rewritten_messages
from jiuwen_kv_protocol.models import ReleaseRequest

SYSTEM = [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "x"}}]


def turn(i: int, cached: bool = False) -> list[dict[str, Any]]:
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"out {i}"}
    if cached:
        result["cache_control"] = {"type": "ephemeral"}
    return [
        {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "read",
                                           "input": {"path": f"f{i}"}}]},
        {"role": "user", "content": [result]},
    ]  # fmt: skip


def body(messages: list[dict[str, Any]], system: Any = SYSTEM) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": messages}
    if system is not None:
        out["system"] = system
    return out


@pytest.mark.parametrize(
    ("path", "api"),
    [
        ("/v1/messages", "messages"),
        ("/v1/messages?beta=true", "messages"),
        ("/v1/messages/count_tokens", None),
        ("/threads/t1/messages", None),  # openai's Assistants API is not a model call
        ("/chat/completions", "chat"),
    ],
)
def test_api_of(path: str, api: str | None) -> None:
    assert api_of(path) == api


def test_system_is_item_zero_and_cache_control_moves_change_nothing() -> None:
    first = [{"role": "user", "content": "fix the bug"}, *turn(1, cached=True)]
    later = [{"role": "user", "content": "fix the bug"}, *turn(1), *turn(2, cached=True)]
    old, new = messages_window(body(first)), messages_window(body(later))
    assert old is not None and new is not None and new.api == "messages"
    assert old.messages[0] == {"system": [{"type": "text", "text": "You are a coding agent."}]}
    assert diff_windows(old, new) is None  # the marker moved: still a pure append
    other_system = messages_window(body(later, system="Another prompt."))
    assert other_system is not None
    release = diff_windows(new, other_system)
    assert release is not None and release.messages_released_index == 0
    compacted = [{"role": "user", "content": "fix the bug"}, {"role": "user", "content": "[sum]"}]
    window = messages_window(body(compacted))
    assert window is not None
    release = diff_windows(new, window)
    assert release is not None and release.messages_released_index == 2  # system + 1 message


def test_no_system_and_no_messages() -> None:
    window = messages_window(body([{"role": "user", "content": "hi"}], system=None))
    assert window is not None and window.messages == ({"role": "user", "content": "hi"},)
    assert messages_window({"model": "m", "max_tokens": 1}) is None


def test_release_body_round_trips_through_the_plugin_contract() -> None:
    old = messages_window(body([{"role": "user", "content": "a"}, *turn(1)]))
    new = messages_window(
        body([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    )
    assert old is not None and new is not None
    release = diff_windows(old, new)
    assert release is not None
    target = EngineTarget("http://h/release_kv_cache", None, "m", "http://h")
    payload = release_payload(ReleasePlan("s", old, release, target))
    assert payload["api"] == "messages" and payload["system"] == old.messages[0]["system"]
    assert payload["messages"] == list(old.messages[1:])
    parsed = ReleaseRequest.model_validate(payload)
    assert parsed.is_messages and parsed.window_length == len(old.messages)
    assert messages_body(old) == {"system": payload["system"], "messages": payload["messages"]}


def test_compressor_output_keeps_the_system_item() -> None:
    old = messages_window(body([{"role": "user", "content": "a"}]))
    assert old is not None
    out = rewritten_messages(old, [{"role": "user", "content": "b", "cache_control": {}}])
    assert out == (old.messages[0], {"role": "user", "content": "b"})


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"system": "x", "messages": [{"role": "user", "content": "a"}]}, "system is for"),
        ({"api": "messages", "input": [{"role": "user", "content": "a"}]}, "needs messages"),
        ({"api": "responses", "messages": [{"role": "user", "content": "a"}]}, "needs input"),
        ({"api": "messages", "system": "x", "messages": [{"role": "user", "content": "a"}],
          "messages_released_index": 3}, "beyond"),
    ],
)  # fmt: skip
def test_contract_refuses_mixed_windows(payload: dict[str, Any], message: str) -> None:
    data = {"model": "m", "cache_salt": "s", "messages_released_index": 1, **payload}
    with pytest.raises(ValueError, match=message):
        ReleaseRequest.model_validate(data)
