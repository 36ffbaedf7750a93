"""llama-index ``OpenAILike`` (chat model), sync and async, with a sliding memory window."""

from __future__ import annotations

from typing import Any

import openai
from framework_wire import assert_releases
from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine


def llm(engine: LocalEngine, **kwargs: Any) -> OpenAILike:
    return OpenAILike(
        model="m",
        api_base=engine.base_url,
        api_key="sk-test",
        is_chat_model=True,
        max_retries=0,
        **kwargs,
    )


def window(history: list[ChatMessage]) -> list[ChatMessage]:
    return [history[0], *history[-2:]]  # the system message and the last two


def test_openai_major_version_is_2() -> None:
    assert openai.__version__.startswith("2."), openai.__version__


def test_sync_chat_by_context(engine: LocalEngine) -> None:
    model = llm(engine)
    history = [ChatMessage(role="system", content="Be careful.")]
    with jiuwen_hooks.session("li-sync"):
        for i in range(4):
            history.append(ChatMessage(role="user", content=f"question {i}"))
            history.append(model.chat(window(history)).message)
    assert_releases(engine, "li-sync", 3)


async def test_async_chat_with_default_headers(engine: LocalEngine) -> None:
    model = llm(engine, default_headers={"X-Session-ID": "li-async"})
    history = [ChatMessage(role="system", content="Be careful.")]
    for i in range(4):
        history.append(ChatMessage(role="user", content=f"question {i}"))
        history.append((await model.achat(window(history))).message)
    assert_releases(engine, "li-async", 3)
