"""Unit and property tests of the pure diff, against a plain reference definition."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion_message_tool_call import (
    ChatCompletionMessageToolCall,
    Function,
)

from jiuwen_hooks._diff import (
    Release,
    ReleasePolicy,
    Window,
    canonical_message,
    canonical_window,
    diff_windows,
    head_length,
)


def W(*contents: str, tools: tuple[dict, ...] | None = None) -> Window:
    return Window(tuple({"role": "user", "content": c} for c in contents), tools)


def test_pure_append_releases_nothing() -> None:
    assert diff_windows(W("a", "b"), W("a", "b", "c", "d")) is None


def test_identical_window_releases_nothing() -> None:
    assert diff_windows(W("a", "b"), W("a", "b")) is None


def test_rewrite_releases_from_first_differing_message() -> None:
    assert diff_windows(W("a", "b", "c"), W("a", "X", "c", "d")) == Release(1, None, "rewrite")


def test_rewrite_of_the_first_message() -> None:
    assert diff_windows(W("a", "b"), W("Z", "b")) == Release(0, None, "rewrite")


def test_strict_truncation_releases_from_new_length() -> None:
    assert diff_windows(W("a", "b", "c"), W("a")) == Release(1, None, "truncate")


def test_truncation_to_empty() -> None:
    assert diff_windows(W("a", "b"), W()) == Release(0, None, "truncate")


def test_rewrite_shorter_window_is_a_rewrite() -> None:
    assert diff_windows(W("a", "b", "c"), W("a", "Y")) == Release(1, None, "rewrite")


def test_changed_tool_only() -> None:
    t1, t2 = (
        {"type": "function", "function": {"name": "a"}},
        {"type": "function", "function": {"name": "b"}},
    )
    old, new = W("a", "b", tools=(t1, t2)), W("a", "b", "c", tools=(t1, {"type": "function"}))
    assert diff_windows(old, new) == Release(2, 1, "tools")


def test_tools_added_where_there_were_none() -> None:
    tool = {"type": "function", "function": {"name": "a"}}
    assert diff_windows(W("a"), W("a", tools=(tool,))) == Release(1, 0, "tools")


def test_tool_removed_and_message_rewritten() -> None:
    t = {"type": "function", "function": {"name": "a"}}
    assert diff_windows(W("a", "b", tools=(t, t)), W("X", tools=(t,))) == Release(0, 1, "rewrite")


def test_pydantic_message_equals_its_dict() -> None:
    call = ChatCompletionMessageToolCall(
        id="call_1", type="function", function=Function(name="weather", arguments='{"city":"Oslo"}')
    )
    obj = ChatCompletionMessage(role="assistant", content=None, tool_calls=[call])
    plain = {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
            }
        ],
    }
    assert canonical_message(obj) == canonical_message(plain)
    assert canonical_message({**plain, "content": None, "refusal": None}) == canonical_message(
        plain
    )


def test_content_parts_are_plain_copies() -> None:
    parts = [{"type": "text", "text": "hello"}]
    msg = {"role": "user", "content": parts}
    snapshot = canonical_message(msg)
    parts[0]["text"] = "changed in place"
    assert snapshot["content"] == [{"type": "text", "text": "hello"}]


def test_snapshot_shares_strings() -> None:
    text = "x" * 10_000
    (snapshot,) = canonical_window([{"role": "tool", "content": text, "tool_call_id": "c1"}])
    assert snapshot["content"] is text


def test_empty_tool_calls_equal_absent() -> None:
    assert canonical_message({"role": "assistant", "content": "a", "tool_calls": []}) == {
        "role": "assistant",
        "content": "a",
    }


def test_policy_min_gain_and_volatile_tail() -> None:
    policy = ReleasePolicy(min_released_messages=3, ignore_trailing_messages=1)
    assert policy.skip_reason(Release(9, None, "rewrite"), 10) == "volatile_tail"
    assert policy.skip_reason(Release(8, None, "rewrite"), 10) == "below_min_gain"
    assert policy.skip_reason(Release(7, None, "rewrite"), 10) is None
    assert policy.skip_reason(Release(10, 0, "tools"), 10) is None


# -- property tests against a reference definition ----------------------------------------------


def reference(old: list[str], new: list[str]) -> int | None:
    """The rule as a person states it: release from the first index where the new window stops
    being the old one; a pure append (or no change) releases nothing."""
    for i in range(len(old)):
        if i >= len(new) or old[i] != new[i]:
            return i
    return None


contents = st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=12)


@given(contents, contents)
def test_diff_matches_reference(old: list[str], new: list[str]) -> None:
    release = diff_windows(W(*old), W(*new))
    expected = reference(old, new)
    assert (release.messages_released_index if release else None) == expected
    if release is not None:
        assert release.reason == ("truncate" if expected == len(new) else "rewrite")


@given(contents, st.lists(st.sampled_from(["x", "y"]), max_size=5))
def test_append_never_releases(old: list[str], appended: list[str]) -> None:
    assert diff_windows(W(*old), W(*old, *appended)) is None


@given(contents, st.integers(min_value=0, max_value=12))
def test_mutation_at_k_releases_at_k(old: list[str], k: int) -> None:
    if k >= len(old):
        return
    new = list(old)
    new[k] = "changed"
    assert diff_windows(W(*old), W(*new)) == Release(k, None, "rewrite")


def test_head_length_counts_the_leading_instructions() -> None:
    system = {"role": "system", "content": "s"}
    user = {"role": "user", "content": "u"}
    assert head_length(Window((system, {"role": "developer", "content": "d"}, user))) == 2
    assert head_length(Window((user, system))) == 0
    assert head_length(Window(({"instructions": "i"}, user), api="responses")) == 1
    assert head_length(Window(({"system": "s"}, user))) == 1  # an Anthropic window
    assert head_length(Window(())) == 0
