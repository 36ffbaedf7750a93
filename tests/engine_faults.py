"""Failures injected into the plugin's engine paths, for the fail-open tests (``fail_open.py``).

``install`` wraps the plugin method each path calls so that, while ``active()`` says so, every
other call raises ``InjectedFault``. On a real server it is installed by
``engine_faults_site/sitecustomize.py`` (on the server's ``PYTHONPATH``) before vLLM builds its
engine, and switched on and off by a flag file (``JIUWEN_ENGINE_FAULTS``), so one server serves
with faults and without."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

#: The engine path (``fail_open.EnginePath``) → the plugin method it calls, as (module, class,
#: method): a failure there is that path's.
TARGETS: dict[str, tuple[str, str, str]] = {
    "add_request": ("vllm_affinity.engine.pool_affinity", "PoolAffinity", "on_new_request"),
    "schedule": ("vllm_affinity.engine.pool_affinity", "PoolAffinity", "bind_taken"),
    "free": ("vllm_affinity.engine.pool_affinity", "PoolAffinity", "request_done"),
    "handout": ("vllm_affinity.engine.pool_affinity", "PoolAffinity", "blocks_handed_out"),
    "picker": ("vllm_affinity.engine.pool_affinity", "PoolAffinity", "pick"),
    "utility": ("vllm_affinity.engine.pool_affinity", "PoolAffinity", "idle_session"),
    "get_computed_blocks": (
        "vllm_affinity.engine.checkpoints",
        "InstructionCheckpoints",
        "on_lookup",
    ),
    "cache_blocks": (
        "vllm_affinity.engine.checkpoints",
        "InstructionCheckpoints",
        "return_point",
    ),
}


class InjectedFault(RuntimeError):
    """A failure the test put into a plugin path."""


def install(paths: list[str], active: Callable[[], bool]) -> Callable[[], None]:
    """Make each of ``paths`` fail every other call while ``active()``; returns the undo."""
    import importlib

    undo: list[Callable[[], None]] = []
    for path in paths:
        module, owner_name, name = TARGETS[path]
        owner = getattr(importlib.import_module(module), owner_name)
        original = owner.__dict__[name]
        calls = [0]

        def failing(*args: Any, _o: Any = original, _p: str = path, _c: Any = calls) -> Any:
            if active():
                _c[0] += 1
                if _c[0] % 2:
                    raise InjectedFault(f"injected into the {_p} path")
            return _o(*args)

        setattr(owner, name, functools.wraps(original)(failing))
        undo.append(lambda o=owner, n=name, f=original: setattr(o, n, f))
    return lambda: [u() for u in reversed(undo)] and None


def install_from_env() -> None:
    """In a server's process: the paths of ``JIUWEN_ENGINE_FAULT_PATHS`` fail while the file
    ``JIUWEN_ENGINE_FAULTS`` exists."""
    flag = os.environ.get("JIUWEN_ENGINE_FAULTS")
    if not flag:
        return
    paths = os.environ.get("JIUWEN_ENGINE_FAULT_PATHS", ",".join(TARGETS)).split(",")
    install(paths, lambda: os.path.exists(flag))
