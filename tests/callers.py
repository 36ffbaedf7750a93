"""One way to make chat calls from tests, sync or async, through the real openai client."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import openai

import jiuwen_hooks


class Caller:
    """``caller(messages, session="s", **create_kwargs)``: one chat call, in ``mode``.

    The async mode keeps one event loop (``asyncio.Runner``) for the caller's lifetime, so the
    AsyncOpenAI client and the hook's async HTTP client are reused as in a real agent.
    """

    def __init__(self, mode: str, base_url: str, api_key: str = "sk-test") -> None:
        self.mode = mode
        if mode == "sync":
            self.client: Any = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        else:
            self._runner = asyncio.Runner()
            self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)

    def __call__(self, messages: Any, session: str | None = "s", **kwargs: Any) -> Any:
        kwargs.setdefault("model", "m")
        if self.mode == "sync":
            if session is None:
                return self.client.chat.completions.create(messages=messages, **kwargs)
            with jiuwen_hooks.session(session):
                return self.client.chat.completions.create(messages=messages, **kwargs)
        return self.run(self._acall(messages, session, kwargs))

    async def _acall(self, messages: Any, session: str | None, kwargs: dict[str, Any]) -> Any:
        if session is None:
            result = await self.client.chat.completions.create(messages=messages, **kwargs)
        else:
            with jiuwen_hooks.session(session):
                result = await self.client.chat.completions.create(messages=messages, **kwargs)
        if kwargs.get("stream"):
            return [chunk async for chunk in result]
        return result

    def run(self, coro: Any) -> Any:
        """Run on the caller's loop in a copy of the current context (spans, session)."""
        return self._runner.run(coro, context=contextvars.copy_context())

    def close(self) -> None:
        if self.mode == "sync":
            self.client.close()
        else:
            self._runner.run(self.client.close())
            self._runner.close()


def system_and_user(n_turns: int = 1) -> list[dict[str, str]]:
    window = [{"role": "system", "content": "You are a careful agent."}]
    for i in range(n_turns):
        window.append({"role": "user", "content": f"question {i}"})
    return window
