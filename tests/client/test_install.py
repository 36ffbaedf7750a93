"""install()/uninstall(): idempotence, exact restoration (also under a stacked wrapper),
clients created before install, options and their validation."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import wrapt
from callers import Caller, system_and_user
from openai.resources.chat import completions as chat_module

import jiuwen_hooks
from jiuwen_hooks._options import Options

CLASSES = (chat_module.Completions, chat_module.AsyncCompletions)


def originals() -> dict[tuple[type, str], Any]:
    return {(cls, name): cls.__dict__[name] for cls in CLASSES for name in ("create", "parse")}


@pytest.fixture(autouse=True)
def clean() -> Any:
    jiuwen_hooks.uninstall()
    yield
    jiuwen_hooks.uninstall()


def test_install_is_idempotent_and_uninstall_restores_exactly() -> None:
    before = originals()
    hook = jiuwen_hooks.install()
    assert jiuwen_hooks.install() is hook
    for (cls, name), original in before.items():
        assert cls.__dict__[name] is not original
        assert isinstance(cls.__dict__[name], wrapt.FunctionWrapper)
    jiuwen_hooks.uninstall()
    jiuwen_hooks.uninstall()  # a second uninstall is a no-op
    assert originals() == before


def test_uninstall_under_a_stacked_wrapper(jiuwen_engine: Any) -> None:
    before = originals()
    jiuwen_hooks.install()
    seen: list[str] = []

    def other(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        seen.append("other")
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(chat_module, "Completions.create", other)
    jiuwen_hooks.uninstall()
    stacked = chat_module.Completions.__dict__["create"]
    assert stacked.__wrapped__ is before[(chat_module.Completions, "create")]
    caller = Caller("sync", jiuwen_engine.base_url)
    window = system_and_user(2)
    caller(window)
    caller(window[:1])
    caller.close()
    assert seen == ["other", "other"]  # the other wrapper still works ...
    assert jiuwen_engine.releases == []  # ... and ours is gone
    chat_module.Completions.create = stacked.__wrapped__  # the other one's own unwrap
    assert originals() == before


def test_client_created_before_install_is_tracked(jiuwen_engine: Any) -> None:
    caller = Caller("sync", jiuwen_engine.base_url)
    caller.client.chat.completions  # resources built before install  # noqa: B018
    jiuwen_hooks.install()
    window = system_and_user(2)
    caller(window)
    caller(window[:1])
    caller.close()
    assert len(jiuwen_engine.releases) == 1


def test_after_uninstall_nothing_is_sent(jiuwen_engine: Any) -> None:
    jiuwen_hooks.install()
    jiuwen_hooks.uninstall()
    caller = Caller("sync", jiuwen_engine.base_url)
    window = system_and_user(2)
    caller(window)
    caller(window[:1])
    caller.close()
    assert jiuwen_engine.releases == []
    assert "cache_salt" not in jiuwen_engine.chats[0].body


def test_disabled_patches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    before = originals()
    monkeypatch.setenv("JIUWEN_ENABLED", "false")
    hook = jiuwen_hooks.install()
    assert hook.options.enabled is False
    assert originals() == before
    assert jiuwen_hooks.stats() == {}


def test_environment_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JIUWEN_TIMEOUT", "0.25")
    monkeypatch.setenv("JIUWEN_CACHE_SHARING", "none")
    monkeypatch.setenv("JIUWEN_DISPATCH", "background")
    monkeypatch.setenv("JIUWEN_MIN_RELEASED_MESSAGES", "4")
    monkeypatch.setenv("JIUWEN_COMPRESSORS", "a.b:c, d.e:f")
    options = Options.resolve({"timeout": 2.0})
    assert options.timeout == 2.0  # keyword wins
    assert options.cache_sharing is None
    assert options.dispatch == "background"
    assert options.min_released_messages == 4
    assert options.compressors == ("a.b:c", "d.e:f")


@pytest.mark.parametrize(
    ("env", "value", "message"),
    [
        ("JIUWEN_TIMEOUT", "soon", "JIUWEN_TIMEOUT"),
        ("JIUWEN_TIMEOUT", "-1", "timeout=-1.0"),
        ("JIUWEN_DISPATCH", "sideways", "dispatch='sideways'"),
        ("JIUWEN_ENABLED", "maybe", "JIUWEN_ENABLED"),
    ],
)
def test_bad_environment_values_are_named(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, message: str
) -> None:
    before = originals()
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=message):
        jiuwen_hooks.install()
    assert originals() == before


def test_unknown_option() -> None:
    with pytest.raises(TypeError, match="timout"):
        jiuwen_hooks.install(timout=1)


def test_bad_compressor_path_installs_nothing() -> None:
    before = originals()
    with pytest.raises(ValueError, match="no_such_module"):
        jiuwen_hooks.install(compressors=["no_such_module"])
    with pytest.raises(ValueError, match="not found"):
        jiuwen_hooks.install(compressors=["agent_compressors:missing"])
    assert originals() == before
    assert jiuwen_hooks.stats() == {}


def test_session_requires_a_string() -> None:
    with pytest.raises(ValueError), jiuwen_hooks.session(""):
        pass


def test_openai_module_is_the_real_sdk() -> None:
    assert openai.OpenAI.__module__.startswith("openai")


def _released_after(client: openai.OpenAI, send: Any, engine: Any) -> int:
    window = system_and_user(2)
    with jiuwen_hooks.session("cached"):
        send(client, window)
        send(client, window[:2])
    return len(engine.releases)


def _raw(client: openai.OpenAI, window: Any) -> None:
    client.chat.completions.with_raw_response.create(model="m", messages=window).parse()


def _streaming(client: openai.OpenAI, window: Any) -> None:
    with client.chat.completions.with_streaming_response.create(model="m", messages=window) as r:
        r.read()


@pytest.mark.parametrize("send", [_raw, _streaming], ids=["with_raw_response", "streaming"])
def test_accessor_cached_before_install_is_tracked(jiuwen_engine: Any, send: Any) -> None:
    """What ``ChatOpenAI.invoke`` does: the accessor is built (and cached) on first use."""
    client = openai.OpenAI(base_url=jiuwen_engine.base_url, api_key="sk-test", max_retries=0)
    send(client, system_and_user(1))  # caches with_raw_response before install
    jiuwen_hooks.install()
    assert _released_after(client, send, jiuwen_engine) == 1
    client.close()


@pytest.mark.parametrize("send", [_raw, _streaming], ids=["with_raw_response", "streaming"])
def test_uninstall_stops_an_accessor_cached_while_installed(jiuwen_engine: Any, send: Any) -> None:
    client = openai.OpenAI(base_url=jiuwen_engine.base_url, api_key="sk-test", max_retries=0)
    jiuwen_hooks.install()
    assert _released_after(client, send, jiuwen_engine) == 1
    jiuwen_hooks.uninstall()
    jiuwen_engine.clear()
    with jiuwen_hooks.session("after"):
        send(client, system_and_user(2))
        send(client, system_and_user(1))
    assert jiuwen_engine.releases == []
    assert all("x-session-id" not in c.headers for c in jiuwen_engine.chats)
    client.close()


def test_session_from_client_default_headers(jiuwen_engine: Any) -> None:
    """LangChain's ``ChatOpenAI(default_headers={"X-Session-ID": ...})``."""
    jiuwen_hooks.install()
    client = openai.OpenAI(
        base_url=jiuwen_engine.base_url,
        api_key="sk-test",
        max_retries=0,
        default_headers={"X-Session-ID": "from-client"},
    )
    window = system_and_user(2)
    client.chat.completions.create(model="m", messages=window)
    client.chat.completions.create(model="m", messages=window[:2])
    (release,) = jiuwen_engine.releases
    assert release.body["cache_salt"] == "from-client"
    assert release.headers["x-session-id"] == "from-client"
    client.close()


def test_session_from_agent_hint_and_call_headers(jiuwen_engine: Any) -> None:
    jiuwen_hooks.install()
    client = openai.OpenAI(base_url=jiuwen_engine.base_url, api_key="sk-test", max_retries=0)
    window = system_and_user(2)
    hint = {"agent_hint": {"session_id": "jiuwen-7"}}
    client.chat.completions.create(model="m", messages=window, extra_body=hint)
    client.chat.completions.create(model="m", messages=window[:2], extra_body=hint)
    headers = {"X-Session-ID": "per-call"}
    client.chat.completions.create(model="m", messages=window, extra_headers=headers)
    client.chat.completions.create(model="m", messages=window[:1], extra_headers=headers)
    first, second = jiuwen_engine.releases
    assert (first.body["cache_salt"], first.body["messages_released_index"]) == ("jiuwen-7", 2)
    assert (second.body["cache_salt"], second.body["messages_released_index"]) == ("per-call", 1)
    assert jiuwen_engine.chats[0].body["agent_hint"] == {"session_id": "jiuwen-7"}  # kept
    client.close()


def test_the_agent_library_loads_nothing_of_the_server_plugin() -> None:
    """``jiuwen_hooks`` and the plugin share only the neutral ``jiuwen_kv_protocol`` package."""
    import subprocess
    import sys

    code = (
        "import sys, jiuwen_hooks, jiuwen_hooks.testing\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm_affinity'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
