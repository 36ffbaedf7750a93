"""The request's path (``vllm_affinity/request_path.py``): its steps in order, each alone, on
vLLM's own request class. The whole path runs in every real-server test."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from jiuwen_kv_protocol.headers import PARENT_HEADER
from jiuwen_kv_protocol.hint import HEADER as HINT_HEADER
from vllm_affinity import request_path
from vllm_affinity.engine import HINT_KEY, PARENT_KEY
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
    for step in (request_path.principal, request_path.session, request_path.engine):
        step(path)  # no plugin routes attached: nothing to scope, judge or pin
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
