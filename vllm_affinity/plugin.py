"""vLLM entry points.

- ``vllm.general_plugins`` → ``register``: engine-side patches (every vLLM process).
- ``vllm.endpoint_plugins`` → ``AffinityEndpoint``: the HTTP routes (API server only).

Both are named ``vllm_affinity``; endpoint plugins load only when named in ``VLLM_PLUGINS``
(the launcher, ``python -m vllm_affinity serve``, sets it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from argparse import Namespace
from typing import Any

from .settings import Settings

NAME = "vllm_affinity"
logger = logging.getLogger("vllm_affinity")


def register() -> None:
    """General plugin: patch the engine (idempotent; also runs in the API server process) and
    add the engine's figures to ``/metrics`` where several API servers share it."""
    from .api_server.metrics import expose_engine_snapshot
    from .engine.patches import apply_engine_patches

    apply_engine_patches()
    expose_engine_snapshot()


class AffinityEndpoint:
    """Endpoint plugin: ``POST /release_kv_cache``, ``GET /affinity/stats``, ``cache_sharing``."""

    name = NAME
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.settings = Settings.from_env()
        self._refresh: asyncio.Task[None] | None = None
        self._metrics: Any = None  # AffinityMetrics, once init_state ran

    def attach_router(self, app: Any) -> None:
        from .api_server.route import attach

        attach(app, self.settings, self._count_hint)

    def _count_hint(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.count_hint(outcome)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        if engine_client is None:
            return
        from vllm import envs

        from .api_server.metrics import AffinityMetrics
        from .api_server.release_service import ReleaseService

        config = engine_client.vllm_config
        tokens = [key for key in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if key]
        service = ReleaseService(
            engine_client=engine_client,
            serving_chat=state.openai_serving_chat,
            serving_responses=getattr(state, "openai_serving_responses", None),
            serving_messages=getattr(state, "anthropic_serving_messages", None),
            block_size=config.cache_config.block_size,
            max_model_len=config.model_config.max_model_len,
            api_tokens=[hashlib.sha256(t.encode()).digest() for t in tokens],
            settings=self.settings,
            metrics=AffinityMetrics(),
            data_parallel_size=config.parallel_config.data_parallel_size,
            api_servers=getattr(config.parallel_config, "_api_process_count", 1),
        )
        self._metrics = service.metrics
        state.jiuwen_affinity = service
        self._refresh = asyncio.get_running_loop().create_task(self._refresh_stats(service))
        logger.info(
            "vllm_affinity: /release_kv_cache ready (block size %d, cache sharing %s); "
            "requests that name no session: %s (VLLM_AFFINITY_IMPLICIT_SESSIONS)",
            service.block_size,
            "allowed" if self.settings.allow_cache_sharing else "refused",
            "told by the answers they carry back"
            if self.settings.implicit_sessions == "answers"
            else "served as vanilla vLLM does",
        )

    async def _refresh_stats(self, service: Any) -> None:
        while True:
            with contextlib.suppress(Exception):  # the engine may be starting or gone
                await service.stats()
            await asyncio.sleep(self.settings.stats_interval)
