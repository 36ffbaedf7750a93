"""Pure core: the names the API server writes into a request's ``SamplingParams.extra_args`` and
the engine reads there, and the kinds of KV-cache group both sides tell apart (no vLLM import).

Both processes import these from here, so neither imports the other's modules."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: Key of a request's instruction length in tokens in ``SamplingParams.extra_args`` (set by the
#: API server on a hybrid model's requests).
CHECKPOINT_KEY = "kv_checkpoint"
#: Key of the in-request hint in ``SamplingParams.extra_args`` (set by the API-server wrap).
HINT_KEY = "kv_release"
#: Key of the request's parent session in ``SamplingParams.extra_args`` (subagents).
PARENT_KEY = "kv_parent"
#: Key of the request's principal in ``SamplingParams.extra_args`` (``core/tenants.py``).
PRINCIPAL_KEY = "kv_principal"
#: Key of a compaction the API server told from the agent's own requests
#: (``core/compaction.py``): the request's window rewrote its session's main thread.
REWRITE_KEY = "kv_rewrite"
#: Key of a retry the API server told (``core/compaction.py``): the request's window replaced
#: its main thread's last message; the replaced window is kept apart until the next one.
RETRY_KEY = "kv_retry"
#: Key of a subagent's instruction length in tokens (``api_server/instructions.py``): its end
#: keeps them.
HEAD_KEY = "kv_head"
#: Key of the request's ``X-KV-Next-Use`` (seconds), for the predicted-return picker.
NEXT_USE_KEY = "kv_next_use"
#: The keys above: set by the API server only, never taken from a client's ``vllm_xargs``.
RESERVED_KEYS = (
    HINT_KEY,
    PARENT_KEY,
    PRINCIPAL_KEY,
    REWRITE_KEY,
    RETRY_KEY,
    HEAD_KEY,
    NEXT_USE_KEY,
    CHECKPOINT_KEY,
)

#: Kinds of group that keep every block of a prompt: their hit needs no checkpoint.
DENSE_KINDS = frozenset({"full_attention", "mla_attention"})


@dataclass(frozen=True)
class RequestKeys:
    """What the engine reads of a request's ``extra_args``: each key type-checked, so a value of
    the wrong type (a client's through an entry point that passes ``vllm_xargs`` unchecked, or
    a bug) is ignored, never raised inside vLLM's scheduler."""

    hint: bool = False
    rewrite: bool = False
    retry: bool = False
    parent: str | None = None
    principal: str | None = None
    head: int = 0
    next_use: float | None = None
    checkpoint: int = 0
    #: The keys whose value was malformed (ignored).
    malformed: tuple[str, ...] = ()


_NO_KEYS = RequestKeys()


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= _MAX_TEXT else None


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= _MAX_TOKENS else None


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _flag(value: Any) -> bool | None:
    return True if isinstance(value, str) else None


#: How each key's value is read (None: malformed) and the field it fills.
_READERS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    HINT_KEY: ("hint", _flag),
    REWRITE_KEY: ("rewrite", _flag),
    RETRY_KEY: ("retry", _flag),
    PARENT_KEY: ("parent", _text),
    PRINCIPAL_KEY: ("principal", _text),
    HEAD_KEY: ("head", _count),
    NEXT_USE_KEY: ("next_use", _seconds),
    CHECKPOINT_KEY: ("checkpoint", _count),
}
_MAX_TEXT = 4096
_MAX_TOKENS = 1 << 40


def read_request_keys(extra: Mapping[str, Any] | None) -> RequestKeys:
    """The request keys of ``extra`` (a request's ``SamplingParams.extra_args``), each of the
    type the API server writes; a malformed one is left out and named in ``malformed``."""
    if not extra or not isinstance(extra, Mapping):
        return _NO_KEYS
    found: dict[str, Any] = {}
    malformed: list[str] = []
    for key, value in extra.items():
        reader = _READERS.get(key)
        if reader is None:
            continue
        field, read = reader
        parsed = read(value)
        if parsed is None:
            malformed.append(key)
        else:
            found[field] = parsed
    if not found and not malformed:
        return _NO_KEYS
    return RequestKeys(**found, malformed=tuple(malformed))
