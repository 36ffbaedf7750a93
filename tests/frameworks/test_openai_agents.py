"""openai-agents: the default ``OpenAIResponsesModel`` (Responses API) and
``OpenAIChatCompletionsModel``; the agent keeps a sliding window of its input list."""

from __future__ import annotations

import agents
import openai
import pytest
from framework_wire import assert_releases

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine

agents.set_tracing_disabled(True)  # no export to api.openai.com


@pytest.mark.parametrize("model_class", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
async def test_sliding_window_releases(engine: LocalEngine, model_class: str) -> None:
    client = openai.AsyncOpenAI(base_url=engine.base_url, api_key="sk-test", max_retries=0)
    model = getattr(agents, model_class)(model="m", openai_client=client)
    agent = agents.Agent(name="researcher", instructions="Be careful.", model=model)
    items: list[agents.TResponseInputItem] = []
    with jiuwen_hooks.session(f"oa-{model_class}"):
        for i in range(4):
            items.append({"role": "user", "content": f"question {i}"})
            result = await agents.Runner.run(agent, items[-3:])  # the last three items only
            items = result.to_input_list()
    await client.close()
    sent = [c.path for c in engine.chats]
    api = "/v1/responses" if model_class == "OpenAIResponsesModel" else "/v1/chat/completions"
    assert sent == [api] * 4
    assert_releases(engine, f"oa-{model_class}", 2)
