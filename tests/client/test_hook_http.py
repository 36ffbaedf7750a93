"""The hook end to end through the real openai client against a real loopback HTTP server:
every diff rule, salt injection, streaming, raw responses, sync and async."""

from __future__ import annotations

from typing import Any

import pytest
from callers import Caller, system_and_user

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine

pytestmark = pytest.mark.usefixtures("jiuwen_hook")


def released(engine: LocalEngine) -> list[tuple[str, int, int | None]]:
    return [
        (
            r.body["cache_salt"],
            r.body["messages_released_index"],
            r.body.get("tools_released_index"),
        )
        for r in engine.releases
    ]


def test_append_only_turns_release_nothing(call: Caller, jiuwen_engine: LocalEngine) -> None:
    window = system_and_user()
    for turn in range(3):
        reply = call(window)
        window += [reply.choices[0].message, {"role": "user", "content": f"next {turn}"}]
    assert jiuwen_engine.releases == []
    assert len(jiuwen_engine.chats) == 3


def test_rewrite_releases_previous_window_before_the_chat(
    call: Caller, jiuwen_engine: LocalEngine
) -> None:
    window = system_and_user(3)
    call(window)
    sent_before = [dict(m) for m in window]
    window[2] = {"role": "user", "content": "[Old tool result content cleared]"}
    call(window)
    (release,) = jiuwen_engine.releases
    assert release.body["messages"] == sent_before
    assert release.body["messages_released_index"] == 2
    assert release.body["model"] == "m"
    assert release.body["cache_sharing"] is True
    assert release.headers["authorization"] == "Bearer sk-test"
    assert jiuwen_engine.paths == [
        "/v1/chat/completions",
        "/release_kv_cache",
        "/v1/chat/completions",
    ]


def test_in_place_mutation_is_detected(call: Caller, jiuwen_engine: LocalEngine) -> None:
    window = system_and_user(2)
    call(window)
    window[1]["content"] = "edited in place"
    call(window)
    assert released(jiuwen_engine) == [("s", 1, None)]
    assert jiuwen_engine.releases[0].body["messages"][1]["content"] == "question 0"


def test_truncation_releases_from_new_length(call: Caller, jiuwen_engine: LocalEngine) -> None:
    window = system_and_user(4)
    call(window)
    call(window[:2])
    assert released(jiuwen_engine) == [("s", 2, None)]


def test_changed_tools(call: Caller, jiuwen_engine: LocalEngine) -> None:
    def tool(name: str) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}

    window = system_and_user()
    call(window, tools=[tool("weather"), tool("time")])
    call(window, tools=[tool("weather"), tool("clock")])
    assert released(jiuwen_engine) == [("s", 2, 1)]
    assert jiuwen_engine.releases[0].body["tools"][1]["function"]["name"] == "time"


def test_sdk_message_objects_compare_as_their_wire_form(
    call: Caller, jiuwen_engine: LocalEngine
) -> None:
    window = system_and_user()
    reply = call(window).choices[0].message
    window.append(reply)
    call(window)
    window[-1] = reply.model_dump(exclude_none=True)  # the agent re-serialises its history
    window.append({"role": "user", "content": "more"})
    call(window)
    assert jiuwen_engine.releases == []


def test_session_rides_in_the_header_only(call: Caller, jiuwen_engine: LocalEngine) -> None:
    body = {"top_k": 5}
    headers = {"X-Trace": "mine"}
    call(system_and_user(), extra_body=body, extra_headers=headers)
    chat = jiuwen_engine.chats[0]
    assert chat.body["top_k"] == 5
    assert "cache_salt" not in chat.body and "cache_sharing" not in chat.body
    assert chat.headers["x-session-id"] == "s"
    assert chat.headers["x-trace"] == "mine"
    assert body == {"top_k": 5}  # the caller's dicts are not mutated
    assert headers == {"X-Trace": "mine"}


@pytest.mark.parametrize("jiuwen_hook_options", [{"session_body": True}])
def test_session_body_option_injects_without_clobbering(
    call: Caller, jiuwen_engine: LocalEngine
) -> None:
    body = {"top_k": 5, "cache_sharing": False}
    call(system_and_user(), extra_body=body)
    chat = jiuwen_engine.chats[0]
    assert chat.body["cache_salt"] == "s"
    assert chat.body["cache_sharing"] is False
    assert chat.body["top_k"] == 5
    assert body == {"top_k": 5, "cache_sharing": False}


@pytest.mark.parametrize("jiuwen_hook_options", [{"session_body": True}])
def test_release_says_how_the_chat_requests_were_hashed(
    call: Caller, jiuwen_engine: LocalEngine
) -> None:
    """A salt the engine hashes with (no sharing) must be used by the release too."""
    window = system_and_user(3)
    call(window, extra_body={"cache_sharing": False})
    call(window[:2], extra_body={"cache_sharing": False})
    call(window, session="shared")
    call(window[:2], session="shared")
    assert [r.body["cache_sharing"] for r in jiuwen_engine.releases] == [False, True]


def test_explicit_cache_salt_wins_over_context(call: Caller, jiuwen_engine: LocalEngine) -> None:
    window = system_and_user(2)
    call(window, session="ctx", extra_body={"cache_salt": "explicit"})
    call(window[:1], session="ctx", extra_body={"cache_salt": "explicit"})
    assert released(jiuwen_engine) == [("explicit", 1, None)]
    assert jiuwen_engine.chats[0].headers["x-session-id"] == "explicit"


@pytest.mark.parametrize("name", ["X-Session-ID", "x-session-id", "X-SESSION-ID"])
def test_session_from_header(call: Caller, jiuwen_engine: LocalEngine, name: str) -> None:
    """Header names are case-insensitive: every spelling names the session (the recording
    server lower-cases what it received, so only the hook's own lookup is under test)."""
    window = system_and_user(2)
    call(window, session=None, extra_headers={name: "hdr"})
    call(window[:1], session=None, extra_headers={name: "hdr"})
    assert released(jiuwen_engine) == [("hdr", 1, None)]
    assert jiuwen_engine.chats[0].headers["x-session-id"] == "hdr"
    assert "cache_salt" not in jiuwen_engine.chats[0].body


def test_no_session_passes_through_untouched(call: Caller, jiuwen_engine: LocalEngine) -> None:
    window = system_and_user(2)
    call(window, session=None)
    call(window[:1], session=None)
    assert jiuwen_engine.releases == []
    assert "cache_salt" not in jiuwen_engine.chats[0].body
    assert "x-session-id" not in jiuwen_engine.chats[0].headers


def test_streaming_calls_release_first(call: Caller, jiuwen_engine: LocalEngine) -> None:
    window = system_and_user(2)
    chunks = call(window, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "ok (3 messages)"
    call(window[:2], stream=True)
    assert released(jiuwen_engine) == [("s", 2, None)]
    assert jiuwen_engine.paths[-2:] == ["/release_kv_cache", "/v1/chat/completions"]


def test_with_raw_response(call: Caller, jiuwen_engine: LocalEngine) -> None:
    window = system_and_user(2)
    create = call.client.chat.completions.with_raw_response.create

    async def acreate(**kw: Any) -> Any:
        return await create(**kw)

    for messages in (window, window[:1]):
        with jiuwen_hooks.session("raw"):
            if call.mode == "sync":
                raw = create(model="m", messages=messages)
            else:
                raw = call.run(acreate(model="m", messages=messages))
        assert raw.http_response.status_code == 200
    assert released(jiuwen_engine) == [("raw", 1, None)]


def test_parse_releases_once(call: Caller, jiuwen_engine: LocalEngine) -> None:
    window = system_and_user(2)
    parse = call.client.chat.completions.parse

    async def aparse(**kw: Any) -> Any:
        return await parse(**kw)

    for messages in (window, window[:1]):
        with jiuwen_hooks.session("p"):
            if call.mode == "sync":
                parse(model="m", messages=messages)
            else:
                call.run(aparse(model="m", messages=messages))
    assert released(jiuwen_engine) == [("p", 1, None)]


def test_generator_messages_still_reach_the_server(
    call: Caller, jiuwen_engine: LocalEngine
) -> None:
    window = system_and_user(2)
    call(m for m in window)
    assert len(jiuwen_engine.chats[0].body["messages"]) == 3


def test_session_resolver(
    jiuwen_engine: LocalEngine, jiuwen_telemetry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    jiuwen_hooks.uninstall()
    jiuwen_hooks.install(session_resolver=lambda kw: kw.get("user") or None)
    try:
        caller = Caller("sync", jiuwen_engine.base_url)
        window = system_and_user(2)
        caller(window, session=None, user="u-7")
        caller(window[:1], session=None, user="u-7")
        caller.close()
    finally:
        jiuwen_hooks.uninstall()
    assert released(jiuwen_engine) == [("u-7", 1, None)]


def test_end_session_releases_the_window_after_its_instructions_once(
    call: Caller, jiuwen_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook
) -> None:
    """The system prompt (and tools) stay: the agent's next sessions send them again."""
    window = system_and_user(3)
    call(window)
    call([*window, {"role": "user", "content": "more"}])
    jiuwen_hooks.end_session("s")
    jiuwen_hook.flush()
    (release,) = jiuwen_engine.releases
    assert release.body["messages"] == [*window, {"role": "user", "content": "more"}]
    assert release.body["messages_released_index"] == 1  # after the system message
    assert "tools_released_index" not in release.body  # the tools stay too
    assert release.headers["x-session-id"] == "s"
    # ended: a second end, or an unknown session, sends nothing
    jiuwen_hooks.end_session("s")
    jiuwen_hooks.end_session("never-seen")
    jiuwen_hook.flush()
    assert len(jiuwen_engine.releases) == 1
    stats = jiuwen_hook.stats()
    assert stats["end_session.released"] == 1
    assert stats["end_session.unknown"] == 2
    # the session starts afresh: a shorter window is a new start, not a rewrite to release
    call(system_and_user(1))
    jiuwen_hook.flush()
    assert len(jiuwen_engine.releases) == 1


def test_a_session_block_can_be_the_whole_session(
    client: Any, jiuwen_engine: LocalEngine, jiuwen_hook: jiuwen_hooks.Hook
) -> None:
    """``session(id, end_on_exit=True)`` ends the session when the block is left, even by an
    exception; a plain ``session()`` block (entered once per turn) never does."""
    window = system_and_user(2)
    for session_id, end in (("turn", False), ("task", True)):
        with pytest.raises(RuntimeError), jiuwen_hooks.session(session_id, end_on_exit=end):
            client.chat.completions.create(model="m", messages=window)
            raise RuntimeError("the agent failed")
    jiuwen_hook.flush()
    (release,) = jiuwen_engine.releases
    assert release.headers["x-session-id"] == "task"
    assert release.body["messages_released_index"] == 1  # the system prompt stays
    assert jiuwen_hook.stats()["end_session.released"] == 1


def test_end_session_without_the_hook_does_nothing() -> None:
    jiuwen_hooks.uninstall()
    jiuwen_hooks.end_session("s")  # no error, no hook
