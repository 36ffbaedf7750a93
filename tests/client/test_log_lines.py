"""The documented log lines (docs/client.md, "Log lines"), through Python logging (logger
``jiuwen_hooks``): operators grep for them."""

from __future__ import annotations

import logging
from typing import Any

import openai
import pytest
from callers import system_and_user

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine


def lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "jiuwen_hooks" and r.levelno == level
    ]


def test_release_lines(
    jiuwen_hook: Any, client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    window = system_and_user(3)
    tools = [
        {"type": "function", "function": {"name": f"t{i}", "parameters": {}}} for i in range(3)
    ]
    with caplog.at_level(logging.INFO, logger="jiuwen_hooks"), jiuwen_hooks.session("ops-1"):
        client.chat.completions.create(model="m", messages=window, tools=tools)
        client.chat.completions.create(model="m", messages=window[:2], tools=tools)
        client.chat.completions.create(model="m", messages=window[:2], tools=tools[:1])
    assert lines(caplog, logging.INFO) == [
        "KV cache release triggered for session ops-1 (msg_idx=2, tool_idx=None)",
        "[RELEASE REASON] Message modified at index 2",
        "KV cache release triggered for session ops-1 (msg_idx=2, tool_idx=1)",
        "[RELEASE REASON] Tool modified at index 1",
    ]


@pytest.mark.parametrize(("status", "expected"), [(500, "failed"), (404, "unsupported")])
def test_failure_lines(
    jiuwen_hook: Any, caplog: pytest.LogCaptureFixture, status: int, expected: str
) -> None:
    with LocalEngine() as engine:
        engine.answer_releases(status)
        client = openai.OpenAI(base_url=engine.base_url, api_key="sk-test", max_retries=0)
        window = system_and_user(2)
        with caplog.at_level(logging.WARNING, logger="jiuwen_hooks"), jiuwen_hooks.session("ops-2"):
            for _ in range(2):
                client.chat.completions.create(model="m", messages=window)
                client.chat.completions.create(model="m", messages=window[:1])
        client.close()
    (line,) = lines(caplog, logging.WARNING)  # once, however often it happens
    if expected == "failed":
        assert line.startswith("Failed to release inference-affinity KV cache: HTTP 500 from ")
    else:
        assert "does not support KV cache release" in line
        assert "KV cache release will not take effect" in line
