"""Compressors that tests name by dotted path (``install(compressors=[...])``)."""

from __future__ import annotations

from typing import Any

PLACEHOLDER = "[Old tool result content cleared]"


def clear_tool_results(messages: list[dict[str, Any]], keep_last: int = 1) -> None:
    """Micro-compaction in place: all but the last ``keep_last`` tool results are cleared."""
    tool_indices = [i for i, m in enumerate(messages) if m.get("role") == "tool"]
    for i in tool_indices[: max(0, len(tool_indices) - keep_last)]:
        messages[i] = {**messages[i], "content": PLACEHOLDER}


class Summariser:
    def compress(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [messages[0], {"role": "user", "content": "[summary]"}, *messages[-1:]]


async def async_drop_middle(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [messages[0], *messages[-1:]]
