"""Pure core: the window a model request sends, read from its JSON body, for both OpenAI APIs.

- Chat Completions: ``messages`` and ``tools``.
- Responses: ``instructions`` (as a first ``{"instructions": ...}`` item, so a changed system
  prompt releases everything) and ``input`` (a string is one user message; items — messages,
  function calls, their outputs, reasoning — are compared as plain JSON), and ``tools``.

A Responses call that names ``previous_response_id`` or ``conversation`` keeps its history on the
server: the client never sees the whole window, so such calls are not tracked (``SERVER_HISTORY``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ._diff import Message, Window, canonical_tools, canonical_window, to_plain

CHAT_PATH = "/chat/completions"
RESPONSES_PATH = "/responses"

#: Why a Responses call was not tracked: its history lives on the server.
SERVER_HISTORY = "server_history"


def sequence(value: Any) -> list[Any] | tuple[Any, ...] | None:
    """Lists and tuples as they are; other iterables materialised once; sentinels such as
    openai's ``omit``/``NOT_GIVEN``, ``None``, strings and mappings → ``None``."""
    if isinstance(value, list | tuple):
        return value
    if value is None or isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        return None
    return list(value)


def api_of(path: str) -> str | None:
    """``"chat"`` / ``"responses"`` for the request paths the hook tracks, else ``None``."""
    path = path.rstrip("/")
    if path.endswith(CHAT_PATH):
        return "chat"
    if path.endswith(RESPONSES_PATH):
        return "responses"
    return None


def chat_window(body: Mapping[str, Any]) -> Window | None:
    messages = sequence(body.get("messages"))
    if messages is None:
        return None
    return Window(canonical_window(messages), canonical_tools(sequence(body.get("tools"))))


def responses_window(body: Mapping[str, Any]) -> Window | str | None:
    """The window of a Responses request; ``SERVER_HISTORY`` when the server holds the history;
    ``None`` when there is no input to track."""
    if body.get("previous_response_id") or body.get("conversation"):
        return SERVER_HISTORY
    raw = body.get("input")
    if isinstance(raw, str):
        items: tuple[Message, ...] = ({"role": "user", "content": raw},)
    else:
        listed = sequence(raw)
        if listed is None:
            return None
        items = tuple(to_plain(item) for item in listed)
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        items = ({"instructions": instructions}, *items)
    return Window(items, canonical_tools(sequence(body.get("tools"))), api="responses")


def window_of(api: str, body: Mapping[str, Any]) -> Window | str | None:
    return chat_window(body) if api == "chat" else responses_window(body)


def responses_body(window: Window) -> dict[str, Any]:
    """``instructions`` and ``input`` of a Responses window (the inverse of ``responses_window``,
    for the release request)."""
    items = list(window.messages)
    out: dict[str, Any] = {}
    if _has_instructions(window):
        out["instructions"] = items.pop(0)["instructions"]
    out["input"] = items
    return out


def _has_instructions(window: Window) -> bool:
    return bool(window.messages) and set(window.messages[0]) == {"instructions"}


def rewritten_messages(old: Window, output: Any) -> tuple[Message, ...]:
    """A compressor's output as the messages of a window of ``old``'s API: chat messages, or
    Responses input items after ``old``'s instructions."""
    if old.api == "chat":
        return canonical_window(output)
    items = tuple(to_plain(item) for item in output)
    if _has_instructions(old):
        items = (old.messages[0], *items)
    return items
