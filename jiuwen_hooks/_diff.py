"""Pure core of the client: canonical wire messages and the window diff.

No I/O and no openai import: everything here is exercised directly by unit and property tests.
Windows are compared on *canonical wire dicts* (the fields a chat template renders), never on
framework objects, so a dict and the SDK's pydantic message with the same content compare equal.
Canonical dicts share the caller's string objects (strings are immutable), so a snapshot costs
a few small dicts per message, not a copy of the text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The message fields that reach the prompt; everything else (refusal, annotations, ...) is ignored.
WIRE_KEYS: tuple[str, ...] = ("role", "content", "name", "tool_calls", "tool_call_id")

Message = dict[str, Any]


def to_plain(value: Any) -> Any:
    """Turn pydantic models, mappings and sequences into plain JSON-like values.

    ``None`` values inside mappings are dropped so that ``{"name": None}`` and a missing key, or a
    pydantic object and the dict it was dumped to, compare equal. Strings are returned as is.
    """
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items() if v is not None}
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump):
        return to_plain(model_dump(exclude_none=True))
    if isinstance(value, Sequence) or hasattr(value, "__iter__"):
        return [to_plain(v) for v in value]
    return value


def canonical_message(message: Any) -> Message:
    """The wire form of one chat message: a dict, a pydantic message object or any object with the
    same attributes. Empty ``tool_calls`` is treated as absent (templates treat them alike)."""
    get: Callable[[str], Any]
    if isinstance(message, Mapping):
        get = message.get
    else:

        def get(key: str) -> Any:
            return getattr(message, key, None)

    out: Message = {}
    for key in WIRE_KEYS:
        value = get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            value = to_plain(value)
            if key == "tool_calls" and not value:
                continue
        out[key] = value
    return out


def canonical_window(messages: Any) -> tuple[Message, ...]:
    return tuple(canonical_message(m) for m in messages)


def canonical_tools(tools: Any) -> tuple[Message, ...] | None:
    """``None`` when no tools were sent; a tuple of plain tool dicts otherwise."""
    if tools is None:
        return None
    return tuple(to_plain(t) for t in tools)


@dataclass(frozen=True, slots=True)
class Window:
    """What one model request sent: canonical messages and tools (``None``: no tools field).

    ``api`` is ``"chat"`` (Chat Completions ``messages``) or ``"responses"`` (Responses API: an
    optional ``{"instructions": ...}`` item first, then the ``input`` items).
    """

    messages: tuple[Message, ...]
    tools: tuple[Message, ...] | None = None
    api: str = "chat"


@dataclass(frozen=True, slots=True)
class Release:
    """A release the engine should perform for the previous window.

    ``messages_released_index`` is the first message whose cached tokens are stale;
    ``tools_released_index`` the first changed tool, or ``None`` when the tools did not change.
    """

    messages_released_index: int
    tools_released_index: int | None
    reason: str  # "rewrite" | "truncate" | "tools" | "compressor:<name>"

    def relabel(self, reason: str) -> Release:
        return Release(self.messages_released_index, self.tools_released_index, reason)


#: Leading items every session of an agent tends to share: a chat ``system`` (or
#: ``developer``) message, the Responses API's ``instructions`` item, Anthropic's ``system``.
_HEAD_ROLES = ("system", "developer")
_HEAD_ITEMS = ("instructions", "system")


def head_length(window: Window) -> int:
    """How many leading items of ``window`` are its instructions (system prompt): the part
    other sessions of the same agent send too, which an ended session's release keeps."""
    count = 0
    for message in window.messages:
        if not _is_head(message):
            break
        count += 1
    return count


def _is_head(message: Message) -> bool:
    role = message.get("role")
    if role is not None:
        return role in _HEAD_ROLES
    return any(key in message for key in _HEAD_ITEMS)  # a Responses or Anthropic lead item


def first_difference(old: Sequence[Any], new: Sequence[Any]) -> int | None:
    """Index of the first element that differs; the shorter length when one sequence is a proper
    prefix of the other; ``None`` when both are equal."""
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        if a is not b and a != b:
            return i
    if len(old) != len(new):
        return min(len(old), len(new))
    return None


def diff_windows(old: Window, new: Window) -> Release | None:
    """First differing message → rewrite; strict truncation → ``len(new)``; pure append →
    nothing. A changed tools list adds ``tools_released_index`` (and, when no message changed,
    releases from ``len(old.messages)``, i.e. only what the tools affect). A session that moved
    to the other API renders differently from the first token: everything is released."""
    if old.api != new.api:
        return Release(0, 0 if old.tools else None, "rewrite")
    k = first_difference(old.messages, new.messages)
    if k is not None and k >= len(old.messages):
        k = None  # pure append
    j = first_difference(old.tools or (), new.tools or ())
    if k is None and j is None:
        return None
    if k is None:
        return Release(len(old.messages), j, "tools")
    reason = "truncate" if k == len(new.messages) else "rewrite"
    return Release(k, j, reason)


@dataclass(frozen=True, slots=True)
class ReleasePolicy:
    """When a computed release is not worth sending.

    ``min_released_messages``: skip releases that would free fewer messages than this.
    ``ignore_trailing_messages``: the last N messages of a window are volatile (a clock, an
    attachment list): a change confined to them releases nothing.
    Tool changes are always sent: they usually invalidate the start of the prompt.
    """

    min_released_messages: int = 1
    ignore_trailing_messages: int = 0

    def skip_reason(self, release: Release, old_len: int) -> str | None:
        if release.tools_released_index is not None:
            return None
        freed = old_len - release.messages_released_index
        if self.ignore_trailing_messages and freed <= self.ignore_trailing_messages:
            return "volatile_tail"
        if freed < self.min_released_messages:
            return "below_min_gain"
        return None
