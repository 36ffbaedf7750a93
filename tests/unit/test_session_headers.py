"""Which header names the session (pure core and settings; no server)."""

from __future__ import annotations

import pytest

from vllm_affinity.core.session_headers import (
    DEFAULT_SESSION_HEADERS,
    parent_from_headers,
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
# A Codex subagent: its session-id is the root's, its thread-id its own.
CODEX_SUBAGENT = Headers(
    {"session-id": "019a-codex", "thread-id": "019b-sub", "x-codex-parent-thread-id": "019a-codex",
     "x-openai-subagent": "collab_spawn"}
)  # fmt: skip
OPENCODE_CHILD = Headers(
    {"X-Session-Id": "ses_child", "x-session-affinity": "ses_child",
     "x-parent-session-id": "ses_lead"}
)  # fmt: skip
GATEWAY = Headers({"X-Session-Affinity": "conv-9"})


@pytest.mark.parametrize(
    ("headers", "session"),
    [
        (CLAUDE_CODE_LEAD, "0c9f"),
        (CLAUDE_CODE_SUBAGENT, "0c9f/a7f3"),
        (CODEX, "019a-codex"),
        (CODEX_SUBAGENT, "019b-sub"),
        (OPENCODE_CHILD, "ses_child"),
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


@pytest.mark.parametrize(
    ("headers", "parent"),
    [
        (CLAUDE_CODE_LEAD, None),
        (CLAUDE_CODE_SUBAGENT, "0c9f"),
        (CODEX, None),
        (CODEX_SUBAGENT, "019a-codex"),
        (OPENCODE_CHILD, "ses_lead"),
        (Headers({"X-Parent-Session-ID": "hook-lead", "x-codex-parent-thread-id": "t"}),
         "hook-lead"),
    ],
)  # fmt: skip
def test_parents(headers: Headers, parent: str | None) -> None:
    assert parent_from_headers(headers, DEFAULT_SESSION_HEADERS) == parent


def test_precedence_is_written_down() -> None:
    """The documented order is the one the plugin reads (docs/coding-agents.md)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "coding-agents.md").read_text()
    listed = [f"`{name}`" for name in DEFAULT_SESSION_HEADERS]
    positions = [doc.index(name) for name in listed]
    assert positions == sorted(positions), listed
