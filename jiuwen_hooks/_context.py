"""Session resolution and what a tracked model request carries: the ``X-Session-ID`` header, the
in-request release header, and (only when asked for) ``cache_salt`` in the body.

First match wins: an explicit ``cache_salt`` in the extra body; openJiuwen's
``agent_hint.session_id`` in the extra body; the ``session()`` context (a contextvar, so threads
and asyncio tasks each keep their own); the ``X-Session-ID`` header of the call; the same header
among the client's ``default_headers``; an Anthropic call's ``metadata.user_id`` (only with
``session_from_user_id``); a user resolver.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from jiuwen_kv_protocol.headers import (
    NEXT_USE_HEADER,
    PARENT_HEADER,
    RELEASE_HEADER,
    SESSION_HEADER,
)

from . import _state
from ._options import SessionResolver
from ._telemetry import logger

_current_session: ContextVar[str | None] = ContextVar("jiuwen_hooks_session", default=None)
_next_use: ContextVar[float | None] = ContextVar("jiuwen_hooks_next_use", default=None)
_current_parent: ContextVar[str | None] = ContextVar("jiuwen_hooks_parent", default=None)


@dataclass(frozen=True, slots=True)
class ModelCall:
    """One model request as the SDK is about to send it, in plain terms (no openai types)."""

    api: str  # "chat" | "responses"
    body: Mapping[str, Any]  # the request's JSON body, as the SDK built it
    extra_body: Mapping[str, Any] | None = None  # the caller's ``extra_body``
    headers: Mapping[str, Any] | None = None  # the caller's ``extra_headers``
    default_headers: Mapping[str, Any] | None = field(default=None, repr=False)  # the client's
    base_url: str = ""
    api_key: str | None = None
    #: The list object the caller passed (``messages`` / ``input``), to recognise it later in a
    #: compressor; ``None`` when unknown.
    caller_list: Any = field(default=None, repr=False)

    def create_kwargs(self) -> dict[str, Any]:
        """What a session resolver receives: the body's fields plus ``extra_body`` and
        ``extra_headers``, like the keyword arguments of ``create``."""
        return {**self.body, "extra_body": self.extra_body, "extra_headers": self.headers}


@contextmanager
def session(
    session_id: str, *, parent: str | None = None, end_on_exit: bool = False
) -> Iterator[str]:
    """Run model calls (and compressors) inside this block as session ``session_id``.

    ``parent``: the session is a subagent of ``parent`` (``X-Parent-Session-ID``, sent only to
    engines with the plugin): while it runs, the server keeps the waiting parent's cache after
    every other session's, and when one of its calls ends its task (``stop``) its own cache is
    released as dead.

    ``end_on_exit``: the block is the whole session (a task run, a closed conversation), so
    leaving it, by any path, ends the session as ``jiuwen_hooks.end_session`` does. Off by
    default: many agents enter ``session()`` once per turn, and a turn's end is no session's.
    """
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"jiuwen_hooks.session() needs a non-empty string, got {session_id!r}")
    if parent is not None and (not isinstance(parent, str) or not parent or parent == session_id):
        raise ValueError(
            f"jiuwen_hooks.session() parent must be another session's id, got {parent!r}"
        )
    token = _current_session.set(session_id)
    parent_token = _current_parent.set(parent)
    try:
        yield session_id
    finally:
        _current_parent.reset(parent_token)
        _current_session.reset(token)
        if end_on_exit:
            hook = _state.installed()
            if hook is not None:
                hook.end_session(session_id)


def current_session() -> str | None:
    return _current_session.get()


def current_parent(session_id: str) -> str | None:
    """The parent ``session()`` named, when ``session_id`` is the context's session."""
    return _current_parent.get() if _current_session.get() == session_id else None


@contextmanager
def next_use(seconds: float) -> Iterator[float]:
    """Model calls inside this block tell the server that their session's next call comes about
    ``seconds`` after each of them ends (``X-KV-Next-Use``): 10 s or more and the server reuses
    the session's blocks before those of sessions back sooner, less and it keeps them as live.
    For agents that know, e.g. before a long tool run or a human approval step. Sent only to
    engines where the hook found the vllm_affinity plugin."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ValueError(f"jiuwen_hooks.next_use() needs seconds, got {seconds!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"jiuwen_hooks.next_use() needs finite seconds >= 0, got {seconds!r}")
    token = _next_use.set(float(seconds))
    try:
        yield float(seconds)
    finally:
        _next_use.reset(token)


def current_next_use() -> float | None:
    return _next_use.get()


def header(headers: Any, name: str) -> str | None:
    if not isinstance(headers, Mapping):
        return None
    lowered = name.lower()
    for key, value in headers.items():
        if isinstance(key, str) and key.lower() == lowered and isinstance(value, str) and value:
            return value
    return None


def _body_session(extra_body: Any) -> str | None:
    if not isinstance(extra_body, Mapping):
        return None
    salt = extra_body.get("cache_salt")
    if isinstance(salt, str) and salt:
        return salt
    hint = extra_body.get("agent_hint")
    if isinstance(hint, Mapping):
        session_id = hint.get("session_id")
        if isinstance(session_id, str) and session_id:
            return session_id
    return None


def _user_id(body: Mapping[str, Any]) -> str | None:
    """An Anthropic request's ``metadata.user_id``."""
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    return user_id if isinstance(user_id, str) and user_id else None


def resolve_session(
    call: ModelCall, resolver: SessionResolver | None, from_user_id: bool = False
) -> str | None:
    if (found := _body_session(call.extra_body)) is not None:
        return found
    if (current := _current_session.get()) is not None:
        return current
    if (found := header(call.headers, SESSION_HEADER)) is not None:
        return found
    if (found := header(call.default_headers, SESSION_HEADER)) is not None:
        return found
    if from_user_id and call.api == "messages" and (found := _user_id(call.body)) is not None:
        return found
    if resolver is not None:
        try:
            resolved = resolver(call.create_kwargs())
        except Exception:
            logger.warning(
                "jiuwen_hooks: the session resolver raised; call not tracked", exc_info=True
            )
            return None
        if isinstance(resolved, str) and resolved:
            return resolved
    return None


def session_headers(
    headers: Mapping[str, Any] | None,
    session_id: str,
    *,
    release: str | None = None,
    trace: Mapping[str, str] | None = None,
    next_use: float | None = None,
    parent: str | None = None,
) -> dict[str, Any]:
    """A copy of the caller's headers with the session (unless it named one), the expected time
    to the session's next call (``next_use``) and its parent (unless the caller set them) and,
    for an in-request
    release, the release header and the trace context that joins the server's span to the
    release's. The caller's dict is never mutated."""
    out = dict(headers) if isinstance(headers, Mapping) else {}
    if header(out, SESSION_HEADER) is None:
        out[SESSION_HEADER] = session_id
    if next_use is not None and header(out, NEXT_USE_HEADER) is None:
        out[NEXT_USE_HEADER] = f"{next_use:g}"
    if parent is not None and header(out, PARENT_HEADER) is None:
        out[PARENT_HEADER] = parent
    if release is not None:
        out[RELEASE_HEADER] = release
        for name, value in (trace or {}).items():
            if header(out, name) is None:
                out[name] = value
    return out


def salted_body(
    extra_body: Mapping[str, Any] | None, session_id: str, cache_sharing: bool | None
) -> dict[str, Any]:
    """A copy of the caller's extra body with ``cache_salt`` (and ``cache_sharing``), keeping any
    value the caller set."""
    out = dict(extra_body) if isinstance(extra_body, Mapping) else {}
    out.setdefault("cache_salt", session_id)
    if cache_sharing is not None:
        out.setdefault("cache_sharing", cache_sharing)
    return out


def hashed_with_salt(extra_body: Any) -> bool:
    """Whether the engine hashes this request's blocks with a ``cache_salt`` (not shared)."""
    if not isinstance(extra_body, Mapping):
        return False
    salt = extra_body.get("cache_salt")
    return isinstance(salt, str) and bool(salt) and extra_body.get("cache_sharing") is not True
