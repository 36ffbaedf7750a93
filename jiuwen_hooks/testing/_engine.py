"""``LocalEngine``: a recording OpenAI-compatible server on loopback (real sockets, real HTTP)."""

from __future__ import annotations

import threading
import time
from typing import Any

from jiuwen_kv_protocol.headers import RELEASE_HEADER

from ._records import RecordedRequest, ReleaseAnswer, _Records
from ._wire import _Handler, _QuietServer


class LocalEngine:
    """A recording OpenAI-compatible server on 127.0.0.1 (real sockets, real HTTP)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        reply: str = "ok",
        *,
        strict: bool = False,
        in_request: bool = False,
    ) -> None:
        self._records = _Records(strict=strict, in_request=in_request)
        handler = type("_Handler", (_Handler,), {"records": self._records, "reply": reply})
        self._server = _QuietServer((host, port), handler)
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> LocalEngine:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and close every open connection."""
        self._server.shutdown()
        self._server.server_close()
        self._server.drop_connections()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> LocalEngine:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- addresses ----------------------------------------------------------------------------
    @property
    def root_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def base_url(self) -> str:
        """What to give ``openai.OpenAI(base_url=...)``."""
        return self.root_url + "/v1"

    # -- behaviour and records ----------------------------------------------------------------
    def answer_releases(
        self,
        status: int = 200,
        *,
        delay: float = 0.0,
        non_json: bool = False,
        reset: bool = False,
        block_released: int | None = None,
    ) -> None:
        with self._records.lock:
            self._records.answer = ReleaseAnswer(status, delay, non_json, reset, block_released)

    def advertise_in_request(self, enabled: bool = True) -> None:
        """Switch the in-request capability on or off (as when the plugin is deployed/removed)."""
        with self._records.lock:
            self._records.in_request = enabled

    def delay_capabilities(self, seconds: float) -> None:
        """Answer ``GET /affinity/capabilities`` ``seconds`` late (a busy server)."""
        with self._records.lock:
            self._records.capabilities_delay = seconds

    @property
    def hints(self) -> list[str | None]:
        """The ``X-KV-Release`` header of every chat request (``None`` where absent)."""
        return [c.headers.get(RELEASE_HEADER.lower()) for c in self.chats]

    @property
    def releases(self) -> list[RecordedRequest]:
        with self._records.lock:
            return list(self._records.releases)

    @property
    def chats(self) -> list[RecordedRequest]:
        """Every model request (``/v1/chat/completions``, ``/v1/responses`` and
        ``/v1/messages``), in order."""
        with self._records.lock:
            return list(self._records.chats)

    @property
    def responses(self) -> list[RecordedRequest]:
        """The ``/v1/responses`` requests only."""
        return [c for c in self.chats if c.path == "/v1/responses"]

    @property
    def paths(self) -> list[str]:
        """Paths of all POST requests in arrival order (to check a release preceded a chat)."""
        with self._records.lock:
            return list(self._records.paths)

    def clear(self) -> None:
        with self._records.lock:
            self._records.releases.clear()
            self._records.chats.clear()
            self._records.paths.clear()

    def wait_for_releases(self, count: int, timeout: float = 5.0) -> list[RecordedRequest]:
        """Block until at least ``count`` releases arrived (for background dispatch)."""
        deadline = time.monotonic() + timeout
        with self._records.lock:
            while len(self._records.releases) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._records.lock.wait(remaining)
            return list(self._records.releases)
