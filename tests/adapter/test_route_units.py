"""Pure parts of the API adapter: request validation, the cache-sharing rewrite and the
in-request hint (on vLLM's own request class)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from jiuwen_kv_protocol.models import ReleaseRequest
from vllm_affinity.api_server.release_service import _keeps_only_instructions
from vllm_affinity.api_server.request_path import apply_cache_sharing, apply_release_hint
from vllm_affinity.core import HintError, ReleaseHint, engine_rank
from vllm_affinity.engine import HINT_KEY
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


@pytest.mark.parametrize(
    ("variable", "field", "default"),
    [
        ("VLLM_AFFINITY_RELEASE_ON_DIVERGENCE", "release_on_divergence", False),
        ("VLLM_AFFINITY_DP_SESSION_AFFINITY", "dp_session_affinity", True),
        ("VLLM_AFFINITY_LIFECYCLE", "lifecycle", True),
    ],
)
def test_settings_flags(variable: str, field: str, default: bool) -> None:
    assert getattr(Settings.from_env({}), field) is default
    flipped = "off" if default else "true"
    assert getattr(Settings.from_env({variable: flipped}), field) is (not default)
    with pytest.raises(ValueError, match=variable):
        Settings.from_env({variable: "sometimes"})


def test_the_picker_setting_is_auto_unless_told() -> None:
    """``VLLM_AFFINITY_PREDICT_RETURN``: unset or ``auto`` leaves it to the model (on with one
    KV-cache group, off on a hybrid model: ``test_adapter_hybrid``); a flag forces it."""
    assert Settings.from_env({}).predict_return is None
    assert Settings.from_env({"VLLM_AFFINITY_PREDICT_RETURN": " Auto "}).predict_return is None
    assert Settings.from_env({"VLLM_AFFINITY_PREDICT_RETURN": "true"}).predict_return is True
    assert Settings.from_env({"VLLM_AFFINITY_PREDICT_RETURN": "off"}).predict_return is False
    with pytest.raises(ValueError, match=r"VLLM_AFFINITY_PREDICT_RETURN.*auto, true or false"):
        Settings.from_env({"VLLM_AFFINITY_PREDICT_RETURN": "sometimes"})


@pytest.mark.parametrize(
    ("variable", "field", "default"),
    [
        ("VLLM_AFFINITY_STATS_INTERVAL", "stats_interval", 2.0),
        ("VLLM_AFFINITY_IDLE_AFTER_S", "idle_after", 10.0),
    ],
)
def test_settings_seconds(variable: str, field: str, default: float) -> None:
    assert getattr(Settings.from_env({}), field) == default
    assert getattr(Settings.from_env({variable: "0.5"}), field) == 0.5
    for bad in ("soon", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match=variable):
            Settings.from_env({variable: bad})


def test_engine_rank_is_stable_in_range_and_spreads_sessions() -> None:
    ranks = [engine_rank(f"session-{i}", 4) for i in range(400)]
    assert all(0 <= r < 4 for r in ranks)
    assert ranks == [engine_rank(f"session-{i}", 4) for i in range(400)]
    assert min(ranks.count(r) for r in range(4)) > 60  # about 100 each
    assert engine_rank("any", 1) == 0
    with pytest.raises(ValueError, match="at least one engine"):
        engine_rank("any", 0)


def test_engine_rank_agrees_across_processes() -> None:
    """Several API-server processes must send a session to the same engine (Python's own
    ``hash`` of a string differs per process)."""
    code = "from vllm_affinity.core import engine_rank; print(engine_rank('abc', 7))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert int(other.stdout) == engine_rank("abc", 7)


class _Raw:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers


def test_release_hint_rides_in_vllm_xargs_next_to_the_users() -> None:
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "vllm_xargs": {"a": 1}}
    )
    hint = apply_release_hint(
        request, _Raw({"X-KV-Release": "messages_released_index=4, tools_released_index=0"})
    )
    assert hint == ReleaseHint(4, 0)
    assert request.vllm_xargs == {
        "a": 1,
        HINT_KEY: "messages_released_index=4, tools_released_index=0",
    }
    params = request.to_sampling_params(8, {})
    assert params.extra_args[HINT_KEY].startswith("messages_released_index=4")
    assert apply_release_hint(request, _Raw({})) is None


@pytest.mark.parametrize(
    "value",
    [
        "messages_released_index=-1",
        "messages_released_index=1.5",
        "messages_released_index",
        "tools_released_index=1",
        "messages_released_index=1, surprise=2",
        "messages_released_index=1,,",
        'messages_released_index="3"',
        "é",
    ],
)
def test_malformed_hint_is_refused_and_changes_nothing(value: str) -> None:
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    with pytest.raises(HintError, match="X-KV-Release"):
        apply_release_hint(request, _Raw({"X-KV-Release": value}))
    assert request.vllm_xargs is None


def test_hint_round_trips_with_the_hooks_serialisation() -> None:
    from jiuwen_hooks._diff import Release
    from jiuwen_hooks._hook import release_header

    for release in (Release(0, None, "rewrite"), Release(7, 2, "tools")):
        parsed = ReleaseHint.parse(release_header(release))
        assert (parsed.messages_released_index, parsed.tools_released_index) == (
            release.messages_released_index,
            release.tools_released_index,
        )


SYSTEM = {"role": "system", "content": "s"}
USER = {"role": "user", "content": "u"}


@pytest.mark.parametrize(
    ("window", "index", "only_instructions"),
    [
        ({"messages": [SYSTEM, USER]}, 1, True),
        ({"messages": [SYSTEM, {"role": "developer", "content": "d"}, USER]}, 2, True),
        ({"messages": [SYSTEM, USER]}, 2, False),
        ({"messages": [USER]}, 0, False),
        ({"instructions": "s", "input": [USER]}, 1, True),
        ({"input": [USER]}, 1, False),
        ({"api": "messages", "system": "s", "messages": [USER]}, 1, True),
        ({"api": "messages", "messages": [USER]}, 1, False),
    ],
)
def test_a_cut_that_keeps_only_the_instructions_is_told(
    window: dict, index: int, only_instructions: bool
) -> None:
    """Such a cut (an end, or a compaction down to the instructions) keeps the block that
    straddles the instructions' end: the next session or sibling may start as this one did."""
    body = {"model": "m", "cache_salt": "s", "messages_released_index": index, **window}
    assert _keeps_only_instructions(ReleaseRequest.model_validate(body)) is only_instructions


def test_qwen_code_request_metadata_names_the_session_and_the_request_kind() -> None:
    """Qwen Code's body ``metadata`` on vLLM's own request class (an extra field there): the
    session when no header names one, before ``prompt_cache_key``; its ``promptId`` kind."""
    from vllm_affinity.api_server.agent_windows import (
        agent_window_of,
        is_agent_request,
        qwen_code_metadata,
    )
    from vllm_affinity.api_server.request_path import apply_session_headers

    def request(metadata: object) -> ChatCompletionRequest:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        return ChatCompletionRequest.model_validate({**body, "metadata": metadata})

    qwen = request({"sessionId": " s-1 ", "promptId": "s-1########3"})
    assert qwen_code_metadata(qwen) == ("s-1", "s-1########3")
    assert is_agent_request(qwen, {})
    assert agent_window_of(qwen, {}).kind == "turn"
    apply_session_headers(qwen, _Raw({}), Settings().session_headers)
    assert qwen.session_id == "s-1"
    headed = request({"sessionId": "s-1"})
    apply_session_headers(headed, _Raw({"X-Session-ID": "from-header"}), Settings().session_headers)
    assert headed.session_id == "from-header"  # a header comes first
    for bad in (None, "s", {"promptId": "x"}, {"sessionId": ""}, {"sessionId": "x" * 600}):
        plain = request(bad)
        assert qwen_code_metadata(plain) is None
        assert not is_agent_request(plain, {})
    side = request({"sessionId": "s-1", "promptId": "compress-17"})
    assert agent_window_of(side, {}).kind == "side"


def test_a_responses_window_digests_the_same_every_turn() -> None:
    """vLLM's Responses request gives an assistant message sent without an id a random one
    (and a status) each time it parses it: the same conversation, one turn longer, must still
    be the last window plus new items (an ``append``), not a rewrite."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    from vllm_affinity.api_server.agent_windows import window_of
    from vllm_affinity.core.compaction import CompactionRule

    def item(role: str, text: str) -> dict:
        part = "input_text" if role == "user" else "output_text"
        return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}

    rule, items, verdicts = CompactionRule(16), [item("user", "u0")], []
    for turn in range(3):
        request = ResponsesRequest(model="m", instructions="sys", input=list(items), store=False)
        verdicts.append(rule.classify("codex", window_of(request)))
        items += [item("assistant", f"a{turn}"), item("user", f"u{turn + 1}")]
    assert verdicts == ["first", "append", "append"]


@pytest.mark.parametrize(
    ("client", "keys", "refused"),
    [
        (("10.1.2.3", 5000), [], True),  # another machine, a server without keys
        (("203.0.113.9", 5000), [], True),
        (("127.0.0.1", 5000), [], False),  # this machine
        (("::1", 5000), [], False),
        (("10.1.2.3", 5000), ["k"], False),  # another machine with the server's key
    ],
)
def test_the_invariants_check_answers_a_keyed_or_loopback_caller_only(
    client: tuple[str, int], keys: list[str], refused: bool
) -> None:
    """``/affinity/check`` walks every block between two scheduler steps: it answers a caller
    with the server's key, or on a server without keys a loopback one; anyone else gets
    vLLM's 403 before the engine is asked (here the service has no engine: an answered call
    fails further on, a refused one never gets there)."""
    import hashlib

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_affinity.api_server.metrics import AffinityMetrics
    from vllm_affinity.api_server.release_service import ReleaseService
    from vllm_affinity.api_server.route import router

    app = FastAPI()
    app.include_router(router)
    from prometheus_client import CollectorRegistry

    tokens = [hashlib.sha256(k.encode()).digest() for k in keys]
    app.state.jiuwen_affinity = ReleaseService(
        engine_client=None, serving_chat=None, serving_responses=None, serving_messages=None,
        block_size=16, max_model_len=256, api_tokens=tokens, settings=Settings(),
        metrics=AffinityMetrics(CollectorRegistry()),
    )  # fmt: skip
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    with TestClient(app, client=client, raise_server_exceptions=False) as http:
        answer = http.get("/affinity/check", headers=headers)
    if refused:
        assert answer.status_code == 403
        assert answer.json()["error"]["type"] == "PermissionDeniedError"
    else:
        assert answer.status_code != 403
