"""The names on the wire between an agent (``jiuwen_hooks``) and the server plugin
(``vllm_affinity``): headers and paths. Spelled here once; both sides import them."""

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
