"""Tools for tests, benchmarks and demos (never imported by a server), in parts:

- ``servers``: ``VLLMServer``, a real vLLM server (CPU build) with or without the plugin;
- ``routers``: ``NginxRouter``, nginx in front of replicas;
- ``processes``: free ports, waits, process groups, ``LoopbackServer``;
- ``fillers``: prompts of a predictable size;
- ``kv_manager``: vLLM's real ``KVCacheManager`` with no model.

    with VLLMServer(num_blocks=64) as server:           # plugin enabled
        client = openai.OpenAI(base_url=server.base_url, api_key=server.api_key)
"""

from __future__ import annotations

from .fillers import FILLER_WORDS, filler_text, filler_window
from .kv_manager import kv_cache_manager
from .processes import (
    LoopbackServer,
    free_port,
    start_process_group,
    stop_process_group,
    wait_until,
)
from .routers import NginxRouter, Routed
from .servers import BLOCK_SIZE, SERVED_NAME, ServerStartError, VLLMServer, tool_call_parser

__all__ = [
    "BLOCK_SIZE",
    "FILLER_WORDS",
    "SERVED_NAME",
    "LoopbackServer",
    "NginxRouter",
    "Routed",
    "ServerStartError",
    "VLLMServer",
    "filler_text",
    "filler_window",
    "free_port",
    "kv_cache_manager",
    "start_process_group",
    "stop_process_group",
    "tool_call_parser",
    "wait_until",
]
