"""pydantic-ai: ``OpenAIResponsesModel`` (what ``"openai:..."`` resolves to) and
``OpenAIChatModel``, with a history processor that keeps the last three messages."""

from __future__ import annotations

from typing import Any

import pytest
from framework_wire import assert_releases
from pydantic_ai import Agent
from pydantic_ai.capabilities import ProcessHistory
from pydantic_ai.models import openai as openai_models
from pydantic_ai.providers.openai import OpenAIProvider

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine


def keep_last_three(messages: list[Any]) -> list[Any]:
    return messages[-3:]


@pytest.mark.parametrize("model_class", ["OpenAIResponsesModel", "OpenAIChatModel"])
def test_history_processor_releases(engine: LocalEngine, model_class: str) -> None:
    provider = OpenAIProvider(base_url=engine.base_url, api_key="sk-test")
    model = getattr(openai_models, model_class)("m", provider=provider)
    agent = Agent(model, instructions="Be careful.", capabilities=[ProcessHistory(keep_last_three)])
    history: list[Any] = []
    with jiuwen_hooks.session(f"pa-{model_class}"):
        for i in range(4):
            history = agent.run_sync(f"question {i}", message_history=history).all_messages()
    api = "/v1/responses" if model_class == "OpenAIResponsesModel" else "/v1/chat/completions"
    assert [c.path for c in engine.chats] == [api] * 4
    assert_releases(engine, f"pa-{model_class}", 2)
