"""The request's path (``vllm_affinity/api_server/request_path.py``): its steps in order, each
alone, on vLLM's own request class. The whole path runs in every real-server test."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    FunctionCall,
    ToolCall,
    UsageInfo,
)
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from jiuwen_kv_protocol.headers import CLAUDE_CODE_SESSION_HEADER, PARENT_HEADER
from jiuwen_kv_protocol.hint import HEADER as HINT_HEADER
from vllm_affinity.api_server import request_path
from vllm_affinity.api_server.agent_windows import EngineWindows, LocalWindows
from vllm_affinity.api_server.implicit_sessions import AnswerRecords, EngineChains, LocalChains
from vllm_affinity.api_server.metrics import AffinityMetrics
from vllm_affinity.api_server.request_path import STEPS, Refusal, RequestPath, finish
from vllm_affinity.core.compaction import Window
from vllm_affinity.engine import HINT_KEY, PARENT_KEY, patches
from vllm_affinity.settings import Settings


class _Raw:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers


def path_of(body: dict[str, Any], headers: dict[str, str], counted: list[str]) -> RequestPath:
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    )
    return RequestPath(Settings(), None, request, _Raw(headers), None, counted.append)


def test_the_steps_read_like_the_requests_path() -> None:
    assert [step.__name__ for step in STEPS] == [
        "cache_sharing",
        "session_source",
        "principal",
        "implicit_session",
        "session",
        "next_use",
        "engine",
        "release_hint",
        "checkpoint",
    ]


def test_each_step_alone() -> None:
    counted: list[str] = []
    path = path_of(
        {"cache_salt": "salt-1", "cache_sharing": True},
        {PARENT_HEADER: "lead", HINT_HEADER: "messages_released_index=2"},
        counted,
    )
    request_path.cache_sharing(path)
    assert path.request.cache_salt is None and path.request.session_id == "salt-1"
    request_path.session_source(path)
    assert path.request.vllm_xargs == {PARENT_KEY: "lead"}
    request_path.principal(path)  # no plugin routes attached: nothing to scope, judge or pin
    asyncio.run(request_path.session(path))
    request_path.engine(path)
    assert path.session is None and path.verdict is None
    request_path.release_hint(path)
    assert path.request.vllm_xargs[HINT_KEY] == "messages_released_index=2"
    assert counted == ["accepted"]
    before = dict(path.request.vllm_xargs)
    asyncio.run(request_path.checkpoint(path))  # no plugin routes: no engine to ask
    assert path.request.vllm_xargs == before
    assert finish(path, "the call") == "the call"  # no session: not watched


def test_a_malformed_hint_is_refused_and_counted_once_the_refusal_is_answered() -> None:
    counted: list[str] = []
    path = path_of({}, {HINT_HEADER: "messages_released_index=-1"}, counted)
    with pytest.raises(Refusal) as refusal:
        request_path.release_hint(path)
    assert "messages_released_index" in str(refusal.value)
    assert counted == []
    refusal.value.count()
    assert counted == ["invalid"]
    assert HINT_KEY not in (path.request.vllm_xargs or {})


def _engine_windows(engine_core: Any) -> EngineWindows:
    """The rule judged by the engine utility itself, its arguments through vLLM's own msgpack
    encoder and decoder, as a utility call's travel."""
    utility = patches._make_classify_window(max_sessions=100)

    async def call_engine(session: str, method: str, *args: Any) -> Any:
        assert method == "affinity_classify_window"
        return utility(engine_core, *MsgpackDecoder().decode(MsgpackEncoder().encode(args)))

    return EngineWindows(call_engine)


def test_windows_judged_in_the_engine_get_the_rules_verdicts() -> None:
    system = {"role": "system", "content": "You are a coding agent."}
    tools = [{"type": "function", "function": {"name": "Bash", "parameters": {}}}]
    turns = [
        [system, {"role": "user", "content": "fix it"}],
        [system, {"role": "user", "content": "fix it"}, {"role": "assistant", "content": "ok"}],
        [system, {"role": "user", "content": "Title this."}],  # no tools: a side request
        [system, {"role": "user", "content": "the summary"}],
    ]
    local, remote = LocalWindows(max_sessions=100), _engine_windows(SimpleNamespace())

    async def judge(windows: Any) -> list[str]:
        return [
            await windows.classify("s", Window.of(t, None if i == 2 else tools), None)
            for i, t in enumerate(turns)
        ]

    first = asyncio.run(judge(remote))
    assert first == asyncio.run(judge(local)) == ["first", "append", "side", "rewrite"]
    # the engine core keeps the rule's state between calls: a second pass reads as the local
    # rule's second pass does (its first window now a retry of the summary's)
    second = asyncio.run(judge(remote))
    assert second == asyncio.run(judge(local)) and second[0] == "retry"


def test_an_engine_that_cannot_judge_leaves_the_request_unjudged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def gone(session: str, method: str, *args: Any) -> Any:
        raise ConnectionError("engine dead")

    counted: list[str] = []
    path = path_of({}, {CLAUDE_CODE_SESSION_HEADER: "cc-1"}, counted)
    path.service = cast(
        Any,
        SimpleNamespace(windows=EngineWindows(gone), metrics=AffinityMetrics(CollectorRegistry())),
    )
    path.serving = SimpleNamespace(_get_session_id=lambda request, raw: "cc-1")
    with caplog.at_level("WARNING", logger="vllm_affinity"):
        asyncio.run(request_path.session(path))
    assert path.verdict is None and path.session == "cc-1"  # bound, not judged
    assert "could not judge a window" in caplog.text


def _engine_chains(engine_core: Any) -> EngineChains:
    """The implicit sessions' table in the engine utilities themselves, their arguments through
    vLLM's own msgpack encoder and decoder."""
    chain_of, record = patches._make_chain_utilities(max_sessions=100)
    utilities = {"affinity_chain_of": chain_of, "affinity_record_answer": record}

    async def call_engine(key: str, method: str, *args: Any) -> Any:
        wire = MsgpackDecoder().decode(MsgpackEncoder().encode(args))
        answer = utilities[method](engine_core, *wire)
        return MsgpackDecoder().decode(MsgpackEncoder().encode(answer))

    return EngineChains(call_engine)


def _response(text: str, call_id: str | None = None) -> ChatCompletionResponse:
    call = FunctionCall(name="read", arguments="{}")
    calls = [ToolCall(id=call_id, function=call)] if call_id else []
    message = ChatMessage(role="assistant", content=text, tool_calls=calls)
    choice = ChatCompletionResponseChoice(index=0, message=message, finish_reason="stop")
    return ChatCompletionResponse(model="m", choices=[choice], usage=UsageInfo())


def _stream(text: str, call_id: str) -> list[str]:
    """SSE chunks as vLLM streams an answer: text in pieces, a tool call's id in its first."""
    chunks = [{"delta": {"content": piece}} for piece in (text[:5], text[5:])]
    chunks.append({"delta": {"tool_calls": [{"index": 0, "id": call_id, "type": "function"}]}})
    lines = [f"data: {json.dumps({'choices': [dict(index=0, **c)]})}\n\n" for c in chunks]
    return [*lines, "data: [DONE]\n\n"]


def test_requests_that_name_no_session_are_linked_by_the_answers_they_carry_back() -> None:
    """One conversation and a second one with the same prompt, through the step and the answer
    reader, with the table here and in the engine: the same chains."""
    system = {"role": "system", "content": "You are a coding agent."}
    task = {"role": "user", "content": "fix it"}

    async def conversation(chains: Any) -> list[tuple[str | None, bool]]:
        records = AnswerRecords(chains)
        service = SimpleNamespace(answers=records, metrics=AffinityMetrics(CollectorRegistry()))
        seen = []

        async def call(messages: list[Any], answer: Any) -> Any:
            path = path_of({"messages": messages}, {}, [])
            path.service, path.serving = (
                cast(Any, service),
                SimpleNamespace(_get_session_id=lambda request, raw: request.session_id),
            )
            path.settings = Settings(lifecycle=False)
            await request_path.implicit_session(path)
            seen.append((path.chain, service.metrics.api_counts().get("implicit.continued", 0)))

            async def vllm() -> Any:
                if isinstance(answer, list):

                    async def stream() -> Any:
                        for chunk in answer:
                            yield chunk

                    return stream()
                return answer

            path.session = path.chain
            result = await finish(path, vllm())
            if hasattr(result, "__aiter__"):
                [chunk async for chunk in result]
            await records.drain()
            return result

        await call([system, task], _response("Looking at the test now.", "call_a1"))
        tool = {"role": "tool", "tool_call_id": "call_a1", "content": "out"}
        asked = {"role": "assistant", "content": "Looking at the test now.", "tool_calls": [
            {"id": "call_a1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
        ]}  # fmt: skip
        await call([system, task, asked, tool], _stream("Fixed the off-by-one.", "call_a2"))
        await call([system, task], _response("Another session's answer."))  # same prompt
        said = {"role": "assistant", "content": "Fixed the off-by-one."}
        await call([system, task, asked, tool, said, {"role": "user", "content": "and?"}], None)
        return [(chain is not None, count) for chain, count in seen], [c for c, _ in seen]

    local_flags, local_chains = asyncio.run(conversation(LocalChains(100)))
    remote_flags, remote_chains = asyncio.run(conversation(_engine_chains(SimpleNamespace())))
    assert local_flags == remote_flags == [(True, 0), (True, 1), (True, 1), (True, 2)]
    for chains in (local_chains, remote_chains):
        first, second, other, third = chains
        assert first == second == third != other


def test_a_table_that_cannot_be_asked_leaves_the_request_as_it_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def gone(key: str, method: str, *args: Any) -> Any:
        raise ConnectionError("engine dead")

    path = path_of({}, {}, [])
    path.service = cast(
        Any,
        SimpleNamespace(
            answers=AnswerRecords(EngineChains(gone)), metrics=AffinityMetrics(CollectorRegistry())
        ),
    )
    path.serving = SimpleNamespace(_get_session_id=lambda request, raw: None)
    with caplog.at_level("WARNING", logger="vllm_affinity"):
        asyncio.run(request_path.implicit_session(path))
    assert path.chain is None and path.request.session_id is None
    assert "could not link a request" in caplog.text


def test_instructions_key_names_the_instructions_whatever_follows() -> None:
    """The checkpoint's render is cached by this key: the same system prompt and tools give
    one key across sessions and turns; other instructions or tools another; none, None."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    from vllm_affinity.api_server.instructions import instructions_key

    tool = {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}

    def chat(system: str | None, user: str, tools: list[Any] | None = None) -> Any:
        head = [{"role": "system", "content": system}] if system else []
        messages = [*head, {"role": "user", "content": user}]
        return ChatCompletionRequest(model="m", messages=messages, tools=tools)

    key = instructions_key(chat("You are A.", "first"))
    assert key is not None and key == instructions_key(chat("You are A.", "another task"))
    assert instructions_key(chat("You are B.", "first")) != key
    assert instructions_key(chat("You are A.", "first", [tool])) not in (None, key)
    assert instructions_key(chat(None, "no instructions")) is None
    responses = ResponsesRequest(model="m", input="hi", instructions="You are A.")
    assert instructions_key(responses) is not None


def test_a_request_carrying_a_chains_answer_under_other_instructions_is_its_side_branch() -> None:
    """Qwen Code's compression request (its own system prompt, the conversation): bound under
    the chain's side branch, judged ``side`` without asking the rule, its answer recorded
    under the chain, so that the window carrying the summary continues the chain. With the
    table here and in the engine."""
    from vllm_affinity.core.compaction import side_branch

    summary = "The parser's loop was off by one; fixed, one test added, next the suite. " * 2
    task = {"role": "user", "content": "fix it"}

    async def run(chains: Any) -> tuple[list[Any], list[Any]]:
        records = AnswerRecords(chains)
        service = SimpleNamespace(answers=records, metrics=AffinityMetrics(CollectorRegistry()))
        paths = []
        for system, messages, answer in (
            ("You code.", [task], "Done: fixed."),
            ("Summarize.", [task, {"role": "assistant", "content": "Done: fixed."}], summary),
            ("You code.", [{"role": "user", "content": f"Summary:\n{summary.strip()}"}], "ok"),
        ):
            body = {"messages": [{"role": "system", "content": system}, *messages]}
            path = path_of(body, {}, [])
            path.service = cast(Any, service)
            path.serving = SimpleNamespace(_get_session_id=lambda request, raw: request.session_id)
            path.settings = Settings(lifecycle=False)
            await request_path.implicit_session(path)
            if path.chain_outcome == "side":
                await request_path.session(path)
                assert path.window is not None  # its instruction length is measured then
                path.window = None  # (with vLLM's renderer: tested on a real server)
            else:
                path.session = path.chain

            async def vllm(text: str = answer) -> Any:
                return _response(text)

            await finish(path, vllm())
            await records.drain()
            paths.append(path)
        return [p.chain_outcome for p in paths], paths

    for chains in (LocalChains(100), _engine_chains(SimpleNamespace())):
        outcomes, (first, side, compacted) = asyncio.run(run(chains))
        assert outcomes == ["started", "side", "continued"]
        assert side.verdict == "side" and side.request.session_id == side_branch(first.chain)
        assert side.session is not None and side.session.endswith(side_branch(first.chain))
        assert compacted.chain == first.chain
