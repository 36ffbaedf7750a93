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

The rule's state lives in this API-server process (one digest per message of each session's
main thread). Requests that carry an ``X-KV-Release`` are the hook's, which releases exactly:
the rule leaves them alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jiuwen_kv_protocol.headers import CODING_AGENT_HEADERS, RELEASE_HEADER

from .core.compaction import (
    BRANCH_SEPARATOR,
    AgentWindow,
    CompactionRule,
    Verdict,
    Window,
    side_branch,
)
from .core.session_headers import MAX_SESSION_LENGTH
from .core.tenants import scoped
from .pool_affinity import RETRY_KEY, REWRITE_KEY


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
    return Window.of(messages, getattr(request, "tools", None))


def apply_compaction_rule(
    rule: CompactionRule,
    request: Any,
    headers: Mapping[str, str],
    principal: str,
    named: str,
    scope: str,
) -> tuple[str, Verdict | None]:
    """Judge the request's window; returns the session key it is bound under (the side
    branch's for a side request) and the verdict (``None``: the rule does not apply)."""
    if scope == "off" or headers.get(RELEASE_HEADER) is not None or BRANCH_SEPARATOR in named:
        return named, None
    if scope == "agents" and not is_agent_request(request, headers):
        return named, None
    window = window_of(request)
    if window is None:
        return named, None
    verdict = rule.classify(scoped(principal, named), window, agent_window_of(request, headers))
    if verdict == "side":
        request.session_id = side_branch(named)
        return request.session_id, verdict
    key = {"rewrite": REWRITE_KEY, "retry": RETRY_KEY}.get(verdict)
    if key is not None and hasattr(request, "vllm_xargs"):
        request.vllm_xargs = {**(request.vllm_xargs or {}), key: verdict}
    return named, verdict


def prompt_cache_key(request: Any) -> str | None:
    """The OpenAI SDK's ``prompt_cache_key`` (a Responses field; kept among a chat request's
    extra fields): an agent's session, and the last source of a session's name."""
    key = getattr(request, "prompt_cache_key", None)
    if key is None:
        key = (getattr(request, "model_extra", None) or {}).get("prompt_cache_key")
    if isinstance(key, str) and key.strip() and len(key) <= MAX_SESSION_LENGTH:
        return key.strip()
    return None
