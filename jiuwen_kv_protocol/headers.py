"""The names on the wire between an agent (``jiuwen_hooks``) and the server plugin
(``vllm_affinity``): headers, paths and span names. Spelled here once; both sides import them."""

from __future__ import annotations

#: A tracked request's session (vLLM reads it too).
SESSION_HEADER = "X-Session-ID"
#: The in-request release on the request that carries the rewritten window (``hint.py``).
RELEASE_HEADER = "X-KV-Release"
#: Seconds the agent expects until the session's next call, once this one ends.
NEXT_USE_HEADER = "X-KV-Next-Use"
#: The session a subagent works for.
PARENT_HEADER = "X-Parent-Session-ID"

#: The release endpoint, under the engine root (the base URL without ``/v1``).
RELEASE_PATH = "/release_kv_cache"
#: What the plugin advertises; vanilla servers answer 404.
CAPABILITIES_PATH = "/affinity/capabilities"


def engine_root(base_url: str) -> str:
    """``http://host:8000/v1/`` → ``http://host:8000``: the root the paths above are under
    (an OpenAI SDK's base URL ends in ``/v1``)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


#: Session headers that coding agents send on their own (read by the plugin, never sent by the
#: hook): Claude Code's session and, for its subagents, agent id; two generic spellings.
CLAUDE_CODE_SESSION_HEADER = "X-Claude-Code-Session-Id"
CLAUDE_CODE_AGENT_HEADER = "X-Claude-Code-Agent-Id"
GENERIC_SESSION_HEADERS = ("session-id", "X-Session-Affinity")
#: The Codex CLI: its thread (a subagent's own), its parent thread, and what it says of each
#: request (the context window's number, the request's kind).
CODEX_THREAD_HEADER = "thread-id"
CODEX_PARENT_HEADER = "x-codex-parent-thread-id"
CODEX_WINDOW_HEADER = "x-codex-window-id"
CODEX_METADATA_HEADER = "x-codex-turn-metadata"
#: opencode's parent session (a subagent's ``task`` session names its lead).
OPENCODE_PARENT_HEADER = "x-parent-session-id"
#: Headers only coding agents send: a request carrying one is an agent's, whose compactions
#: the server tells by itself (the hook never sends them).
CODING_AGENT_HEADERS = (
    CLAUDE_CODE_SESSION_HEADER,
    *GENERIC_SESSION_HEADERS,
    CODEX_THREAD_HEADER,
    CODEX_WINDOW_HEADER,
    CODEX_METADATA_HEADER,
)

#: The span both sides record for a release (the client's CLIENT span is the parent of the
#: server's SERVER span: the trace context rides on the release request or the chat request).
RELEASE_SPAN = "kv_cache.release"
#: Span attributes, after OpenTelemetry's GenAI semantic conventions.
SESSION_ATTRIBUTE = "gen_ai.conversation.id"
MODEL_ATTRIBUTE = "gen_ai.request.model"
