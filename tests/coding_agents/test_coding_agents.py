"""Claude Code, the Codex CLI and opencode, unmodified, against the plugin: their compactions
release the old window with no hook, and nothing else releases (see docs/coding-agents.md)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from vllm_affinity.core.compaction import VERDICTS
from vllm_affinity.testing import VLLMServer

from .conftest import (
    SCRIPTED_ANSWERS,
    ClaudeCode,
    CodexCli,
    Delta,
    InteractiveClaudeCode,
    InteractiveQwenCode,
    OpenCode,
    quiet,
)
from .scripted_answers import ask_empty, pending, script


def released(delta: Delta) -> int:
    return delta["block_released_compaction"]


def settled(delta: Delta) -> dict[str, int]:
    """What a rewrite's step changed: one release, the side branch's dead part with the main
    thread's (``PoolAffinity.release_rewritten``)."""
    return delta.changed()


def freed_share(delta: Delta, at_least: int) -> float:
    """The share of a compaction's dead blocks it released, by the engine's audit (the cached
    blocks of the old window and its side branches, their instructions aside, whose hash the
    new window does not hold); the audit must have found ``at_least`` of them."""
    dead = delta["compaction_blocks_dead"]
    assert dead >= at_least, (dead, at_least, delta.changed())
    return delta["compaction_dead_released"] / dead


def compact_and_go_on(agent: ClaudeCode, watch: Callable[[], Delta], topic: str) -> list[Delta]:
    """Two turns, ``/compact``, two turns more (headless): what each call changed. The plugin
    sees the same requests with Claude Code's session header or without it."""
    watch()
    steps = []
    for prompt in (
        f"first question about {topic}",
        "second question about the plan",
        "/compact",
        "third question after compaction",
        "fourth question",
    ):
        answer = agent.ask(prompt)
        steps.append(watch())
        steps[-1].answer = answer
    return steps


def check_compact_and_go_on(steps: list[Delta]) -> int:
    """The verdicts of ``compact_and_go_on``'s calls; the blocks the rewrite released."""
    first, second, compact, rewrite, plain = steps
    assert first["windows.first"] == 1, first.changed()
    assert second["windows.append"] >= 1
    assert released(second) == 0 and second["releases"] == 0  # a turn that only appends
    assert compact["windows.append"] >= 1  # the summary request appends to the window
    assert released(compact) == 0 and compact["releases"] == 0
    assert rewrite["windows.rewrite"] == 1 and rewrite["releases_compaction"] in (1, 2), settled(
        rewrite
    )
    assert released(rewrite) > 50, rewrite.after  # the old window's blocks
    assert released(plain) == 0 and plain["releases"] == 0
    # the new window's prefix was kept: the next turn reads nearly all of it from the cache
    window = rewrite.answer["usage"]
    kept = window["input_tokens"] + window["cache_read_input_tokens"]
    kept += window["cache_creation_input_tokens"]
    later = plain.answer["usage"]
    assert later["cache_read_input_tokens"] >= kept - 64, (window, later)
    assert sum(step["released_hit"] for step in steps) == 0, [s.changed() for s in steps]
    share = freed_share(rewrite, released(rewrite))
    print(f"Claude Code's /compact: {share:.1%} of the dead blocks released")
    assert share >= 0.95, rewrite.changed()
    return released(rewrite)


def test_claude_code_compact_releases_the_old_window_and_nothing_else(
    claude_code: ClaudeCode,
    claude_code_behind_vllm_router: ClaudeCode,
    watch: Callable[[], Delta],
) -> None:
    """Bound from its header, and behind vLLM's router (which forwards no header on
    ``/v1/messages``) as a session the plugin infers: the same verdicts, the same release.
    Every answer is one of its own, as a real model's are: an answer two conversations gave
    alike links neither (``core/answer_chains.py``), and the agents that name no session,
    tested on this server after this test, are linked by their answers."""
    script(SCRIPTED_ANSWERS, unique=True)
    try:
        named = compact_and_go_on(claude_code, watch, "the weather")
        unnamed = compact_and_go_on(claude_code_behind_vllm_router, watch, "the tides")
    finally:
        script(SCRIPTED_ANSWERS, unique=False)
    assert named[0]["sessions"] >= 1 and named[0]["implicit.started"] == 0  # its header
    with_header = check_compact_and_go_on(named)
    assert unnamed[0]["implicit.started"] == 1, unnamed[0].changed()  # no header came through
    assert all(step["implicit.started"] == 0 for step in unnamed[1:]), [
        s.changed() for s in unnamed
    ]
    without_header = check_compact_and_go_on(unnamed)
    print(f"released at the rewrite: {with_header} with the header, {without_header} without")
    # the rendering differs only in the question's words: the release is the same to a block
    # or two of the answers' lengths
    assert abs(without_header - with_header) <= 4, (with_header, without_header)


def test_claude_code_interactive_side_requests_stay_apart_and_compact_releases(
    interactive_claude_code: InteractiveClaudeCode,
    agents_server: VLLMServer,
    watch: Callable[[], Delta],
) -> None:
    agent = interactive_claude_code
    watch()
    agent.type("first question about the weather", "summary ok.")
    agent.type("second question about the plan", "summary ok.")
    quiet(agents_server)
    turns = watch()
    # the side request is the session-title request (no tools, a JSON schema); Claude Code
    # repeats it each turn until one answer parses as a title, which with a random model may
    # happen on the first turn. Whichever of the first turn's two requests came first, both are
    # bound apart (first and side, or first twice) and nothing is rewritten or released.
    assert turns["windows.first"] + turns["windows.side"] >= 2, turns.after
    assert turns["windows.append"] >= 1, turns.after
    assert turns["windows.rewrite"] == 0 and turns["releases"] == 0, turns.after

    ask_empty(SCRIPTED_ANSWERS)  # the summary's first answer is empty: Claude Code asks again
    agent.type("/compact", "Compacted")
    quiet(agents_server)
    compact = watch()
    assert pending(SCRIPTED_ANSWERS) == 0

    agent.type("third question after compaction", "summary ok.")
    quiet(agents_server)
    rewrite = watch()
    assert rewrite["windows.rewrite"] == 1 and rewrite["releases_compaction"] in (1, 2), settled(
        rewrite
    )
    assert released(rewrite) > 50, rewrite.after

    hits = agents_server.metric("vllm:prefix_cache_hits_total")
    queries = agents_server.metric("vllm:prefix_cache_queries_total")
    agent.type("fourth question", "summary ok.")
    quiet(agents_server)
    plain = watch()
    # the turn's title request settles the one the compaction left (its own prompt kept)
    assert plain["windows.rewrite"] == 0 and plain["releases"] <= 1, plain.changed()
    # both of the turn's requests read nearly all of their prompts from the cache
    hit = agents_server.metric("vllm:prefix_cache_hits_total") - hits
    assert hit >= 0.9 * (agents_server.metric("vllm:prefix_cache_queries_total") - queries)
    # the side requests told the engine they ended (their answers are cut off: no finish
    # signal), and the main thread after its answer; each idle was judged on a known session
    # (acted on, or not: the session came straight back, the idle guard). Claude Code sends
    # the title request only until one answer parses as a title (with a random model, at any
    # turn): the turn's requests are its window verdicts, and up to two of them idle
    requests = sum(plain[f"windows.{verdict}"] for verdict in VERDICTS)
    assert plain["idles"] >= min(2, requests), plain.changed()
    assert plain["idles_unknown_session"] == 0, plain.after
    # nothing released was needed again: the title request's own prompt was kept
    assert sum(step["released_hit"] for step in (turns, compact, rewrite, plain)) == 0


def test_codex_compaction_releases_the_old_window_and_nothing_else(
    codex_cli: CodexCli, watch: Callable[[], Delta]
) -> None:
    watch()
    codex_cli.ask("first question about the weather")
    first = watch()
    assert first["windows.first"] == 1 and first["sessions"] >= 1
    codex_cli.ask("second question about the plan")
    plain = watch()
    assert plain["windows.append"] == 1 and plain["windows.side"] == 0
    assert released(plain) == 0 and plain["releases"] == 0

    compacted = codex_cli.ask("third question", compact_at=5000)  # compacts before the turn
    rewrite = watch()
    assert rewrite["windows.side"] == 1  # the compaction request: a side branch
    # one release, decided at the rewrite: the old window's dead blocks, and its compaction
    # request's past what the next one sends again (the developer prompt, the environment and
    # the user's turns, which the compacted window carries)
    assert rewrite["windows.rewrite"] == 1 and rewrite["releases_compaction"] == 1, settled(rewrite)
    assert released(rewrite) >= 1, rewrite.after
    # the audit counts what the compaction request's next one sends again as dead and kept
    share = freed_share(rewrite, released(rewrite))
    print(f"the Codex CLI's compaction: {share:.1%} of the dead blocks (by hash) released")

    later = codex_cli.ask("fourth question")
    after = watch()
    assert released(after) == 0 and after["releases"] == 0
    # the new window's prefix was kept: the next turn reads nearly all of it from the cache
    assert later["cached_input_tokens"] >= later["input_tokens"] - 64, (compacted, later)
    # every finished turn told the engine, on a known session (acted on or not: the idle guard)
    assert after["idles"] >= 1 and after["idles_unknown_session"] == 0, after.after

    codex_cli.ask("fifth question", compact_at=5000)  # the second window compacts
    again = watch()
    # the second compaction request hits what the first rewrite kept of the first one; the
    # rewrite releases the second window and the second compaction request's dead part
    assert again["windows.rewrite"] == 1 and again["releases_compaction"] == 1, again.changed()
    assert released(again) >= 1, again.changed()
    steps = (first, plain, rewrite, after, again)
    assert sum(step["released_hit"] for step in steps) == 0, [s.changed() for s in steps]


WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa")


def question(number: int, words: int = 300) -> str:
    """A turn of about ``7 * words`` characters (~2k tokens of the test model), its own text."""
    body = " ".join(f"{WORDS[(number + j) % len(WORDS)]}{j}" for j in range(words))
    return f"question {number}: {body}"


def blocks_of(server: VLLMServer, text: str) -> int:
    """Whole 32-token blocks ``text`` fills as a user message: at least what its death frees."""
    return len(server.tokenize([{"role": "user", "content": text}])) // 32 - 1


def test_opencode_compactions_release_the_old_window_and_nothing_else(
    opencode: OpenCode, agents_server: VLLMServer, watch: Callable[[], Delta]
) -> None:
    watch()
    session = opencode.new_session()
    first = question(0)
    opencode.say(session, first)
    turn = watch()
    # the title request (no tools, its own system prompt) and the turn: bound, nothing released
    assert turn["windows.first"] + turn["windows.side"] >= 2 and turn["sessions"] >= 1, turn.after
    assert turn["releases"] == 0

    opencode.summarize(session)  # compacting right after the first turn
    summary = watch()
    assert summary["windows.side"] == 1 and summary["releases"] == 0, summary.after

    after = opencode.say(session, "second question about the plan")
    rewrite = watch()
    # the new window keeps only the system prompt and tools: the first turn is dead, and so is
    # the summarizer request's copy of it (its own system prompt kept), in the same release
    assert rewrite["windows.rewrite"] == 1 and rewrite["releases_compaction"] == 1, settled(rewrite)
    assert released(rewrite) >= 2 * blocks_of(agents_server, first), rewrite.after
    share = freed_share(rewrite, 2 * blocks_of(agents_server, first))
    print(f"opencode's summarize: {share:.1%} of the dead blocks released")
    assert share >= 0.95, rewrite.changed()
    name = "vllm_affinity_engine_compaction_dead_blocks_total"  # the same audit on /metrics
    deadline = time.monotonic() + 10  # its engine snapshot is refreshed every 2 s
    while agents_server.metric(name, outcome="released") < rewrite["compaction_dead_released"]:
        assert time.monotonic() < deadline, [
            k for k in agents_server.metrics() if "affinity_engine" in k
        ]
        time.sleep(0.5)

    later = opencode.say(session, "third question")
    plain = watch()
    assert plain["windows.append"] >= 1 and plain["releases"] == 0, plain.after
    # the compacted window's prefix was kept: the next turn reads nearly all of it from the cache
    assert later["tokens"]["cache"]["read"] >= after["tokens"]["input"] - 64, (after, later)
    steps = (turn, summary, rewrite, plain)
    assert sum(step["released_hit"] for step in steps) == 0, [s.changed() for s in steps]


def test_opencode_auto_compaction_releases_the_old_window_and_nothing_else(
    opencode: OpenCode, agents_server: VLLMServer, watch: Callable[[], Delta]
) -> None:
    session = opencode.new_session()
    opencode.say(session, "first question about the weather")
    watch()
    compacted, asked = 0, []
    for number in range(1, 6):  # each turn adds ~2k tokens: opencode compacts on its own
        asked.append(question(number))
        opencode.say(session, asked[-1])
        turn = watch()
        if opencode.compactions(session) == compacted:
            assert turn["windows.append"] >= 1 and turn["releases"] == 0, turn.after
            continue
        compacted += 1
        # its summary request (a side branch), then the window that goes on from the summary
        assert turn["windows.side"] >= 1 and turn["windows.rewrite"] == 1, turn.after
        # the old window's turns, and the summary request's copy of them
        dead = sum(blocks_of(agents_server, text) for text in asked[:-1])
        assert released(turn) >= 2 * dead, (dead, turn.after)
        share = freed_share(turn, 2 * dead)
        print(f"opencode's auto compaction: {share:.1%} of the dead blocks released")
        assert share >= 0.95, turn.changed()
        assert turn["released_hit"] == 0, turn.changed()
        break  # one is enough here: the turns after a compaction are the other test's
    assert compacted == 1


#: Qwen Code marks each answer on its screen (and its compressions) with this.
ANSWER = "\u25c6"


@pytest.mark.long  # ~2.5 minutes; make test runs the same agent's /compress without metadata
def test_qwen_code_interactive_compress_releases_and_side_requests_stay_apart(
    interactive_qwen_code: InteractiveQwenCode,
    agents_server: VLLMServer,
    watch: Callable[[], Delta],
) -> None:
    agent = interactive_qwen_code
    watch()
    agent.type("first question about the weather", ANSWER)
    quiet(agents_server)
    first = watch()
    # bound from its request metadata; its memory extractor (another system prompt, its own
    # tools) and its next-prompt suggestion are side branches
    assert first["windows.first"] == 1 and first["windows.side"] >= 1, first.after
    assert first["releases"] == 0, first.after

    second_question = question(1)
    agent.type(second_question, ANSWER)
    quiet(agents_server)
    second = watch()
    assert second["windows.append"] == 1 and second["windows.rewrite"] == 0, second.after
    assert second["releases"] == 0, second.after

    agent.type("/compress", "compressed")
    quiet(agents_server)
    compress = watch()
    assert compress["windows.side"] >= 1 and compress["releases"] == 0, compress.after

    agent.type("third question after compression", ANSWER)
    quiet(agents_server)
    rewrite = watch()
    assert rewrite["windows.rewrite"] == 1 and rewrite["releases_compaction"] in (1, 2), settled(
        rewrite
    )
    assert released(rewrite) >= blocks_of(agents_server, second_question), rewrite.after

    agent.type("fourth question", ANSWER)
    quiet(agents_server)
    plain = watch()
    assert plain["windows.append"] == 1 and plain["releases"] == 0, plain.after
    # nothing released was needed again: the memory extractor's own prompt was kept
    assert plain["released_hit"] + rewrite["released_hit"] == 0, (rewrite.after, plain.after)


def test_claude_code_empty_answers_are_retried_and_release_only_what_is_dead(
    claude_code: ClaudeCode, watch: Callable[[], Delta]
) -> None:
    """The model answers a turn empty, then a compaction's summary empty: Claude Code retries
    each (its retry changes the last user message; its second summary request merges the
    summary instruction into it). Every call succeeds, the retry releases nothing, and nothing
    released is ever needed again."""
    watch()
    claude_code.ask("first question about the weather")
    first = watch()
    assert first["windows.first"] == 1 and first["releases"] == 0
    ask_empty(SCRIPTED_ANSWERS)
    claude_code.ask("second question about the plan")
    empty = watch()
    assert pending(SCRIPTED_ANSWERS) == 0  # the model did answer empty
    assert empty["windows.retry"] == 1 and empty["windows.rewrite"] == 0, empty.after
    assert empty["releases"] == 0, empty.after
    claude_code.ask("third question")
    after = watch()  # goes on from the retry: the replaced message is dead (within a block)
    assert after["windows.append"] == 1 and released(after) <= 1, after.after

    ask_empty(SCRIPTED_ANSWERS)
    claude_code.ask("/compact")
    compact = watch()
    assert pending(SCRIPTED_ANSWERS) == 0
    claude_code.ask("fourth question after compaction")
    rewrite = watch()
    assert rewrite["windows.rewrite"] == 1 and rewrite["releases_compaction"] in (1, 2), settled(
        rewrite
    )
    assert released(compact) + released(rewrite) > 50, (compact.after, rewrite.after)
    claude_code.ask("fifth question")
    later = watch()
    assert later["releases"] == 0, later.after
    # nothing released was needed again
    steps = (first, empty, after, compact, rewrite, later)
    assert sum(step["released_hit"] for step in steps) == 0, later.after


def test_codex_short_turns_auto_compact_and_release_nothing_live(
    codex_cli: CodexCli, watch: Callable[[], Delta]
) -> None:
    """``model_auto_compact_token_limit = 8000`` (a documented setting; small local models
    compact early) with short turns: Codex compacts every few turns. Each compaction releases
    the old window's dead blocks; what the next compaction request sends again (Codex's
    developer items, its environment context, the user's turns) is never among them."""
    watch()
    steps = []
    for number in range(1, 5):
        codex_cli.ask(f"question {number} about the plan", compact_at=8000)
        steps.append(watch())
    rewrites = sum(step["windows.rewrite"] for step in steps)
    assert rewrites >= 2, [s.changed() for s in steps]
    assert sum(released(step) for step in steps) > 0, [s.changed() for s in steps]
    assert sum(step["released_hit"] for step in steps) == 0, [s.changed() for s in steps]
