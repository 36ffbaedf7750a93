"""The request's path (``vllm_affinity/request_path.py``): its steps in order, each alone, on
vLLM's own request class. The whole path runs in every real-server test."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from jiuwen_kv_protocol.headers import CLAUDE_CODE_SESSION_HEADER, PARENT_HEADER
from jiuwen_kv_protocol.hint import HEADER as HINT_HEADER
from vllm_affinity import engine, request_path
from vllm_affinity.agent_windows import EngineWindows, LocalWindows
from vllm_affinity.core.compaction import Window
from vllm_affinity.engine import HINT_KEY, PARENT_KEY
from vllm_affinity.metrics import AffinityMetrics
from vllm_affinity.request_path import STEPS, Refusal, RequestPath, finish
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
        "session",
        "next_use",
        "engine",
        "release_hint",
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
    utility = engine._make_classify_window(max_sessions=100)

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
