"""vLLM adapter, engine side: every plugin path in vLLM's engine core fails open.

A bug of the plugin must never stop vLLM's scheduler or fail a request: each wrap of a vLLM
method (``patches.py``) runs vLLM's own method exactly once, whatever the plugin does, and the
plugin's part before or after it is caught here: counted per path
(``vllm_affinity_engine_errors_total{path}``), logged once per path with its stack, and vLLM goes
on with its own answer, as if the plugin were absent for that request or step.

A failure while a KV-cache manager is built (its groups read) detaches the plugin from that pool
for good: a pool the plugin half knows is worse than one it does not know at all.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

logger = logging.getLogger("vllm_affinity")

#: Where the plugin runs inside the engine core (the label of the errors counter).
EnginePath = Literal[
    "block_pool_init",
    "kv_cache_manager_init",
    "get_computed_blocks",
    "cache_blocks",
    "free",
    "add_request",
    "schedule",
    "handout",
    "picker",
    "utility",
    "offload",
]


class EngineErrors:
    """The plugin's failures caught in this engine-core process, by path (one process serves one
    engine core, so the counts are the process's)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        #: Malformed values of the request keys the API server sets, by key (ignored).
        self.malformed: Counter[str] = Counter()

    def caught(self, path: EnginePath, exc: BaseException) -> None:
        """Count a failure of ``path``; the first of each path is logged with its stack."""
        self.counts[path] += 1
        if self.counts[path] == 1:
            logger.error(
                "vllm_affinity: the plugin failed in the engine's %s path; vLLM goes on as if "
                "the plugin were absent there (counted in vllm_affinity_engine_errors_total, "
                "logged once per path)",
                path,
                exc_info=exc,
            )

    def malformed_value(self, key: str) -> None:
        """Count a request key whose value has the wrong type (ignored)."""
        self.malformed[key] += 1
        if self.malformed[key] == 1:
            logger.warning(
                "vllm_affinity: a request's %r value is malformed: ignored (counted in "
                "vllm_affinity_engine_malformed_args_total, logged once per key)",
                key,
            )


#: This process's failures (every pool and utility of the engine core counts here).
ERRORS = EngineErrors()


def utility(path: EnginePath = "utility") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An ``EngineCore`` utility whose failure is counted and logged, then raised to its caller
    (vLLM answers a utility call's failure to the API server, which falls back as vanilla
    would); the engine itself goes on."""

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            except Exception as exc:
                ERRORS.caught(path, exc)
                raise

        return counted

    return decorate
