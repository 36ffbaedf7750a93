"""Pure core: the window a model request sends, read from its JSON body, for the OpenAI APIs and
the Anthropic Messages API.

- Chat Completions: ``messages`` and ``tools``.
- Responses: ``instructions`` (as a first ``{"instructions": ...}`` item, so a changed system
  prompt releases everything) and ``input`` (a string is one user message; items — messages,
  function calls, their outputs, reasoning — are compared as plain JSON), and ``tools``.
- Anthropic Messages: ``system`` (a first ``{"system": ...}`` item, likewise) and ``messages``
  (content blocks — text, tool_use, tool_result, images — compared as plain JSON), and
  ``tools``; ``cache_control`` markers are dropped everywhere: they move from call to call and
  change no token of the prompt.

A Responses call that names ``previous_response_id`` or ``conversation`` keeps its history on the
server: the client never sees the whole window, so such calls are not tracked (``SERVER_HISTORY``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ._diff import Message, Window, canonical_tools, canonical_window, to_plain

CHAT_PATH = "/chat/completions"
RESPONSES_PATH = "/responses"
MESSAGES_PATH = "/v1/messages"

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
    """``"chat"`` / ``"responses"`` / ``"messages"`` for the request paths the hook tracks (a
    query string, such as the Anthropic SDK's ``?beta=true``, is ignored), else ``None``."""
    path = path.partition("?")[0].rstrip("/")
    if path.endswith(CHAT_PATH):
        return "chat"
    if path.endswith(RESPONSES_PATH):
        return "responses"
    if path.endswith(MESSAGES_PATH):
        return "messages"
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


def without_cache_control(value: Any) -> Any:
    """``value`` as plain JSON (as ``to_plain``) with every ``cache_control`` key removed
    (Anthropic's prompt caching markers, which the prompt's tokens do not depend on). One pass:
    strings are shared, not copied, and not recursed into (the common message is a dict of
    strings, so this runs per message, not per field)."""
    kind = type(value)
    if kind is str or value is None or kind is int or kind is float or kind is bool:
        return value
    if kind is dict or isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if item is None or key == "cache_control":
                continue
            out[key if type(key) is str else str(key)] = (
                item if type(item) is str else without_cache_control(item)
            )
        return out
    if kind is list or kind is tuple or isinstance(value, list | tuple):
        return [item if type(item) is str else without_cache_control(item) for item in value]
    if isinstance(value, str | int | float | bool):  # subclasses (enums and the like)
        return value
    return without_cache_control(to_plain(value))  # SDK objects: dumped once, then as above


def messages_window(body: Mapping[str, Any]) -> Window | None:
    """The window of an Anthropic Messages request: ``system`` first (when given), then the
    messages; ``None`` when there are no messages to track."""
    messages = sequence(body.get("messages"))
    if messages is None:
        return None
    items = tuple(without_cache_control(m) for m in messages)
    system = body.get("system")
    if system:
        items = ({"system": without_cache_control(system)}, *items)
    tools = sequence(body.get("tools"))
    return Window(
        items,
        None if tools is None else tuple(without_cache_control(t) for t in tools),
        api="messages",
    )


def window_of(api: str, body: Mapping[str, Any]) -> Window | str | None:
    if api == "messages":
        return messages_window(body)
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


def messages_body(window: Window) -> dict[str, Any]:
    """``system`` and ``messages`` of an Anthropic window (the inverse of ``messages_window``)."""
    items = list(window.messages)
    out: dict[str, Any] = {}
    if _has_lead_item(window, "system"):
        out["system"] = items.pop(0)["system"]
    out["messages"] = items
    return out


def _has_lead_item(window: Window, key: str) -> bool:
    return bool(window.messages) and set(window.messages[0]) == {key}


def _has_instructions(window: Window) -> bool:
    return _has_lead_item(window, "instructions")


def rewritten_messages(old: Window, output: Any) -> tuple[Message, ...]:
    """A compressor's output as the messages of a window of ``old``'s API: chat messages, or
    Responses input items after ``old``'s instructions."""
    if old.api == "chat":
        return canonical_window(output)
    if old.api == "messages":
        items = tuple(without_cache_control(item) for item in output)
        return (old.messages[0], *items) if _has_lead_item(old, "system") else items
    items = tuple(to_plain(item) for item in output)
    if _has_instructions(old):
        items = (old.messages[0], *items)
    return items
