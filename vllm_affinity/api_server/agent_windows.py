"""vLLM adapter, API-server side: a coding agent's compactions, told from its own requests.

For each request of a session, the rule of ``core/compaction.py`` gives a verdict on its window
before vLLM handles it:

- ``side``: the request is bound under the session's side-branch key, so that it never
  replaces the main thread's blocks in the engine's session table (it still idles on its own);
- ``retry``: the request carries ``kv_retry``: the engine keeps the replaced window apart, and
  the session's next request releases what of it that request cannot hit (the replaced
  message, when the thread goes on from the retry);
- ``rewrite``: the request carries ``kv_rewrite`` to the engine, which, before the request
  allocates, releases the side branch (when it carried the old conversation) and the main
  thread's blocks this window cannot hit;
- anything else: nothing changes.

The rule's state (one digest per message of each session's main thread) lives where every
request of a session is seen: in this API-server process when the server runs one
(``LocalWindows``), else in the engine core that serves the session (``EngineWindows``: with
``--api-server-count`` above 1, or data parallelism's API servers, each API server sees only
some of a session's requests). Requests that carry an ``X-KV-Release`` are the hook's, which
releases exactly: the rule leaves them alone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

from jiuwen_kv_protocol.headers import CODING_AGENT_HEADERS, RELEASE_HEADER

from ..core.compaction import (
    BRANCH_SEPARATOR,
    VERDICTS,
    AgentWindow,
    CompactionRule,
    DigestMemo,
    Verdict,
    Window,
    side_branch,
)
from ..core.request_keys import RETRY_KEY, REWRITE_KEY
from ..core.session_headers import MAX_SESSION_LENGTH


def is_agent_request(request: Any, headers: Mapping[str, str]) -> bool:
    """Whether the request carries a coding agent's own session header, Qwen Code's request
    metadata or ``prompt_cache_key`` (``VLLM_AFFINITY_INFER_COMPACTION=agents``)."""
    if prompt_cache_key(request) is not None or qwen_code_metadata(request) is not None:
        return True
    return any(headers.get(name) for name in CODING_AGENT_HEADERS)


def agent_window_of(request: Any, headers: Mapping[str, str]) -> AgentWindow | None:
    """What the agent says of the request's kind and window: the Codex CLI's headers, else
    Qwen Code's ``metadata.promptId``; ``None``: nothing (the window's shape decides)."""
    agent = AgentWindow.from_headers(headers)
    if agent is None:
        meta = qwen_code_metadata(request)
        if meta is not None and meta[1] is not None:
            agent = AgentWindow.from_qwen_prompt_id(meta[1])
    return agent


def qwen_code_metadata(request: Any) -> tuple[str, str | None] | None:
    """Qwen Code's body ``metadata`` (sent with ``enableRequestMetadata`` or a DashScope proxy
    URL): its ``sessionId`` and ``promptId``; ``None`` when there is no usable session id."""
    meta = getattr(request, "metadata", None)
    if meta is None:
        meta = (getattr(request, "model_extra", None) or {}).get("metadata")
    if not isinstance(meta, Mapping):
        return None
    session = meta.get("sessionId")
    if not isinstance(session, str) or not session.strip() or len(session) > MAX_SESSION_LENGTH:
        return None
    prompt_id = meta.get("promptId")
    return session.strip(), prompt_id if isinstance(prompt_id, str) else None


#: The digests of the messages this API server has judged: each turn resends the whole window,
#: and only its new messages are serialised and hashed (``benchmarks/server/window_digest.py``).
_DIGESTS = DigestMemo()


def window_of(request: Any) -> Window | None:
    """The request's window: a chat request's messages (the Messages API arrives converted to
    them), a Responses request's instructions and input items; ``None`` for a completion."""
    messages = getattr(request, "messages", None)
    if messages is None:
        items = getattr(request, "input", None)
        if items is None:
            return None
        instructions = getattr(request, "instructions", None)
        items = [items] if isinstance(items, str) else list(items)
        messages = [instructions, *items] if instructions else items
    return Window.of(messages, getattr(request, "tools", None), _DIGESTS)


def window_to_judge(
    request: Any, headers: Mapping[str, str], named: str, scope: str
) -> tuple[Window, AgentWindow | None] | None:
    """The request's window and what its agent says of it, when the rule applies to it
    (``scope``: ``VLLM_AFFINITY_INFER_COMPACTION``); ``None`` when it does not."""
    if scope == "off" or headers.get(RELEASE_HEADER) is not None or BRANCH_SEPARATOR in named:
        return None
    if scope == "agents" and not is_agent_request(request, headers):
        return None
    window = window_of(request)
    if window is None:
        return None
    return window, agent_window_of(request, headers)


def apply_verdict(request: Any, named: str, verdict: Verdict) -> str:
    """The session key the request is bound under (the side branch's for a side request); a
    rewrite or a retry is carried to the engine in ``vllm_xargs``."""
    if verdict == "side":
        request.session_id = side_branch(named)
        return str(request.session_id)
    key = {"rewrite": REWRITE_KEY, "retry": RETRY_KEY}.get(verdict)
    if key is not None and hasattr(request, "vllm_xargs"):
        request.vllm_xargs = {**(request.vllm_xargs or {}), key: verdict}
    return named


class LocalWindows:
    """The rule's state in this API-server process: every request of a session is seen here
    when the server runs one API server."""

    def __init__(self, max_sessions: int) -> None:
        self.rule = CompactionRule(max_sessions)

    async def classify(self, session: str, window: Window, agent: AgentWindow | None) -> Verdict:
        return self.rule.classify(session, window, agent)


#: Calls an engine utility on the engine core that serves ``session``.
CallEngine = Callable[..., Awaitable[Any]]


class EngineWindows:
    """The rule's state in the session's engine core (``EngineCore.affinity_classify_window``):
    with several API servers (``--api-server-count``, data parallelism) each sees only some of
    a session's requests, the engine that serves the session sees them all. One engine utility
    call per judged request."""

    def __init__(self, call_engine: CallEngine) -> None:
        self._call_engine = call_engine

    async def classify(self, session: str, window: Window, agent: AgentWindow | None) -> Verdict:
        wire = agent.to_wire() if agent is not None else None
        verdict = await self._call_engine(
            session, "affinity_classify_window", session, window.to_wire(), wire
        )
        if verdict not in VERDICTS:
            raise ValueError(f"the engine answered {verdict!r}, not a verdict")
        return cast(Verdict, verdict)


def prompt_cache_key(request: Any) -> str | None:
    """The OpenAI SDK's ``prompt_cache_key`` (a Responses field; kept among a chat request's
    extra fields): an agent's session, and the last source of a session's name."""
    key = getattr(request, "prompt_cache_key", None)
    if key is None:
        key = (getattr(request, "model_extra", None) or {}).get("prompt_cache_key")
    if isinstance(key, str) and key.strip() and len(key) <= MAX_SESSION_LENGTH:
        return key.strip()
    return None
