"""Pure parts of the API adapter: request validation and the cache-sharing body rewrite."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from vllm_affinity.route import CacheSharingMiddleware, ReleaseRequest
from vllm_affinity.settings import Settings


def rewrite(body: dict, allow: bool = True) -> dict:
    middleware = CacheSharingMiddleware(app=None, allow_sharing=allow)  # type: ignore[arg-type]
    return json.loads(middleware._rewrite(json.dumps(body).encode()))


def test_sharing_drops_the_salt_and_keeps_the_session() -> None:
    out = rewrite({"model": "m", "cache_salt": "s1", "cache_sharing": True})
    assert out == {"model": "m", "session_id": "s1"}


def test_sharing_refused_keeps_the_salt() -> None:
    out = rewrite({"model": "m", "cache_salt": "s1", "cache_sharing": True}, allow=False)
    assert out == {"model": "m", "cache_salt": "s1"}


def test_no_sharing_keeps_the_salt_and_an_explicit_session_id() -> None:
    assert rewrite({"cache_salt": "s1", "cache_sharing": False}) == {"cache_salt": "s1"}
    out = rewrite({"cache_salt": "s1", "cache_sharing": True, "session_id": "explicit"})
    assert out == {"session_id": "explicit"}


def test_non_json_body_is_left_for_vllm() -> None:
    middleware = CacheSharingMiddleware(app=None)  # type: ignore[arg-type]
    assert middleware._rewrite(b'{"cache_sharing": tru') == b'{"cache_sharing": tru'


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
