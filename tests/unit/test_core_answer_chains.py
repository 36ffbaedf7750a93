"""The implicit sessions' pure core: windows linked to conversations by the answers they carry."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_affinity.core.answer_chains import (
    CHAIN_PREFIX,
    MIN_OPENING,
    Answer,
    AnswerChains,
    ChainWindow,
)

SYSTEM = {"role": "system", "content": "You are a coding agent."}
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def said(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def called(call_id: str) -> list[dict[str, Any]]:
    call = {"id": call_id, "type": "function", "function": {"name": "read", "arguments": "{}"}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "file text"},
    ]


def window(*messages: dict[str, Any], tools: Any = TOOLS) -> ChainWindow:
    return ChainWindow.of([SYSTEM, *messages], tools)


def test_a_conversation_is_one_chain_through_its_tool_calls_and_texts() -> None:
    chains = AnswerChains()
    first, continued = chains.chain_of("p", window(user("fix the bug")))
    assert first.startswith(CHAIN_PREFIX) and not continued
    chains.record("p", first, Answer("", ("call_1",)))
    turn = [user("fix the bug"), *called("call_1")]
    assert chains.chain_of("p", window(*turn)) == (first, True)
    chains.record("p", first, Answer("Fixed: the loop was off by one."))
    turn += [said("Fixed: the loop was off by one."), user("thanks, now the tests")]
    assert chains.chain_of("p", window(*turn)) == (first, True)
    assert len(chains) == 1


def test_sessions_sharing_a_prompt_and_a_first_message_stay_apart() -> None:
    """Four sessions with one system prompt, tools and first message: the answers they carry
    back are theirs; an answer two of them got alike links neither."""
    chains = AnswerChains()
    names = [chains.chain_of("p", window(user("same task")))[0] for _ in range(4)]
    assert len(set(names)) == 4
    for n, name in enumerate(names):
        chains.record("p", name, Answer("", (f"call_{n}",)))
    for n, name in enumerate(names):
        assert chains.chain_of("p", window(user("same task"), *called(f"call_{n}"))) == (name, True)
    chains.record("p", names[0], Answer("The same words."))
    chains.record("p", names[1], Answer("The same words."))
    alike = window(user("same task"), *called("call_0"), said("The same words."), user("go on"))
    chain, continued = chains.chain_of("p", alike)
    assert not continued and chain not in names  # not joined to either: a chain of its own


def test_other_instructions_or_another_principal_start_a_chain() -> None:
    chains = AnswerChains()
    main, _ = chains.chain_of("p", window(user("task")))
    chains.record("p", main, Answer("An answer to the task."))
    carried = [user("task"), said("An answer to the task."), user("more")]
    assert chains.chain_of("p", window(*carried))[1]
    assert not chains.chain_of("p", window(*carried, tools=None))[1]  # another tool set
    other = ChainWindow.of([{"role": "system", "content": "Extract memories."}, *carried], TOOLS)
    assert not chains.chain_of("p", other)[1]
    assert not chains.chain_of("q", window(*carried))[1]  # another tenant


def test_an_assistant_message_the_server_never_wrote_is_passed_over() -> None:
    """aider's "Ok." after its summary, Qwen Code's "Got it": the answer before it links."""
    chains = AnswerChains()
    main, _ = chains.chain_of("p", window(user("task")))
    chains.record("p", main, Answer("A real answer."))
    later = window(user("task"), said("A real answer."), user("x"), said("Ok."), user("y"))
    assert chains.chain_of("p", later) == (main, True)


def test_a_summary_inside_a_user_message_continues_the_chain_that_wrote_it() -> None:
    chains = AnswerChains()
    main, _ = chains.chain_of("p", window(user("task")))
    summary = "<state_snapshot> the user asked to fix the parser; done so far: " + "x" * 40
    chains.record("p", main, Answer(summary))
    compacted = window(user(f"Context:\n{summary}"), said("Got it. Thanks!"), user("next step"))
    assert chains.chain_of("p", compacted) == (main, True)
    short = "Done."
    chains.record("p", main, Answer(short))
    assert len(short) < MIN_OPENING
    assert not chains.chain_of("p", window(user(f"Context: {short}")))[1]
    elsewhere = ChainWindow.of([{"role": "system", "content": "Other."}, user(summary)], TOOLS)
    assert not chains.chain_of("p", elsewhere)[1]


def test_text_parts_and_strings_link_alike() -> None:
    chains = AnswerChains()
    main, _ = chains.chain_of("p", window(user("task")))
    chains.record("p", main, Answer("  Hello there.\n"))
    parts = {"role": "assistant", "content": [{"type": "text", "text": "Hello there."}]}
    assert chains.chain_of("p", window(user("task"), parts, user("more"))) == (main, True)


def test_the_table_is_bounded() -> None:
    chains = AnswerChains(max_chains=2, max_links=3)
    names = [chains.chain_of("p", window(user(f"task {n}")))[0] for n in range(3)]
    assert len(chains) == 2
    chains.record("p", names[0], Answer("forgotten chain"))  # its chain is gone: nothing kept
    assert not chains.chain_of("p", window(said("forgotten chain"), user("x")))[1]
    for n in range(4):
        chains.record("p", names[2], Answer("", (f"id{n}",)))
    assert chains.chain_of("p", window(*called("id3"))) == (names[2], True)
    assert not chains.chain_of("p", window(*called("id0")))[1]  # the oldest link out


def test_wire_round_trips_and_rejects_garbage() -> None:
    win = window(user("task"), *called("c1"), said("text"))
    assert ChainWindow.from_wire(win.to_wire()) == win
    answer = Answer("text", ("c1", "c2"))
    assert Answer.from_wire(answer.to_wire()) == answer
    for garbage in (None, 3, ("a",), ("a", "b", "c", "d")):
        with pytest.raises(ValueError):
            ChainWindow.from_wire(garbage)
        with pytest.raises(ValueError):
            Answer.from_wire(garbage)
    with pytest.raises(ValueError):
        AnswerChains(max_chains=0)
