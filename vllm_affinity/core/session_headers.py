"""Pure core: which request header names the session, for agents that never heard of us.

Coding agents and gateways already send a session id of their own. The plugin reads the first
of an ordered list of headers that a request carries (``VLLM_AFFINITY_SESSION_HEADERS``):

- ``X-Session-ID``: vLLM's own session header, and the hook's;
- ``X-Claude-Code-Session-Id``: Claude Code (one UUID per session, on every request). Its
  subagents carry ``X-Claude-Code-Agent-Id`` too; the agent id is appended
  (``<session>/<agent>``), so each subagent is a session of its own and the lead's cache is
  never released by a subagent's rewrite;
- ``thread-id``: the Codex CLI's thread (a subagent's own; its ``session-id`` is the root's);
- ``session-id``: the Codex CLI's session (the root thread);
- ``X-Session-Affinity``: gateways that pin a conversation to a replica, and opencode (which
  also sends ``X-Session-Id``: vLLM's own header, case aside);
- then Qwen Code's body ``metadata.sessionId`` (with its request metadata on), then the body's
  ``prompt_cache_key`` (the OpenAI SDK's field; the Codex CLI sets it to its thread), read by
  ``serving.py``.

A body ``session_id`` comes before all of them (vLLM's own rule).

A subagent's parent: ``X-Parent-Session-ID`` (the hook's ``session(id, parent=...)``, and
opencode's ``x-parent-session-id``: the same header), else the Codex CLI's
``x-codex-parent-thread-id``, else, for a Claude Code subagent, its session id without the
agent id (its lead).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jiuwen_kv_protocol.headers import (
    CLAUDE_CODE_AGENT_HEADER,
    CLAUDE_CODE_SESSION_HEADER,
    CODEX_PARENT_HEADER,
    CODEX_THREAD_HEADER,
    GENERIC_SESSION_HEADERS,
    PARENT_HEADER,
    SESSION_HEADER,
)

DEFAULT_SESSION_HEADERS: tuple[str, ...] = (
    SESSION_HEADER,
    CLAUDE_CODE_SESSION_HEADER,
    CODEX_THREAD_HEADER,
    *GENERIC_SESSION_HEADERS,
)
CLAUDE_CODE_SESSION = CLAUDE_CODE_SESSION_HEADER.lower()
CLAUDE_CODE_AGENT = CLAUDE_CODE_AGENT_HEADER.lower()
#: Longest session name taken from a header (longer values are ignored, not truncated).
MAX_SESSION_LENGTH = 512


def parse_header_list(value: str) -> tuple[str, ...]:
    """``"A, b ,C"`` → ``("A", "b", "C")``; raises ``ValueError`` when no name is left or a
    name is not a header name."""
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names:
        raise ValueError("expected a comma-separated list of header names")
    bad = [n for n in names if not all(c.isalnum() or c in "-_" for c in n)]
    if bad:
        raise ValueError(f"not header names: {bad}")
    return names


def session_from_headers(headers: Mapping[str, str], names: Sequence[str]) -> str | None:
    """The session a request names in the first of ``names`` it carries (``headers`` must look
    names up case-insensitively, as Starlette's do), or ``None``."""
    for name in names:
        value = (headers.get(name) or "").strip()
        if not value or len(value) > MAX_SESSION_LENGTH:
            continue
        if name.lower() == CLAUDE_CODE_SESSION:
            agent = (headers.get(CLAUDE_CODE_AGENT) or "").strip()
            if agent and len(value) + len(agent) < MAX_SESSION_LENGTH:
                return f"{value}/{agent}"
        return value
    return None


def parent_from_headers(headers: Mapping[str, str], names: Sequence[str]) -> str | None:
    """The parent session a subagent's request names (see the module's docstring), or
    ``None``."""
    for header in (PARENT_HEADER, CODEX_PARENT_HEADER):
        value = _value(headers, header)
        if value:
            return value
    if CLAUDE_CODE_SESSION in (n.lower() for n in names) and headers.get(CLAUDE_CODE_AGENT):
        return _value(headers, CLAUDE_CODE_SESSION)
    return None


def _value(headers: Mapping[str, str], name: str) -> str | None:
    """A header's value, when it is one a session may be named by."""
    value = (headers.get(name) or "").strip()
    return value if value and len(value) <= MAX_SESSION_LENGTH else None
