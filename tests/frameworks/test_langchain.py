"""LangChain ``ChatOpenAI`` (``langchain-openai``): it calls ``chat.completions`` through
``with_raw_response``, the path an accessor cache used to hide from the hook."""

from __future__ import annotations

from typing import Any

from framework_wire import assert_releases
from langchain_core.messages import HumanMessage, SystemMessage, trim_messages
from langchain_openai import ChatOpenAI

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine


def trimmed(history: list[Any]) -> list[Any]:
    """Keep the system message and the last two messages (token_counter=len counts messages)."""
    return trim_messages(
        history, max_tokens=3, token_counter=len, strategy="last", include_system=True
    )


def conversation(llm: ChatOpenAI, turns: int = 4) -> None:
    history: list[Any] = [SystemMessage("You are a careful agent.")]
    for i in range(turns):
        history.append(HumanMessage(f"question {i}"))
        history.append(llm.invoke(trimmed(history)))


async def aconversation(llm: ChatOpenAI, turns: int = 4) -> None:
    history: list[Any] = [SystemMessage("You are a careful agent.")]
    for i in range(turns):
        history.append(HumanMessage(f"question {i}"))
        history.append(await llm.ainvoke(trimmed(history)))


def chat_model(engine: LocalEngine, **kwargs: Any) -> ChatOpenAI:
    return ChatOpenAI(
        model="m", base_url=engine.base_url, api_key="sk-test", max_retries=0, **kwargs
    )


def test_session_in_default_headers(engine: LocalEngine) -> None:
    conversation(chat_model(engine, default_headers={"X-Session-ID": "lc-headers"}))
    assert_releases(engine, "lc-headers", 3)


def test_session_by_context(engine: LocalEngine) -> None:
    llm = chat_model(engine)
    llm.invoke("warm-up: caches with_raw_response before the session starts")
    with jiuwen_hooks.session("lc-context"):
        conversation(llm)
    assert_releases(engine, "lc-context", 3)


def test_session_in_extra_body(engine: LocalEngine) -> None:
    llm = chat_model(engine, extra_body={"agent_hint": {"session_id": "lc-body"}})
    conversation(llm)
    assert_releases(engine, "lc-body", 3)


async def test_async_with_context(engine: LocalEngine) -> None:
    with jiuwen_hooks.session("lc-async"):
        await aconversation(chat_model(engine))
    assert_releases(engine, "lc-async", 3)


def test_uninstall_unhooks_a_client_used_while_installed(engine: LocalEngine) -> None:
    llm = chat_model(engine, default_headers={"X-Session-ID": "lc-gone"})
    conversation(llm)
    jiuwen_hooks.uninstall()
    engine.clear()
    conversation(llm)
    assert engine.releases == []
    assert all("x-kv-release" not in c.headers for c in engine.chats)
