"""The in-request release hint, ``X-KV-Release`` (an RFC 8941 dictionary).

    X-KV-Release: messages_released_index=5, tools_released_index=1

The header says "this request rewrites the session's history from message ``k`` (and tool
``j``) on". The engine does not need the indices to find the stale blocks (it compares block-hash
chains, which is exact); they are checked, recorded on spans and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import http_sf

from .headers import RELEASE_HEADER as HEADER

_KEYS = ("messages_released_index", "tools_released_index")


class HintError(ValueError):
    """A malformed ``X-KV-Release`` value; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class ReleaseHint:
    messages_released_index: int
    tools_released_index: int | None = None

    def header_value(self) -> str:
        fields: dict[str, Any] = {"messages_released_index": self.messages_released_index}
        if self.tools_released_index is not None:
            fields["tools_released_index"] = self.tools_released_index
        return http_sf.ser(fields)

    @classmethod
    def parse(cls, value: str) -> ReleaseHint:
        try:
            parsed: Any = http_sf.parse(value.encode("ascii"), tltype="dictionary")
        except (UnicodeEncodeError, ValueError) as exc:
            raise HintError(f"{HEADER} is not an RFC 8941 dictionary: {exc}") from None
        unknown = sorted(set(parsed) - set(_KEYS))
        if unknown:
            raise HintError(f"{HEADER}: unknown key(s) {', '.join(unknown)}")
        values: dict[str, int] = {}
        for key, (item, _params) in parsed.items():
            if not isinstance(item, int) or isinstance(item, bool) or item < 0:
                raise HintError(f"{HEADER}: {key} must be a non-negative integer, got {item!r}")
            values[key] = item
        if "messages_released_index" not in values:
            raise HintError(f"{HEADER}: messages_released_index is required")
        return cls(**values)
