"""The lifecycle rule (pure core) and how the API-server adapter reads vLLM's own answer types."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo

from vllm_affinity.api_server.lifecycle import IdleSignals, finish_reasons, watched
from vllm_affinity.core.lifecycle import (
    TASK_OVER_S,
    NextUseError,
    ends_task,
    goes_idle,
    parse_next_use,
)


@pytest.mark.parametrize(
    ("reasons", "next_use", "idle"),
    [
        (["stop"], None, True),
        (["tool_calls"], None, False),
        (["length"], None, False),
        (["stop", "tool_calls"], None, False),  # one choice goes on: the session is live
        ([None], None, False),
        ([], None, False),
        (["tool_calls"], 60.0, True),  # the agent knows its tool is slow
        (["stop"], 2.0, False),  # ... or that its user answers at once
        (["length"], 10.0, True),  # the threshold itself counts as idle
    ],
)
def test_goes_idle(reasons: list[str | None], next_use: float | None, idle: bool) -> None:
    assert goes_idle(reasons, next_use, idle_after=10.0) is idle


def test_parse_next_use() -> None:
    assert parse_next_use(" 2.5 ") == 2.5
    assert parse_next_use("0") == 0.0
    for bad in ("soon", "", "-1", "nan", "inf", "1e400"):
        with pytest.raises(NextUseError, match="X-KV-Next-Use"):
            parse_next_use(bad)


def chat_answer(*reasons: str | None) -> ChatCompletionResponse:
    choices = [
        ChatCompletionResponseChoice(
            index=i, message=ChatMessage(role="assistant", content="x"), finish_reason=reason
        )
        for i, reason in enumerate(reasons)
    ]
    return ChatCompletionResponse(model="m", choices=choices, usage=UsageInfo(prompt_tokens=1))


def sse(reason: str | None) -> str:
    choice = ChatCompletionResponseStreamChoice(
        index=0, delta=DeltaMessage(content="x"), finish_reason=reason
    )
    chunk = ChatCompletionStreamResponse(model="m", choices=[choice])
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def test_finish_reasons_of_vllm_answers() -> None:
    assert finish_reasons(chat_answer("stop", "tool_calls")) == ["stop", "tool_calls"]
    assert finish_reasons(sse(None)) == []
    assert finish_reasons(sse("tool_calls")) == ["tool_calls"]
    assert finish_reasons("data: [DONE]\n\n") == []
    assert finish_reasons("data: {not json\n\n") == []
    assert finish_reasons(object()) == []  # vLLM's ErrorResponse and the like


def collect(result: Any, seen: list[list[str | None]]) -> Any:
    async def run() -> Any:
        answer = await watched(_coro(result), seen.append)
        if hasattr(answer, "__aiter__"):
            return [chunk async for chunk in answer]
        return answer

    return asyncio.run(run())


async def _coro(value: Any) -> Any:
    return value


async def stream(*chunks: str) -> AsyncIterator[str]:
    for chunk in chunks:
        yield chunk


def test_watched_answer_and_stream_report_once_complete() -> None:
    seen: list[list[str | None]] = []
    answer = chat_answer("stop")
    assert collect(answer, seen) is answer
    chunks = [sse(None), sse(None), sse("stop"), "data: [DONE]\n\n"]
    assert collect(stream(*chunks), seen) == chunks  # the stream passes through unchanged
    assert seen == [["stop"], ["stop"]]


def test_a_stream_the_client_left_reports_nothing() -> None:
    seen: list[list[str | None]] = []

    async def leave_early() -> None:
        answer = await watched(_coro(stream(sse(None), sse("stop"))), seen.append)
        async for _ in answer:
            break
        await answer.aclose()

    asyncio.run(leave_early())
    assert seen == []


def test_idle_signals_send_only_for_idle_sessions_and_never_raise() -> None:
    sent: list[tuple[str, ...]] = []
    counted: list[str] = []

    async def call_engines(method: str, *args: Any) -> list[dict[str, Any]]:
        sent.append((method, *args))
        if args[0] == "broken":
            raise RuntimeError("engine gone")
        return [{"status": "ok", "blocks_idled": 3, "kept_shared": 0}]

    async def run() -> None:
        signals = IdleSignals(call_engines, idle_after=10.0, count=counted.append)
        signals.on_finish("a", None)(["stop"])
        signals.on_finish("b", None)(["tool_calls"])
        signals.on_finish("c", 30.0)(["tool_calls"])
        signals.on_finish("broken", None)(["stop"])
        signals.on_finish("named", None, named_tool=True)(["stop"])  # a forced tool call
        signals.on_finish("side", None, side_branch=True)(["length"])  # one-shot, cut off
        signals.on_finish("side-hinted", 0.0, side_branch=True)(["stop"])  # the hint decides
        await signals.drain()

    asyncio.run(run())
    assert sent == [  # whether the signal ends a subagent's task, and the hint
        ("affinity_session_idle", "a", True, None),
        ("affinity_session_idle", "c", False, 30.0),  # back in 30 s: not the end of a task
        ("affinity_session_idle", "broken", True, None),
        ("affinity_session_idle", "side", True, None),
    ]
    outcomes = ["idle.finish_reason", "live.finish_reason", "idle.hint", "idle.finish_reason"]
    outcomes += ["live.finish_reason", "idle.side_branch", "live.hint"]
    assert counted == [*outcomes, "failed"]


def test_a_responses_answer_in_chat_terms() -> None:
    """Only the two fields the adapter reads: ``status`` and the ``type`` of each output item."""
    from types import SimpleNamespace as Answer

    call, text = Answer(type="function_call"), Answer(type="message")
    assert finish_reasons(Answer(status="completed", output=[text])) == ["stop"]
    assert finish_reasons(Answer(status="completed", output=[text, call])) == ["tool_calls"]
    assert finish_reasons(Answer(status="incomplete", output=[text])) == ["length"]
    event = Answer(type="response.completed", response=Answer(status="completed", output=[]))
    assert finish_reasons(event) == ["stop"]


def test_a_subagents_task_ends_on_its_answer_or_an_hour_long_hint() -> None:
    assert ends_task(None)  # the model answered
    assert ends_task(TASK_OVER_S) and ends_task(2 * TASK_OVER_S)
    assert not ends_task(17.0)  # a slow tool: back soon
