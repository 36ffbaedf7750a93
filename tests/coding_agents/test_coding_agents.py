"""Claude Code and the Codex CLI, unmodified, against the plugin: their compactions release the
old window with no hook, and nothing else releases (see docs/coding-agents.md)."""

from __future__ import annotations

from collections.abc import Callable

from .conftest import ClaudeCode, CodexCli, Delta


def released(delta: Delta) -> int:
    return delta["block_released_compaction"]


def test_claude_code_compact_releases_the_old_window_and_nothing_else(
    claude_code: ClaudeCode, watch: Callable[[], Delta]
) -> None:
    watch()
    claude_code.ask("first question about the weather")
    first = watch()
    assert first["windows.first"] == 1 and first["sessions"] >= 1  # bound from its header
    claude_code.ask("second question about the plan")
    second = watch()
    assert second["windows.append"] >= 1
    assert released(second) == 0 and second["releases"] == 0  # a turn that only appends

    claude_code.ask("/compact")
    compact = watch()
    assert compact["windows.append"] >= 1  # the summary request appends to the window
    assert released(compact) == 0 and compact["releases"] == 0

    after = claude_code.ask("third question after compaction")
    rewrite = watch()
    assert rewrite["windows.rewrite"] == 1 and rewrite["releases_compaction"] == 1
    assert released(rewrite) > 50, rewrite.after  # the old window's blocks

    later = claude_code.ask("fourth question")
    plain = watch()
    assert released(plain) == 0 and plain["releases"] == 0
    # the new window's prefix was kept: the next turn reads nearly all of it from the cache
    window = after["usage"]
    kept = window["input_tokens"] + window["cache_read_input_tokens"]
    kept += window["cache_creation_input_tokens"]
    assert later["usage"]["cache_read_input_tokens"] >= kept - 64, (window, later["usage"])


def test_codex_compaction_releases_the_old_window_and_nothing_else(
    codex_cli: CodexCli, watch: Callable[[], Delta]
) -> None:
    watch()
    codex_cli.ask("first question about the weather")
    first = watch()
    assert first["windows.first"] == 1 and first["sessions"] >= 1
    codex_cli.ask("second question about the plan")
    plain = watch()
    assert plain["windows.append"] == 1 and plain["windows.side"] == 0
    assert released(plain) == 0 and plain["releases"] == 0

    compacted = codex_cli.ask("third question", compact_at=5000)  # compacts before the turn
    rewrite = watch()
    assert rewrite["windows.side"] == 1  # the compaction request: a side branch
    assert rewrite["windows.rewrite"] == 1 and rewrite["releases_compaction"] == 1
    assert released(rewrite) > 50, rewrite.after

    later = codex_cli.ask("fourth question")
    after = watch()
    assert released(after) == 0 and after["releases"] == 0
    # the new window's prefix was kept: the next turn reads nearly all of it from the cache
    assert later["cached_input_tokens"] >= later["input_tokens"] - 64, (compacted, later)
    # every finished turn idled the session: its blocks are not left in NORMAL
    assert after.after["segment.normal"] * 10 < after.after["segment.idle"], after.after
