"""What the local engine records and how it answers a release (shared by the engine and its
HTTP handler)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RecordedRequest:
    path: str
    headers: dict[str, str]  # lower-case names
    body: Any  # parsed JSON, or the raw text when it is not JSON


@dataclass
class ReleaseAnswer:
    """How ``/release_kv_cache`` answers. ``block_released=None``: the number of released messages
    (``len(messages) - messages_released_index``), which makes tests easy to read."""

    status: int = 200
    delay: float = 0.0
    non_json: bool = False
    reset: bool = False
    block_released: int | None = None


#: Chat-completion body fields of the OpenAI API (what a strict server accepts).
CAPABILITIES = {"plugin": "local", "release_kv_cache": True, "in_request_release": True}


@dataclass
class _Records:
    releases: list[RecordedRequest] = field(default_factory=list)
    chats: list[RecordedRequest] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    answer: ReleaseAnswer = field(default_factory=ReleaseAnswer)
    lock: threading.Condition = field(default_factory=threading.Condition)
    strict: bool = False
    in_request: bool = False
    capabilities_delay: float = 0.0
