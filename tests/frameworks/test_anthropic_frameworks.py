"""Anthropic-speaking frameworks through the ``anthropic`` SDK: LangChain ``ChatAnthropic``
(``langchain-anthropic``) and pydantic-ai's ``AnthropicModel``, each trimming its history. The
releases must sit where the windows on the wire (``system`` as item 0, then ``messages``)
changed."""

from __future__ import annotations

from typing import Any

from framework_wire import assert_releases
from langchain_anthropic import ChatAnthropic
from langchain_core.messages import HumanMessage, SystemMessage, trim_messages
from pydantic_ai import Agent
from pydantic_ai.capabilities import ProcessHistory
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.providers.anthropic import AnthropicProvider

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine


def test_langchain_chat_anthropic(engine: LocalEngine) -> None:
    llm = ChatAnthropic(
        model="m", base_url=engine.root_url, api_key="sk-test", max_retries=0, max_tokens=16
    )
    history: list[Any] = [SystemMessage("You are a careful agent.")]
    with jiuwen_hooks.session("lc-anthropic"):
        for i in range(4):
            history.append(HumanMessage(f"question {i}"))
            window = trim_messages(
                history, max_tokens=4, token_counter=len, strategy="last", include_system=True,
                start_on="human",
            )  # fmt: skip
            history.append(llm.invoke(window))
    assert {c.path.partition("?")[0] for c in engine.chats} == {"/v1/messages"}
    assert all(c.body.get("system") for c in engine.chats)
    assert_releases(engine, "lc-anthropic", 2)


async def test_langchain_chat_anthropic_streamed(engine: LocalEngine) -> None:
    llm = ChatAnthropic(model="m", base_url=engine.root_url, api_key="sk-test", max_retries=0)
    history: list[Any] = [SystemMessage("Be brief.")]
    with jiuwen_hooks.session("lc-anthropic-stream"):
        for i in range(3):
            history.append(HumanMessage(f"question {i}"))
            chunks = [c async for c in llm.astream(history[:1] + history[-1:])]
            assert chunks
    assert all(c.body.get("stream") for c in engine.chats)
    assert_releases(engine, "lc-anthropic-stream", 2)


def keep_last_three(messages: list[Any]) -> list[Any]:
    return messages[-3:]


def test_pydantic_ai_anthropic_model(engine: LocalEngine) -> None:
    provider = AnthropicProvider(base_url=engine.root_url, api_key="sk-test")
    agent = Agent(
        AnthropicModel("m", provider=provider),
        instructions="Be careful.",
        capabilities=[ProcessHistory(keep_last_three)],
    )
    history: list[Any] = []
    with jiuwen_hooks.session("pa-anthropic"):
        for i in range(4):
            history = agent.run_sync(f"question {i}", message_history=history).all_messages()
    assert [c.path.partition("?")[0] for c in engine.chats] == ["/v1/messages"] * 4
    assert_releases(engine, "pa-anthropic", 2)
