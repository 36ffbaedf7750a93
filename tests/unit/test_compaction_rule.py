"""The compaction rule (pure core): windows as Claude Code and the Codex CLI send them."""

from __future__ import annotations

import pytest

from vllm_affinity.core.compaction import (
    AgentWindow,
    CompactionRule,
    DigestMemo,
    Window,
    digest,
    owner_of,
    side_branch,
)
from vllm_affinity.core.sessions import SessionBlocks

TOOLS = [{"type": "function", "function": {"name": "Bash", "parameters": {}}}]
SYSTEM = {"role": "system", "content": "You are a coding agent."}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def answer(text: str) -> dict:
    return {"role": "assistant", "content": text}


def main(*messages: dict) -> Window:
    return Window.of([SYSTEM, *messages], TOOLS)


def test_claude_code_session_turns_side_requests_compaction_and_retry() -> None:
    rule = CompactionRule()
    turn1 = main(user("fix the bug"))
    assert rule.classify("s", turn1) == "first"
    # the per-turn side request: no tools, another system prompt
    side = Window.of([{"role": "system", "content": "Title this."}, user("<session>x")], None)
    assert rule.classify("s", side) == "side"
    turn2 = main(user("fix the bug"), answer("ok"), user("and the test"))
    assert rule.classify("s", turn2) == "append"
    # the compaction request appends its instruction to the whole window (sent twice)
    compact = main(user("fix the bug"), answer("ok"), user("and the test"), answer("done"),
                   user("CRITICAL: summarise"))  # fmt: skip
    assert rule.classify("s", compact) == "append"
    assert rule.classify("s", compact) == "retry"  # the same window again: settled later
    # an answer with no visible text: the last user message is re-sent, changed
    retried = main(user("fix the bug"), answer("ok"), user("and the test"), answer("done"),
                   user("CRITICAL: summarise. Text only."))  # fmt: skip
    assert rule.classify("s", retried) == "retry"
    # the new window starts from the first message: the summary
    after = main(user("This session is continued... summary"), user("next task"))
    assert rule.classify("s", after) == "rewrite"
    later = main(user("This session is continued... summary"), user("next task"), answer("a"))
    assert rule.classify("s", later) == "append"


def test_a_chat_uis_regenerate_edit_and_branch() -> None:
    """A chat UI with no id: a regenerated answer re-sends the same window (a retry); an
    edited last message changes only it (a retry); an edited earlier message drops what
    followed it (a rewrite); going on from the edit appends."""
    rule = CompactionRule()
    chat = [user("hello"), answer("Hi!"), user("plan a trip")]
    assert rule.classify("c", Window.of(chat, None)) == "first"
    assert rule.classify("c", Window.of(chat, None)) == "retry"  # regenerate
    chat += [answer("Where to?"), user("Oslo")]
    assert rule.classify("c", Window.of(chat, None)) == "append"
    edited = [*chat[:-1], user("Lima")]
    assert rule.classify("c", Window.of(edited, None)) == "retry"  # the last message edited
    branch = [user("hello"), answer("Hi!"), user("plan a dinner")]
    assert rule.classify("c", Window.of(branch, None)) == "rewrite"  # an earlier one edited
    assert rule.classify("c", Window.of([*branch, answer("Sure."), user("Thai")], None)) == (
        "append"
    )


def test_a_side_request_before_the_first_main_window_releases_nothing() -> None:
    """Interactive Claude Code sends a turn's side request (no tools) beside its main one; the
    side request may reach the server first."""
    rule = CompactionRule()
    side = Window.of([{"role": "system", "content": "Is this a new topic?"}, user("x")], None)
    assert rule.classify("s", side) == "first"
    assert rule.classify("s", main(user("fix the bug"))) == "first"  # the main thread starts
    assert rule.classify("s", side) == "side"
    assert rule.classify("s", main(user("fix the bug"), answer("ok"), user("go"))) == "append"


def test_a_new_window_with_a_new_system_prompt_is_still_a_rewrite() -> None:
    rule = CompactionRule()
    rule.classify("s", main(user("a"), answer("b"), user("c")))
    changed = Window.of([{"role": "system", "content": "other"}, user("summary")], TOOLS)
    assert rule.classify("s", changed) == "rewrite"


def test_masking_an_early_tool_result_is_a_rewrite() -> None:
    rule = CompactionRule()
    rule.classify("s", main(user("a"), answer("b"), user("long tool output"), answer("c")))
    masked = main(user("a"), answer("b"), user("[cleared]"), answer("c"), user("d"))
    assert rule.classify("s", masked) == "rewrite"


def test_sessions_are_apart_and_bounded() -> None:
    rule = CompactionRule(max_sessions=2)
    rule.classify("a", main(user("1"), answer("2"), user("3")))
    rule.classify("b", main(user("x"), answer("y"), user("z")))
    assert rule.classify("b", main(user("other"))) == "rewrite"
    rule.classify("c", main(user("q")))  # "a" is the least recently seen: out
    assert len(rule) == 2
    assert rule.classify("a", main(user("other"))) == "first"
    with pytest.raises(ValueError):
        CompactionRule(max_sessions=0)


def codex(kind: str, number: int) -> AgentWindow:
    return AgentWindow(kind, number)


def test_codex_says_it_exactly() -> None:
    rule = CompactionRule()
    w0 = main(user("env"), user("q1"))
    assert rule.classify("t", w0, codex("turn", 0)) == "first"
    w0b = main(user("env"), user("q1"), answer("a1"), user("q2"))
    assert rule.classify("t", w0b, codex("turn", 0)) == "append"
    # the compaction request (no tools) and a prewarm are side branches
    assert rule.classify("t", Window.of([SYSTEM, user("summarise")], None),
                         codex("compaction", 0)) == "side"  # fmt: skip
    assert rule.classify("t", w0b, codex("prewarm", 0)) == "side"
    # the first turn of window 1 keeps the first item: a rewrite all the same
    w1 = main(user("env"), user("summary"), user("q3"))
    assert rule.classify("t", w1, codex("turn", 1)) == "rewrite"
    # in one window, a turn never releases, whatever its shape
    assert rule.classify("t", main(user("env"), user("other")), codex("turn", 1)) == "append"


def test_codex_headers_are_read_and_malformed_ones_ignored() -> None:
    meta = '{"request_kind":"compaction","window_number":3,"thread_id":"t"}'
    assert AgentWindow.from_headers({"x-codex-turn-metadata": meta}) == codex("compaction", 3)
    by_id = {"x-codex-turn-metadata": '{"request_kind":"turn"}', "x-codex-window-id": "t:2"}
    assert AgentWindow.from_headers(by_id) == codex("turn", 2)
    for bad in ({"x-codex-turn-metadata": "{not json"}, {"x-codex-turn-metadata": "[1]"},
                {"x-codex-window-id": "t:1"}, {}):  # fmt: skip
        assert AgentWindow.from_headers(bad) is None


def test_digests_ignore_cache_marks_and_text_part_lists() -> None:
    plain = {"role": "user", "content": "hello"}
    parts = {"role": "user", "content": [{"type": "text", "text": t} for t in ("hel", "lo")]}
    marked = {"role": "user", "content": [{"type": "text", "text": "hello",
                                           "cache_control": {"type": "ephemeral"}}]}  # fmt: skip
    assert digest(plain) == digest(parts) == digest(marked)
    assert digest(plain) != digest({"role": "assistant", "content": "hello"})
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}
    assert digest(image) != digest({"role": "user", "content": ""})


def test_a_side_branch_shares_its_own_sessions_blocks() -> None:
    """A side branch holding its session's blocks does not make them shared across sessions:
    the session can still idle or release them."""
    assert owner_of(side_branch("s")) == "s" and owner_of("s") == "s"
    table = SessionBlocks()
    table.record("s", [1, 2, 3], 96, "r1")
    table.request_finished("s", "r1")
    table.record(side_branch("s"), [1, 7], 64, "r2")
    table.request_finished(side_branch("s"), "r2")
    table.select_release(side_branch("s"), 0)
    assert table.select_release("s", 0).block_ids == [1, 2, 3]
    other = SessionBlocks()
    other.record("s", [1, 2], 64, "r1")
    other.record("t", [1, 9], 64, "r2")
    other.select_release("t", 0)
    assert other.select_release("s", 0).block_ids == [2]  # 1 was another session's too


ENVIRONMENT = {"role": "system", "content": "# Environment\ncwd: /repo"}


def test_claude_code_turn_one_retry_before_its_environment_block_is_a_retry() -> None:
    """Claude Code's first turn ends with an inline environment block; an empty answer makes
    it re-send the turn with the user message changed and the block unchanged after it."""
    rule = CompactionRule()
    assert rule.classify("s", main(user("fix it"), ENVIRONMENT)) == "first"
    assert rule.classify("s", main(user("fix it. Answer in text."), ENVIRONMENT)) == "retry"
    # the next turn moves the block behind the conversation: trailing instructions aside,
    # every message is kept
    turn2 = main(user("fix it. Answer in text."), answer("done"), user("now the test"))
    assert rule.classify("s", turn2) == "append"


def test_opencode_compaction_right_after_the_first_turn_is_a_rewrite() -> None:
    """opencode's window after a compaction keeps the system prompt and goes on with "What did
    we do so far?", the summary and the new message: after one turn the old window was the
    system prompt and one user message, which the old rule read as a retry."""
    rule = CompactionRule()
    assert rule.classify("s", main(user("build the parser"))) == "first"
    after = main(user("What did we do so far?"), answer("Summary: ..."), user("go on"))
    assert rule.classify("s", after) == "rewrite"


def test_a_changed_last_message_followed_by_more_conversation_is_a_rewrite() -> None:
    rule = CompactionRule()
    rule.classify("s", main(user("a"), answer("b"), user("c")))
    assert rule.classify("s", main(user("a"), answer("b"), user("c2"))) == "retry"
    rule.forget("s")
    rule.classify("s", main(user("a"), answer("b"), user("c")))
    assert rule.classify("s", main(user("a"), answer("b"), user("c2"), answer("d"))) == "rewrite"
    # a changed system prompt with nothing else kept is a rewrite, not a trailing instruction
    rule.forget("s")
    rule.classify("s", main(user("a")))
    other = Window.of([{"role": "system", "content": "v2"}, user("a")], TOOLS)
    assert rule.classify("s", other) == "rewrite"


def test_window_marks_instructions_by_role() -> None:
    window = Window.of([SYSTEM, user("a"), {"role": "developer", "content": "d"}], TOOLS)
    assert window.instructions == b"\x01\x00\x01"
    with pytest.raises(ValueError):
        Window(True, window.messages, b"\x01")


def test_qwen_code_prompt_ids_tell_main_turns_from_side_requests() -> None:
    """Qwen Code's ``metadata.promptId``: main turns are ``<sid>########<n>``; its memory
    extractor (another system prompt, six tools), its next-prompt suggestion (the whole
    conversation and one more user message) and its compression request are side branches; the
    window after a compression (start-up context with the state snapshot, then "Got it") is a
    rewrite by its shape."""
    main_kind = AgentWindow.from_qwen_prompt_id("abc########2")
    assert main_kind == AgentWindow("turn", None)
    for side in ("abc#managed-auto-memory-extractor-9f#0", "abc#managed-auto-dreamer-1#0",
                 "forked_query", "compress-1764000000000", "abc####", "abc########x"):  # fmt: skip
        assert AgentWindow.from_qwen_prompt_id(side).kind == "side", side
    rule = CompactionRule()
    turn1 = main(user("<startup context>"), answer("Got it."), user("fix the bug"))
    assert rule.classify("q", turn1, main_kind) == "first"
    extractor = Window.of([{"role": "system", "content": "Extract memories."}, user("...")], TOOLS)
    side = AgentWindow.from_qwen_prompt_id("q#managed-auto-memory-extractor-1#0")
    assert rule.classify("q", extractor, side) == "side"  # tools, yet not the main thread
    suggestion = main(user("<startup context>"), answer("Got it."), user("fix the bug"),
                      answer("done"), user("Suggest the next prompt."))  # fmt: skip
    assert rule.classify("q", suggestion, AgentWindow.from_qwen_prompt_id("forked_query")) == "side"
    turn2 = main(user("<startup context>"), answer("Got it."), user("fix the bug"),
                 answer("done"), user("and the test"))  # fmt: skip
    assert rule.classify("q", turn2, main_kind) == "append"
    compress = AgentWindow.from_qwen_prompt_id("compress-1")
    assert rule.classify("q", main(*turn2_messages(), user("Summarize.")), compress) == "side"
    after = main(user("<startup context><state_snapshot>...</state_snapshot>"),
                 answer("Got it. Thanks for the additional context!"), user("go on"))  # fmt: skip
    assert rule.classify("q", after, main_kind) == "rewrite"


def turn2_messages() -> list[dict]:
    return [user("<startup context>"), answer("Got it."), user("fix the bug"), answer("done"),
            user("and the test")]  # fmt: skip


def test_aiders_reminder_moving_to_the_newest_message_releases_only_the_old_tail() -> None:
    """aider appends a reminder to the last user message and drops it the next turn: the rule
    reads a rewrite from that message on (what it released: that message's tail only)."""
    rule = CompactionRule()
    reminder = " (reply with a diff)"
    rule.classify("a", main(user("u1"), answer("a1"), user("u2" + reminder)))
    new = main(user("u1"), answer("a1"), user("u2"), answer("a2"), user("u3" + reminder))
    assert rule.classify("a", new) == "rewrite"


def test_windows_cross_to_the_engine_and_back_unchanged() -> None:
    window = main(user("fix the bug"), answer("ok"), {"role": "system", "content": "# Env"})
    back = Window.from_wire(window.to_wire())
    assert back == window and back.is_instruction(3) and not back.is_instruction(1)
    agent = AgentWindow("turn", 3)
    assert AgentWindow.from_wire(agent.to_wire()) == agent
    assert AgentWindow.from_wire(None) is None
    # the same verdicts from the copy as from the original
    here, there = CompactionRule(), CompactionRule()
    for step in (main(user("a")), main(user("a"), answer("b"), user("c")), main(user("z"))):
        assert here.classify("s", step) == there.classify("s", Window.from_wire(step.to_wire()))


@pytest.mark.parametrize(
    "wire",
    [None, (True,), (True, b"\x00" * 7, b""), (True, b"\x00" * 8, b"\x00\x01"), "window"],
)
def test_a_malformed_window_on_the_wire_is_refused(wire: object) -> None:
    with pytest.raises(ValueError):
        Window.from_wire(wire)


@pytest.mark.parametrize("wire", [("turn",), (3, 1), ("turn", "3"), "turn"])
def test_a_malformed_agent_window_on_the_wire_is_refused(wire: object) -> None:
    with pytest.raises(ValueError):
        AgentWindow.from_wire(wire)


def test_the_digest_memo_gives_the_digests_in_full_and_stays_bounded() -> None:
    memo = DigestMemo(max_entries=3)
    plain = {"role": "user", "content": "fix the parser"}
    marked = {**plain, "cache_control": {"type": "ephemeral"}}
    parts = {"role": "user", "content": [{"type": "text", "text": "fix the parser"}]}
    calls = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}
    for message in (plain, dict(plain), marked, parts, calls):
        assert memo.digest(message) == digest(message)
    assert memo.digest(plain) == memo.digest(parts) == memo.digest(marked)  # alike
    assert len(memo) == 1  # the plain message once; the others are digested in full
    for n in range(5):
        assert memo.digest({"role": "user", "content": f"turn {n}"}) == digest(
            {"role": "user", "content": f"turn {n}"}
        )
    assert len(memo) == 3
    window = [plain, {"role": "assistant", "content": "done"}]
    assert Window.of(window, None, memo) == Window.of(window, None)
    with pytest.raises(ValueError):
        DigestMemo(max_entries=0)
