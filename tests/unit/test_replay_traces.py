"""The trace readers, writers and prompt synthesis of ``jiuwen_replay`` (pure: no server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jiuwen_hooks._diff import Window, canonical_window, diff_windows
from jiuwen_replay.formats import (
    FORMATS,
    WRITERS,
    TraceFormatError,
    read_trace,
)
from jiuwen_replay.prompts import WindowBuilder
from jiuwen_replay.synthetic import SyntheticConfig, generate
from jiuwen_replay.trace import (
    LONG_IDLE_S,
    Trace,
    TraceRequest,
    next_call_gaps,
    next_use_hints,
    transitions,
)


def structure(trace: Trace) -> list[tuple[str, str | None, list[str]]]:
    """Per session: name, parent and the transitions of its requests."""
    kinds = transitions(trace.requests)
    out: dict[str, tuple[str, str | None, list[str]]] = {}
    for request, kind in zip(trace.requests, kinds, strict=True):
        out.setdefault(request.session, (request.session, request.parent, []))[2].append(kind)
    return sorted(out.values())


def gaps(trace: Trace) -> list[float]:
    """Each request's time on its session's own clock, sessions in name order."""
    out: dict[str, list[float]] = {}
    for r in trace.requests:
        out.setdefault(r.session, []).append(r.at)
    return [t - ts[0] for _, ts in sorted(out.items()) for t in ts]


def sizes(trace: Trace) -> list[tuple[str, int]]:
    return sorted((r.session, len(r.blocks)) for r in trace.requests)


@pytest.mark.parametrize("fmt", ["project", "agentx", "agentinfer"])
def test_round_trip_keeps_sessions_parents_and_rewrites(tmp_path: Path, fmt: str) -> None:
    trace = generate(SyntheticConfig(sessions=3, calls_per_session=14))
    path = tmp_path / f"t.{fmt}.jsonl"
    WRITERS[fmt](trace, path)
    back = read_trace(path, fmt)
    assert structure(back) == structure(trace)
    assert len(back.requests) == len(trace.requests)
    assert gaps(back) == pytest.approx(gaps(trace), abs=0.01)  # each session's own clock
    assert "rewrite" in transitions(back.requests)  # compactions survive
    if fmt != "agentinfer":  # agentinfer keeps token counts only
        assert sizes(back) == sizes(trace)


def test_agentinfer_shares_each_role_system_prompt_and_compacts(tmp_path: Path) -> None:
    rows = [
        ("s1", "lead", "lead", 0, 1000),
        ("s1", "a1", "subagent", 1, 3000),
        ("s2", "lead", "lead", 2, 1100),
        ("s1", "lead", "lead", 3, 1500),
        ("s1", "lead", "lead", 4, 600),  # compacted
        ("s1", "a1", "subagent", 5, 0),  # a failed request: dropped
    ]
    with (tmp_path / "a.jsonl").open("w") as out:
        for session, actor, role, second, tokens in rows:
            row = {
                "session_id": session,
                "actor_id": actor,
                "actor_role": role,
                "started_at": f"2026-08-12T04:00:0{second}+00:00",
                "input_tokens": tokens or 5,
                "output_tokens": 7,
                "status": "error" if not tokens else "success",
            }
            out.write(json.dumps(row) + "\n")
    trace = read_trace(tmp_path / "a.jsonl", "agentinfer")
    lead1, sub, lead2, grown, compacted = trace.requests
    assert sub.session == "s1/a1" and sub.parent == "s1" and lead1.parent is None
    system = lead1.blocks[:7]  # 1000 // 128 blocks of the shortest first lead prompt
    assert lead2.blocks[:7] == system and lead2.blocks[7:] != lead1.blocks[7:]
    assert not set(sub.blocks) & set(lead1.blocks)
    assert grown.blocks[: len(lead1.blocks)] == lead1.blocks
    assert compacted.blocks[:7] == system and len(compacted.blocks) == 7  # 600 tokens: system
    assert {r.instructions for r in (lead1, lead2, grown, compacted)} == {7}
    assert sub.instructions == 3000 // 128
    assert transitions(trace.requests)[-1] == "rewrite"
    assert trace.notes["dropped_failed"] == 1 and trace.notes["compactions"] == 1


def test_mooncake_infers_turns_and_new_conversations_never_a_rewrite(tmp_path: Path) -> None:
    rows = [  # (hash ids, whether the last block is partial)
        ([0, 1, 2, 3], False),  # conversation A
        ([0, 7, 8], True),  # B (shares only the system block with A), last block partial
        ([0, 1, 2, 3, 4, 5], False),  # A's next turn
        ([0, 1, 2, 3, 9], False),  # keeps 4 of A's 6 blocks: maybe another conversation
        ([0, 7, 12, 13], False),  # B's next turn: its partial last block filled, more added
        ([0, 1, 11], False),  # a new conversation
    ]
    with (tmp_path / "m.jsonl").open("w") as out:
        for i, (ids, partial) in enumerate(rows):
            length = 512 * len(ids) - (100 if partial else 0)
            row = {"timestamp": i * 1000, "input_length": length, "output_length": 3}
            out.write(json.dumps({**row, "hash_ids": ids}) + "\n")
    trace = read_trace(tmp_path / "m.jsonl", "mooncake")
    sessions = [r.session for r in trace.requests]
    a, b = sessions[0], sessions[1]
    assert sessions[:5] == [a, b, a, sessions[3], b] and sessions[3] not in (a, b)
    assert sessions[5] not in (a, b, sessions[3])
    assert transitions(trace.requests) == ["first", "first", "append", "first", "rewrite", "first"]
    assert trace.block_tokens == 512 and trace.requests[1].at == 1.0
    assert trace.notes["sessions_inferred"] == {"continued": 2, "started": 4}


@pytest.mark.parametrize(
    ("fmt", "line", "message"),
    [
        ("mooncake", "not json", "not JSON"),
        ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 1}', "hash_ids"),
        ("mooncake", '{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
         "timestamp"),
        ("agentx", '{"id": "x", "block_size": 16, "requests": []}', "requests"),
        ("agentx", '{"id": "x", "block_size": 16, "hash_id_scope": "global", "requests": [1]}',
         "local"),
        ("agentinfer", '{"session_id": "s", "actor_id": "lead", "started_at": "yesterday", '
         '"input_tokens": 5}', "ISO"),
        ("project", '{"session": "s"}', "header"),
    ],
)  # fmt: skip
def test_bad_files_name_the_line(tmp_path: Path, fmt: str, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceFormatError, match=message) as error:
        read_trace(path, fmt)
    assert str(path) in str(error.value)


def test_missing_file_unknown_format_and_empty_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no such file"):
        read_trace(tmp_path / "nope.jsonl", "mooncake")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceFormatError, match="no requests"):
        read_trace(tmp_path / "empty.jsonl", "mooncake")
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        read_trace(tmp_path / "empty.jsonl", "csv")
    assert set(FORMATS) == set(WRITERS)


def test_windows_share_what_the_blocks_share_and_diff_like_an_agent() -> None:
    builder = WindowBuilder(tokens_per_block=4)
    first = builder.window((0, 1, 2, 3))
    grown = builder.window((0, 1, 2, 3, 4, 5))
    rewritten = builder.window((0, 1, 2, 3, 4, 9))
    other = builder.window((0, 1, 7))  # another session sharing the first two blocks
    assert grown[: len(first)] == first and len(grown) == len(first) + 1
    assert rewritten[: len(first)] == first and rewritten[-1] != grown[-1]
    assert "".join(m["content"] for m in other).startswith(builder.text(0) + builder.text(1))

    def diff(old: list, new: list):
        return diff_windows(Window(canonical_window(old)), Window(canonical_window(new)))

    assert diff(first, grown) is None  # an append releases nothing
    release = diff(grown, rewritten)
    assert release is not None and release.messages_released_index == len(first)
    # The same ids give the same words; another nonce (another run) gives other words.
    assert WindowBuilder(4).window((0, 1, 2, 3)) == first
    assert WindowBuilder(4, nonce=1).window((0, 1, 2, 3)) != first
    assert all(len(builder.text(b).split()) == 4 for b in range(10))


def test_instructions_are_one_system_message_shared_across_sessions() -> None:
    """With the trace's instruction blocks, every window starts with them as one system
    message, also the first session's first window (one message before), and a compaction
    down to them keeps it."""
    builder = WindowBuilder(tokens_per_block=4)
    first = builder.window((0, 1, 2, 3), instructions=2)
    assert [m["role"] for m in first] == ["system", "user"]
    assert first[0]["content"] == builder.text(0) + builder.text(1)
    other = builder.window((0, 1, 7, 8), instructions=2)  # another session, same instructions
    assert other[0] == first[0] and other[1] != first[1]
    grown = builder.window((0, 1, 2, 3, 4), instructions=2)
    assert grown[:2] == first and [m["role"] for m in grown[2:]] == ["user"]
    assert builder.window((0, 1), instructions=2) == [
        {"role": "user", "content": first[0]["content"]}
    ]
    # without the count, as before: user messages only
    assert {m["role"] for m in WindowBuilder(4).window((0, 1, 2, 3))} == {"user"}


def test_next_call_gaps_and_describe() -> None:
    trace = Trace(
        "project",
        16,
        (
            TraceRequest("a", 0.0, (1, 2), 5),
            TraceRequest("b", 1.0, (1, 3), 5, parent="a"),
            TraceRequest("a", 4.0, (1, 2, 4), 5),
        ),
    )
    assert next_call_gaps(trace.requests) == [4.0, None, None]
    info = trace.describe()
    assert info["sessions"] == 2 and info["subagents"] == 1 and info["duration_s"] == 4.0
    assert info["transitions"] == {"append": 1, "first": 2}
    with pytest.raises(ValueError, match="time order"):
        Trace("project", 16, tuple(reversed(trace.requests)))


def test_next_use_hints_by_signal() -> None:
    lead, sub = "lead", "lead/sub"
    trace = (
        TraceRequest(lead, 0.0, (1,), 5),  # spawns a subagent: waits on it, live
        TraceRequest(sub, 1.0, (2,), 5, parent=lead),  # 19 s to its next: a slow tool, live
        TraceRequest(sub, 20.0, (2, 3), 5, parent=lead),  # the subagent's last call: idle
        TraceRequest(lead, 30.0, (1, 4), 5),  # then waits 60 s on its user: idle
        TraceRequest(lead, 90.0, (1, 4, 5), 5),  # 3 s to its next call: a tool, live
        TraceRequest(lead, 93.0, (1, 4, 5, 6), 5),  # its last call: idle
    )
    assert next_use_hints(trace, "none", 10.0) == [None] * 6
    assert next_use_hints(trace, "gap", 10.0) == [30.0, 19.0, None, 60.0, 3.0, None]
    assert next_use_hints(trace, "gap", 10.0, speed=10) == [3.0, 1.9, None, 6.0, 0.3, None]
    assert next_use_hints(trace, "finish", 10.0) == [0.0, 0.0, LONG_IDLE_S, 60.0, 0.0, LONG_IDLE_S]
    with pytest.raises(ValueError, match="unknown signal"):
        next_use_hints(trace, "sometimes", 10.0)


def test_copies_are_sessions_of_their_own_with_content_of_their_own() -> None:
    trace = Trace(
        "project", 32,
        (TraceRequest("lead", 0.0, (1, 2), 4), TraceRequest("sub", 1.0, (1, 3), 4, parent="lead"),
         TraceRequest("lead", 2.0, (1, 2, 4), 4)),
    )  # fmt: skip
    copied = trace.copies(3, stagger_s=0.5)
    assert len(copied.requests) == 9 and copied.notes["copies"] == 3
    assert [r.at for r in copied.requests] == sorted(r.at for r in copied.requests)
    by_copy: dict[str, list[TraceRequest]] = {}
    for request in copied.requests:
        by_copy.setdefault(request.session.rpartition("~")[2], []).append(request)
    blocks = [{b for r in rs for b in r.blocks} for rs in by_copy.values()]
    assert len(blocks) == 3 and all(not a & b for a in blocks for b in blocks if a is not b)
    for requests in by_copy.values():  # within a copy, the trace's sharing is kept
        lead, sub, later = requests
        assert lead.blocks[0] == sub.blocks[0] and later.blocks[:2] == lead.blocks
        assert sub.parent == lead.session
    assert copied.requests[1].at == 0.5  # the second copy starts half a second later
    assert trace.copies(1) is trace
    with pytest.raises(ValueError, match="at least 1"):
        trace.copies(0)


def test_first_sessions_keeps_whole_agent_sessions() -> None:
    from jiuwen_replay.trace import Trace, TraceRequest

    def call(session: str, at: float, parent: str | None = None) -> TraceRequest:
        return TraceRequest(session, at, (1, 2), 1, parent)

    trace = Trace("project", 16, (call("a", 0), call("b", 1), call("a.1", 2, "a"), call("c", 3)))
    first = trace.first_sessions(1)
    assert [r.session for r in first.requests] == ["a", "a.1"]
    assert [r.session for r in trace.first_sessions(2).requests] == ["a", "b", "a.1"]
    assert first.notes["sessions_of"] == 3
    with pytest.raises(ValueError, match="at least 1"):
        trace.first_sessions(0)
