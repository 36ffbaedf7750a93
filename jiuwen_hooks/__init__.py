"""jiuwen_hooks: tell vLLM which part of an agent session's cached prompt is stale.

    import jiuwen_hooks
    jiuwen_hooks.install()
    with jiuwen_hooks.session("agent-42"):
        client.chat.completions.create(model=..., messages=window)

Every tracked chat call carries its session in the ``X-Session-ID`` header and diffs its window
against the session's previous one. When history was rewritten, the release rides on that call
(``X-KV-Release``) where the engine runs the vllm_affinity plugin, or goes first as
``POST /release_kv_cache``. Nothing here ever raises into the agent, and no body field is added.
"""

from ._compressor import compressor
from ._context import current_session, next_use, session
from ._hook import Hook
from ._install import end_session, install, installed, stats, uninstall
from ._options import Options
from ._version import __version__

__all__ = [
    "Hook",
    "Options",
    "__version__",
    "compressor",
    "current_session",
    "end_session",
    "install",
    "installed",
    "next_use",
    "session",
    "stats",
    "uninstall",
]
