"""Session resolution and what a tracked chat request carries: the ``X-Session-ID`` header, the
in-request release header, and (only when asked for) ``cache_salt`` in the body.

First match wins: explicit ``extra_body["cache_salt"]``; the ``session()`` context (a contextvar,
so threads and asyncio tasks each keep their own); the ``X-Session-ID`` header; a user resolver.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from vllm_affinity.core.hint import HEADER as RELEASE_HEADER

from ._options import SessionResolver
from ._telemetry import logger

SESSION_HEADER = "X-Session-ID"

_current_session: ContextVar[str | None] = ContextVar("jiuwen_hooks_session", default=None)


@contextmanager
def session(session_id: str) -> Iterator[str]:
    """Run model calls (and compressors) inside this block as session ``session_id``."""
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"jiuwen_hooks.session() needs a non-empty string, got {session_id!r}")
    token = _current_session.set(session_id)
    try:
        yield session_id
    finally:
        _current_session.reset(token)


def current_session() -> str | None:
    return _current_session.get()


def _header(headers: Any, name: str) -> str | None:
    if not isinstance(headers, Mapping):
        return None
    lowered = name.lower()
    for key, value in headers.items():
        if isinstance(key, str) and key.lower() == lowered and isinstance(value, str) and value:
            return value
    return None


def resolve_session(kwargs: dict[str, Any], resolver: SessionResolver | None) -> str | None:
    body = kwargs.get("extra_body")
    if isinstance(body, Mapping):
        salt = body.get("cache_salt")
        if isinstance(salt, str) and salt:
            return salt
    if (current := _current_session.get()) is not None:
        return current
    if (header := _header(kwargs.get("extra_headers"), SESSION_HEADER)) is not None:
        return header
    if resolver is not None:
        try:
            resolved = resolver(kwargs)
        except Exception:
            logger.warning(
                "jiuwen_hooks: the session resolver raised; call not tracked", exc_info=True
            )
            return None
        if isinstance(resolved, str) and resolved:
            return resolved
    return None


def with_session(
    kwargs: dict[str, Any],
    session_id: str,
    *,
    header: bool = True,
    body: bool = False,
    cache_sharing: bool | None = None,
    release: str | None = None,
    trace: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A copy of ``kwargs`` that carries the session (header; body fields only with ``body``) and
    an in-request release header with its trace context, keeping every value the caller set (the
    caller's dicts are never mutated)."""
    out = dict(kwargs)
    if body:
        raw_body = kwargs.get("extra_body")
        extra_body = dict(raw_body) if isinstance(raw_body, Mapping) else {}
        extra_body.setdefault("cache_salt", session_id)
        if cache_sharing is not None:
            extra_body.setdefault("cache_sharing", cache_sharing)
        out["extra_body"] = extra_body
    raw_headers = kwargs.get("extra_headers")
    headers = dict(raw_headers) if isinstance(raw_headers, Mapping) else {}
    if header and _header(headers, SESSION_HEADER) is None:
        headers[SESSION_HEADER] = session_id
    if release is not None:
        headers[RELEASE_HEADER] = release
        for name, value in (trace or {}).items():  # joins the server's span to the release's
            if _header(headers, name) is None:
                headers[name] = value
    if headers or raw_headers is not None:
        out["extra_headers"] = headers
    return out


def hashed_with_salt(kwargs: dict[str, Any]) -> bool:
    """Whether the engine hashes this request's blocks with a ``cache_salt`` (not shared)."""
    body = kwargs.get("extra_body")
    if not isinstance(body, Mapping):
        return False
    salt = body.get("cache_salt")
    return isinstance(salt, str) and bool(salt) and body.get("cache_sharing") is not True
