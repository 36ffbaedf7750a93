"""The hook's background thread: where releases go with ``dispatch="background"``, compressor
releases (no model call follows to carry them) and capability probes."""

from __future__ import annotations

import concurrent.futures
import contextvars
import threading
from collections.abc import Callable
from typing import Any


class BackgroundRunner:
    """Runs work on a small thread pool, started on first use, each call in its submitter's
    context (trace, session). ``flush()`` waits for what is running; after ``close()`` nothing
    starts: ``submit`` answers ``False`` so the caller can count what it dropped."""

    def __init__(self, max_workers: int = 2, name: str = "jiuwen-release") -> None:
        self._max_workers = max_workers
        self._name = name
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Start ``fn(*args)`` in the background; ``False`` once closed (nothing started)."""
        ctx = contextvars.copy_context()
        with self._lock:
            if self._closed:
                return False
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._max_workers, thread_name_prefix=self._name
                )
            future = self._executor.submit(ctx.run, fn, *args)
            self._pending.add(future)
        future.add_done_callback(self._done)
        return True

    def _done(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)

    def flush(self, timeout: float | None = 10.0) -> None:
        """Wait (at most ``timeout`` seconds) for the work submitted so far."""
        with self._lock:
            futures = list(self._pending)
        concurrent.futures.wait(futures, timeout=timeout)

    def close(self) -> None:
        """Let running work finish (bounded by ``flush``), then refuse new work for good."""
        self.flush()
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
