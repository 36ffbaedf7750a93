"""Pure parts of the API adapter: request validation and the cache-sharing rewrite."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from vllm_affinity.route import ReleaseRequest, apply_cache_sharing
from vllm_affinity.settings import Settings


def shared(body: dict, allow: bool = True) -> ChatCompletionRequest:
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    )
    apply_cache_sharing(request, allow)
    return request


def test_sharing_drops_the_salt_and_keeps_the_session() -> None:
    request = shared({"cache_salt": "s1", "cache_sharing": True})
    assert (request.cache_salt, request.session_id) == (None, "s1")
    assert "cache_sharing" not in (request.model_extra or {})


def test_sharing_refused_keeps_the_salt() -> None:
    request = shared({"cache_salt": "s1", "cache_sharing": True}, allow=False)
    assert (request.cache_salt, request.session_id) == ("s1", None)


def test_no_sharing_keeps_the_salt_and_an_explicit_session_id() -> None:
    assert shared({"cache_salt": "s1", "cache_sharing": False}).cache_salt == "s1"
    request = shared({"cache_salt": "s1", "cache_sharing": True, "session_id": "explicit"})
    assert (request.cache_salt, request.session_id) == (None, "explicit")
    assert shared({"cache_salt": "s1"}).cache_salt == "s1"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "cache_salt": "s", "messages": [{}], "messages_released_index": 2},
        {"model": "m", "cache_salt": "s", "messages": [{}], "messages_released_index": 0,
         "tools_released_index": 0},
        {"model": "m", "cache_salt": "s", "messages": [{}], "messages_released_index": 0,
         "tools": [], "tools_released_index": 1},
        {"model": "", "cache_salt": "s", "messages": [{}], "messages_released_index": 0},
    ],
)  # fmt: skip
def test_release_request_rejects_out_of_range_input(body: dict) -> None:
    with pytest.raises(ValidationError):
        ReleaseRequest.model_validate(body)


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_AFFINITY_CACHE_SHARING", "refuse")
    assert Settings.from_env().allow_cache_sharing is False
    monkeypatch.setenv("VLLM_AFFINITY_CACHE_SHARING", "sometimes")
    with pytest.raises(ValueError, match="VLLM_AFFINITY_CACHE_SHARING"):
        Settings.from_env()
