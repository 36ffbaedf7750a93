"""Which header names the session (pure core and settings; no server)."""

from __future__ import annotations

import pytest

from vllm_affinity.core.session_headers import (
    DEFAULT_SESSION_HEADERS,
    parse_header_list,
    session_from_headers,
)
from vllm_affinity.settings import Settings


class Headers(dict):
    """Case-insensitive lookups, as Starlette's request headers."""

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        for name, value in self.items():
            if name.lower() == key.lower():
                return value
        return default


# Request shapes as each client sends them (header names and forms only).
CLAUDE_CODE_LEAD = Headers({"x-claude-code-session-id": "0c9f", "x-app": "cli"})
CLAUDE_CODE_SUBAGENT = Headers(
    {"X-Claude-Code-Session-Id": "0c9f", "X-Claude-Code-Agent-Id": "a7f3",
     "X-Claude-Code-Parent-Agent-Id": "main"}
)  # fmt: skip
CODEX = Headers({"session-id": "019a-codex", "originator": "codex_cli_rs"})
GATEWAY = Headers({"X-Session-Affinity": "conv-9"})


@pytest.mark.parametrize(
    ("headers", "session"),
    [
        (CLAUDE_CODE_LEAD, "0c9f"),
        (CLAUDE_CODE_SUBAGENT, "0c9f/a7f3"),
        (CODEX, "019a-codex"),
        (GATEWAY, "conv-9"),
        (Headers({"X-Session-ID": "mine", "session-id": "codex"}), "mine"),  # order wins
        (Headers({"X-Session-ID": "  ", "session-id": "codex"}), "codex"),  # blank: next one
        (Headers({"session-id": "x" * 513}), None),  # too long: ignored, not cut
        (Headers({"user-agent": "curl"}), None),
    ],
)
def test_default_headers(headers: Headers, session: str | None) -> None:
    assert session_from_headers(headers, DEFAULT_SESSION_HEADERS) == session


def test_configured_order_and_bad_settings() -> None:
    settings = Settings.from_env({"VLLM_AFFINITY_SESSION_HEADERS": "session-id, X-Session-ID"})
    assert settings.session_headers == ("session-id", "X-Session-ID")
    both = Headers({"X-Session-ID": "mine", "session-id": "codex"})
    assert session_from_headers(both, settings.session_headers) == "codex"
    assert Settings.from_env({}).session_headers == DEFAULT_SESSION_HEADERS
    for bad in ("", " , ", "X Session"):
        with pytest.raises(ValueError, match="VLLM_AFFINITY_SESSION_HEADERS"):
            Settings.from_env({"VLLM_AFFINITY_SESSION_HEADERS": bad})
    assert parse_header_list("a,b") == ("a", "b")
