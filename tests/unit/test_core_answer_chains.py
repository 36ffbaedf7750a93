"""The implicit sessions' pure core: windows linked to conversations by the answers they carry."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_affinity.core.answer_chains import (
    CHAIN_PREFIX,
    NO_INSTRUCTIONS,
    PROBE_CHARS,
    PROBES,
    SCAN_CHARS,
    Answer,
    AnswerChains,
    ChainWindow,
    probes,
)
from vllm_affinity.core.compaction import CompactionRule, Window

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
    first, outcome = chains.chain_of("p", window(user("fix the bug")))
    assert first.startswith(CHAIN_PREFIX) and outcome == "started"
    chains.record("p", first, Answer("", ("call_1",)))
    turn = [user("fix the bug"), *called("call_1")]
    assert chains.chain_of("p", window(*turn)) == (first, "continued")
    chains.record("p", first, Answer("Fixed: the loop was off by one."))
    turn += [said("Fixed: the loop was off by one."), user("thanks, now the tests")]
    assert chains.chain_of("p", window(*turn)) == (first, "continued")
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
        assert chains.chain_of("p", window(user("same task"), *called(f"call_{n}"))) == (
            name,
            "continued",
        )
    chains.record("p", names[0], Answer("The same words."))
    chains.record("p", names[1], Answer("The same words."))
    alike = window(user("same task"), *called("call_0"), said("The same words."), user("go on"))
    chain, outcome = chains.chain_of("p", alike)
    assert outcome == "started" and chain not in names  # not joined to either


def test_other_instructions_make_a_side_request_and_another_principal_a_chain() -> None:
    """A window that carries a chain's answer under other instructions (a summarizer, Qwen
    Code's compression request, a tool-less request) is that chain's side request: it never
    becomes the chain's window. Another tenant's window starts a chain of its own."""
    chains = AnswerChains()
    main, _ = chains.chain_of("p", window(user("task")))
    chains.record("p", main, Answer("An answer to the task."))
    carried = [user("task"), said("An answer to the task."), user("more")]
    assert chains.chain_of("p", window(*carried)) == (main, "continued")
    assert chains.chain_of("p", window(*carried, tools=None)) == (main, "side")
    other = ChainWindow.of([{"role": "system", "content": "Summarize."}, *carried], TOOLS)
    assert chains.chain_of("p", other) == (main, "side")
    assert chains.chain_of("q", window(*carried))[1] == "started"  # another tenant


def test_an_assistant_message_the_server_never_wrote_is_passed_over() -> None:
    """aider's "Ok." after its summary, Qwen Code's "Got it": the answer before it links."""
    chains = AnswerChains()
    main, _ = chains.chain_of("p", window(user("task")))
    chains.record("p", main, Answer("A real answer."))
    later = window(user("task"), said("A real answer."), user("x"), said("Ok."), user("y"))
    assert chains.chain_of("p", later) == (main, "continued")


SUMMARY = (
    "<analysis>\nThe user wants the parser fixed; I read parser.py and the failing test, "
    "then traced the off-by-one to the tokenizer loop.\n</analysis>\n<summary>\n"
    "1. Primary request: fix the JSON parser so that nested arrays parse.\n"
    "2. Files: parser.py (the tokenizer loop), tests/test_parser.py (the failing case).\n"
    "3. Done so far: the loop bound fixed, one test added, the suite green but for one.\n"
    "4. Next step: make test_nested_empty pass, then run the whole suite again.\n</summary>"
)


def stripped(summary: str) -> str:
    """What Qwen Code and Claude Code put in the new window: the analysis cut, the rest
    trimmed, re-wrapped, between a preamble and a trailer."""
    body = summary.split("</analysis>", 1)[1].strip()
    return (
        "This session continues an earlier one. Summary:\n\n"
        + body.replace(", ", ",\n  ")
        + "\n\nResume the prior task using the summary above."
    )


def test_a_summary_cut_and_rewrapped_continues_the_chain_that_wrote_it() -> None:
    """The new window after a compaction carries a middle stretch of the summary, never its
    opening (its analysis block cut), re-wrapped and framed: it continues the chain."""
    chains = AnswerChains()
    main, _ = chains.chain_of("p", window(user("task")))
    chains.record("p", main, Answer(SUMMARY))
    compacted = window(user(stripped(SUMMARY)), said("Got it. Thanks!"), user("next step"))
    assert chains.chain_of("p", compacted) == (main, "continued")
    elsewhere = ChainWindow.of([{"role": "system", "content": "Other."}, user(SUMMARY)], TOOLS)
    assert chains.chain_of("p", elsewhere)[1] == "started"  # its instructions are not the chain's
    assert chains.chain_of("q", compacted)[1] == "started"  # another tenant's


def test_a_short_answer_or_one_stretch_does_not_link() -> None:
    """An answer shorter than a stretch links by no stretch; a longer one needs two of its
    stretches found (one quoted sentence is not a compaction)."""
    chains = AnswerChains()
    main, _ = chains.chain_of("p", window(user("task")))
    short = "Done."
    chains.record("p", main, Answer(short))
    assert len(short) < PROBE_CHARS and probes(short) == ()
    assert chains.chain_of("p", window(user(f"Context: {short}")))[1] == "started"
    chains.record("p", main, Answer(SUMMARY))
    one = probes(SUMMARY)[3]
    assert chains.chain_of("p", window(user(f"Quoting: {one}")))[1] == "started"
    assert len(probes(SUMMARY)) == min(PROBES, len(" ".join(SUMMARY.split())) // PROBE_CHARS)


def test_a_stretch_two_conversations_answered_links_neither() -> None:
    """Two sessions whose summaries share their text (one template, the same facts): a
    window that carries it joins neither."""
    chains = AnswerChains()
    first, _ = chains.chain_of("p", window(user("task one")))
    second, _ = chains.chain_of("p", window(user("task two")))
    chains.record("p", first, Answer(SUMMARY))
    chains.record("p", second, Answer(SUMMARY + " And more."))
    chain, outcome = chains.chain_of("p", window(user(stripped(SUMMARY))))
    assert outcome == "started" and chain not in (first, second)


def test_a_side_prompt_whose_answer_never_came_back_is_learned() -> None:
    """Qwen Code's next-prompt suggestion: the conversation and one fixed user message,
    answered and dropped. The next turn drops it without carrying its answer: the message is
    learned, and from then on a window ending with it is a side request of its chain."""
    chains = AnswerChains()
    suggest = user("[SUGGESTION MODE: Suggest what the user might naturally type next.]")
    main, _ = chains.chain_of("p", window(user("task")))
    chains.record("p", main, Answer("First answer."))
    turn = [user("task"), said("First answer.")]
    assert chains.chain_of("p", window(*turn, suggest)) == (main, "continued")  # not known yet
    chains.record("p", main, Answer("run the tests"))
    turn += [user("now the tests")]
    assert chains.chain_of("p", window(*turn)) == (main, "continued")
    chains.record("p", main, Answer("Second answer."))
    turn += [said("Second answer.")]
    assert chains.chain_of("p", window(*turn, suggest)) == (main, "side")
    chains.record("p", main, Answer("commit it"), main=False)
    assert chains.chain_of("p", window(*turn, user("commit"))) == (main, "continued")


@pytest.mark.parametrize("answer", ["never", "late"])
def test_a_side_prompt_given_up_on_is_learned_too(answer: str) -> None:
    """The suggestion's answer is not in when the next turn comes: Qwen Code aborts it when the
    user types on (``never``), or the server records it after the next window was linked
    (``late``). The next turn drops its message all the same: it is learned, whatever the
    timing, and the next suggestion is a side request."""
    chains = AnswerChains()
    suggest = user("[SUGGESTION MODE: Suggest what the user might naturally type next.]")
    main, _ = chains.chain_of("p", window(user("task")))
    chains.record("p", main, Answer("First answer."))
    turn = [user("task"), said("First answer.")]
    assert chains.chain_of("p", window(*turn, suggest)) == (main, "continued")  # not known yet
    turn += [user("now the tests")]
    assert chains.chain_of("p", window(*turn)) == (main, "continued")  # the suggestion's gone
    if answer == "late":
        chains.record("p", main, Answer("run the tests"))
    chains.record("p", main, Answer("Second answer."))
    turn += [said("Second answer.")]
    assert chains.chain_of("p", window(*turn, suggest)) == (main, "side")
    assert chains.chain_of("p", window(*turn, user("commit"))) == (main, "continued")


def test_a_regenerated_answer_teaches_nothing() -> None:
    """A chat UI's regenerate re-sends the same window (its last user message kept, the
    answer not carried): the same chain, and no side prompt learned, so the user's next
    message is the chain's window even when it repeats an earlier one."""
    chains = AnswerChains()
    main, _ = chains.chain_of("p", window(user("hello")))
    chains.record("p", main, Answer("Hello!"))
    turn = [user("hello"), said("Hello!"), user("and then?")]
    assert chains.chain_of("p", window(*turn)) == (main, "continued")
    chains.record("p", main, Answer("Then this."))
    assert chains.chain_of("p", window(*turn)) == (main, "continued")  # regenerate
    chains.record("p", main, Answer("Then that."))
    turn += [said("Then that."), user("and then?")]
    assert chains.chain_of("p", window(*turn)) == (main, "continued")


def test_text_parts_and_strings_link_alike() -> None:
    chains = AnswerChains()
    main, _ = chains.chain_of("p", window(user("task")))
    chains.record("p", main, Answer("  Hello there.\n"))
    parts = {"role": "assistant", "content": [{"type": "text", "text": "Hello there."}]}
    assert chains.chain_of("p", window(user("task"), parts, user("more"))) == (main, "continued")


def test_the_table_is_bounded() -> None:
    chains = AnswerChains(max_chains=2, max_links=3)
    names = [chains.chain_of("p", window(user(f"task {n}")))[0] for n in range(3)]
    assert len(chains) == 2
    chains.record("p", names[0], Answer("forgotten chain"))  # its chain is gone: nothing kept
    forgotten = window(user("task 0"), said("forgotten chain"), user("x"))
    assert chains.chain_of("p", forgotten)[1] == "started"
    for n in range(4):
        chains.record("p", names[2], Answer("", (f"id{n}",)))
    # a call's id links even before any user message (vLLM's own, never an app's greeting)
    assert chains.chain_of("p", window(*called("id3"))) == (names[2], "continued")
    assert chains.chain_of("p", window(*called("id0")))[1] == "started"  # the oldest link out


def test_wire_round_trips_and_rejects_garbage() -> None:
    win = window(user("task"), *called("c1"), said("text"))
    assert ChainWindow.from_wire(win.to_wire()) == win
    answer = Answer("text", ("c1", "c2"))
    assert Answer.from_wire(answer.to_wire()) == answer
    for garbage in (None, 3, ("a",), ("a", "b", "c", "d", "e")):
        with pytest.raises(ValueError):
            ChainWindow.from_wire(garbage)
    for garbage in (None, 3, ("a",), ("a", "b", "c")):
        with pytest.raises(ValueError):
            Answer.from_wire(garbage)
    with pytest.raises(ValueError):
        AnswerChains(max_chains=0)


def test_the_wire_carries_what_linking_reads_and_no_more() -> None:
    """With several API servers every id-less window crosses to the engine: its user messages
    go as (length, link) keys, and only the leading text a stretch is searched in, none for a
    window without instructions (no stretch links it)."""
    long = " ".join(f"word{n}" for n in range(40_000))  # ~300k characters
    heavy = window(user(long), said("text"), user(long))
    wire = repr(heavy.to_wire())
    assert len(wire) < SCAN_CHARS + 1_000
    assert ChainWindow.from_wire(heavy.to_wire()) == heavy
    bare = ChainWindow.of([user(long), said("text"), user("again")], None)
    assert bare.instructions == NO_INSTRUCTIONS and bare.scan == ""
    assert len(repr(bare.to_wire())) < 500
    assert bare.last_user() == (5, bare.user_keys[-1][1])


def test_only_the_windows_leading_user_text_is_searched() -> None:
    """A summary opens a compacted window; a stretch found only past ``SCAN_CHARS`` characters
    of user text (a long first request, a one-shot prompt) links nothing: the search's cost is
    bounded whatever the window's length."""
    from vllm_affinity.core.answer_chains import SCAN_CHARS

    chains = AnswerChains()
    main, _ = chains.chain_of("p", window(user("task")))
    chains.record("p", main, Answer(SUMMARY))
    padding = user("x " * SCAN_CHARS)
    assert chains.chain_of("p", window(user(stripped(SUMMARY)), padding))[0] == main
    assert chains.chain_of("p", window(padding, user(stripped(SUMMARY))))[1] == "started"


def chat(messages: list[dict[str, Any]], tools: Any = None) -> ChainWindow:
    """A chat UI's window: no system prompt, no tools (Open WebUI's and LibreChat's default)."""
    return ChainWindow.of(messages, tools)


def test_a_window_with_neither_tools_nor_a_leading_system_message_has_no_instructions() -> None:
    for tools in (None, []):
        assert chat([user("hi")], tools).instructions == NO_INSTRUCTIONS
    assert chat([user("hi")], TOOLS).instructions != NO_INSTRUCTIONS
    assert window(user("hi"), tools=None).instructions != NO_INSTRUCTIONS
    developer = {"role": "developer", "content": "Be brief."}
    assert chat([developer, user("hi")]).instructions != NO_INSTRUCTIONS


def test_a_task_request_quoting_an_instruction_less_chat_starts_a_chain_of_its_own() -> None:
    """Open WebUI's title and follow-up requests: one user message quoting the chat's last
    messages, no system prompt, no tools, as the chat's own windows have none. Instructions
    that are none tell no conversation from another: no stretch links such a window (linked,
    it continued the chat and the compaction rule judged it a rewrite, releasing the live
    chat). The chat goes on as one chain, each window an append."""
    chains, rule = AnswerChains(), CompactionRule()
    history = [user("Why does my parser fail on nested arrays?")]
    main, outcome = chains.chain_of("p", chat(history))
    assert outcome == "started" and rule.classify(main, Window.of(history, None)) == "first"
    chains.record("p", main, Answer(SUMMARY))  # a long answer: stretches to find
    history += [said(SUMMARY), user("Which file first?")]
    assert chains.chain_of("p", chat(history)) == (main, "continued")
    assert rule.classify(main, Window.of(history, None)) == "append"
    quoted = "\n".join(f"{m['role'].upper()}: {m['content']}" for m in history[-2:])
    task = user(f"### Task:\nA 3-5 word title.\n<chat_history>\n{quoted}\n</chat_history>")
    for tools in (None, []):
        chain, outcome = chains.chain_of("p", chat([task], tools))
        assert outcome == "started" and chain != main
    chains.record("p", main, Answer("parser.py, the tokenizer loop."))
    history += [said("parser.py, the tokenizer loop."), user("Thanks.")]
    assert chains.chain_of("p", chat(history)) == (main, "continued")
    assert rule.classify(main, Window.of(history, None)) == "append"  # nothing of it released


def test_another_chats_answer_pasted_into_an_instruction_less_chat_links_nothing() -> None:
    """A user pastes an earlier chat's answer into a new chat of a chat UI (no system prompt,
    no tools): a new chain, the earlier chat left whole. Under a system prompt the earlier
    chat's instructions are the window's, and the paste still reads as its compaction."""
    chains = AnswerChains()
    earlier, _ = chains.chain_of("p", chat([user("Why does my parser fail?")]))
    chains.record("p", earlier, Answer(SUMMARY))
    pasted = user(f"A friend got this answer, is it right?\n{SUMMARY}")
    chain, outcome = chains.chain_of("p", chat([pasted]))
    assert outcome == "started" and chain != earlier
    instructed, _ = chains.chain_of("p", window(user("Why does my parser fail?")))
    chains.record("p", instructed, Answer(SUMMARY.upper()))
    assert chains.chain_of("p", window(user(SUMMARY.upper()))) == (instructed, "continued")


GREETING = "Hi! I am the shop's assistant. How can I help?"


@pytest.mark.parametrize("instructed", [False, True], ids=["chat", "system-and-tools"])
def test_a_greeting_that_opens_every_chat_links_none(instructed: bool) -> None:
    """An app opens each chat with one model-written greeting: an assistant message before any
    user message, the same in every user's chat. It answered nothing in these windows: it links
    none (linked, every chat joined the chain that wrote it). Each chat is a chain of its own,
    and its later windows continue it, linked by its own answers."""
    lead, tools = ([SYSTEM], TOOLS) if instructed else ([], None)
    chains = AnswerChains()
    writer, _ = chains.chain_of("p", ChainWindow.of([*lead, user("Write a greeting.")], tools))
    chains.record("p", writer, Answer(GREETING))
    names: list[str] = []
    for n in range(3):
        first = [*lead, said(GREETING), user(f"My order {n} is late.")]
        name, outcome = chains.chain_of("p", ChainWindow.of(first, tools))
        assert outcome == "started" and name not in (writer, *names)
        chains.record("p", name, Answer(f"Sorry: order {n} ships today."))
        names.append(name)
    for n, name in enumerate(names):
        later = [*lead, said(GREETING), user(f"My order {n} is late."),
                 said(f"Sorry: order {n} ships today."), user("Thanks.")]  # fmt: skip
        assert chains.chain_of("p", ChainWindow.of(later, tools)) == (name, "continued")


def test_two_users_with_the_same_first_message_and_the_same_answer_stay_apart() -> None:
    """Two users of a chat app (the greeting, no system prompt, no tools) type the same first
    message and get the same long answer: neither the greeting nor the answer both got links
    them, nor do its stretches, nor does a task request quoting one's chat; each one's own next
    answer links that user's chat alone."""
    chains = AnswerChains()
    writer, _ = chains.chain_of("p", chat([user("Write a greeting.")]))
    chains.record("p", writer, Answer(GREETING))
    opening = [said(GREETING), user("How do I return an item?")]
    firsts = [chains.chain_of("p", chat(opening)) for _ in range(2)]
    assert [o for _, o in firsts] == ["started", "started"]
    assert len({writer, *(c for c, _ in firsts)}) == 3
    for first, _ in firsts:
        chains.record("p", first, Answer(SUMMARY))  # the same answer, to each
    seconds = []
    for n in range(2):
        history = [*opening, said(SUMMARY), user(f"User {n}: and my order {n}?")]
        chain, outcome = chains.chain_of("p", chat(history))
        assert outcome == "started" and chain not in (writer, *(c for c, _ in firsts))
        chains.record("p", chain, Answer(f"Order {n} ships today."))
        seconds.append((chain, history))
    assert seconds[0][0] != seconds[1][0]
    for n, (chain, history) in enumerate(seconds):
        later = [*history, said(f"Order {n} ships today."), user("Thanks.")]
        assert chains.chain_of("p", chat(later)) == (chain, "continued")
        quoted = user("Title this chat:\n" + "\n".join(str(m["content"]) for m in later))
        assert chains.chain_of("p", chat([quoted]))[1] == "started"
