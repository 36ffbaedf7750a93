"""Hybrid models: do the first calls that share earlier instructions hit them?

On a sliding-window or linear-attention (Mamba) model, vLLM keeps those groups' state only at
each prompt's end and at a prefix's second appearance, so the request that starts a compacted
window, a second session's first call and a second subagent's first call recompute the
instructions they share with earlier requests. The plugin keeps the state at the instructions'
end from their first appearance (``vllm_affinity/engine/checkpoints.py``).

Per model shape, three servers one after the other, each with the same pool: vanilla vLLM,
vanilla with a retention interval (vLLM's own alternative: a state every N tokens), and the
plugin. On each, through the hook and through Claude Code's own headers (no hook): a session
grows over four turns and compacts (its instructions kept); two new sessions start with the
same new instructions; two subagents of the lead start with the same instructions of their own.
Reported: each first call's hit against the tokens it shares with earlier requests, and the
blocks the server holds cached at the end (the plugin's own stats; ``-`` for vanilla).

    python -m benchmarks.hybrid.hybrid_checkpoints [--archs gpt-oss,gemma3,qwen3-next] \
        [--interval 512]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jiuwen_hooks
from benchmarks.hybrid.hybrid_models import (
    call,
    grow_then_compact,
    hybrid_vllm,
    instruction_tokens,
    rendered,
    system_prompt,
    text,
)
from jiuwen_kv_protocol.headers import CLAUDE_CODE_AGENT_HEADER, CLAUDE_CODE_SESSION_HEADER
from jiuwen_replay.output import write_json
from vllm_affinity.core import common_prefix_length

ARCHS = ("gpt-oss", "gemma3", "qwen3-next")
#: About 1.8k tokens of instructions: real agents keep 15-30k, but the runs stay short, and the
#: coarsest hit granularity here (the Qwen3-Next shape's 160 tokens) costs under 10% of them.
SYSTEM_PAIRS = 550
TURN_PAIRS = 60
SIDES = ("vanilla", "interval", "plugin")


def shared(server: Any, first: list[dict[str, Any]], second: list[dict[str, Any]]) -> int:
    """Leading tokens two windows share, rendered as the server renders them."""
    return common_prefix_length(rendered(server, first), rendered(server, second))


def measure_side(arch: str, side: str, interval: int) -> list[dict[str, Any]]:
    """One server: the hook's session, then the headers' (a compaction, a second session, two
    subagents)."""
    extra = ("--prefix-cache-retention-interval", str(interval)) if side == "interval" else ()
    rows = []
    with hybrid_vllm(arch, plugin=side == "plugin", extra_args=extra) as server:
        for path in ("hook", "headers"):
            seed = 1 if path == "hook" else 2
            lead = f"{path}-lead-{arch}"
            if path == "hook":
                hook = jiuwen_hooks.install(in_request=True)
                try:
                    with jiuwen_hooks.session(lead):
                        compaction = grow_then_compact(
                            server, seed, None, hook.flush, SYSTEM_PAIRS, TURN_PAIRS
                        )
                    second = second_session(server, seed, [None, None])
                finally:
                    jiuwen_hooks.uninstall()
            else:
                headers = {CLAUDE_CODE_SESSION_HEADER: lead}
                compaction = grow_then_compact(
                    server, seed, headers, None, SYSTEM_PAIRS, TURN_PAIRS
                )
                second = second_session(
                    server,
                    seed,
                    [{CLAUDE_CODE_SESSION_HEADER: f"{path}-new-{n}-{arch}"} for n in (1, 2)],
                )
            start = compaction.calls[4]
            rows.append(
                {
                    "arch": arch,
                    "side": side,
                    "path": path,
                    "compaction_hit": start.cached,
                    "kept": compaction.kept_tokens,
                    "second_hit": second.hit,
                    "second_shared": second.shared,
                }
            )
            if path == "headers":
                child = subagents(server, lead, seed)
                rows[-1].update(subagent_hit=child.hit, subagent_shared=child.shared)
        cached = None
        if server.plugin:
            segments = server.engine_stats()["segments"]
            cached = sum(v for k, v in segments.items() if k != "free")
        for row in rows:
            row["cached_blocks_after"] = cached
    return rows


class FirstCall(NamedTuple):
    """A later session's or subagent's first call: its hit, the tokens its prompt shares with
    the earlier one's, and of those its instructions' (where the checkpoint lies)."""

    hit: int
    shared: int
    instructions: int


def second_session(
    server: Any, seed: int, headers: list[dict[str, str] | None], pairs: int = SYSTEM_PAIRS
) -> FirstCall:
    """Two new sessions with the same new instructions, one call each (``None``: through the
    hook, a session of its own): the second one's first call."""
    system = {"role": "system", "content": system_prompt(seed + 300, pairs)}
    windows = [
        [system, {"role": "user", "content": f"Task {n}: " + text(seed + 500 + n, 30)}]
        for n in (1, 2)
    ]
    hit = 0
    for n, (window, names) in enumerate(zip(windows, headers, strict=True)):
        if names is None:
            with jiuwen_hooks.session(f"hook-new-{n}-{seed}"):
                hit = call(server, window).cached
        else:
            hit = call(server, window, names).cached
    return FirstCall(hit, shared(server, *windows), instruction_tokens(server, system))


def subagents(server: Any, lead: str, seed: int, pairs: int = 400) -> FirstCall:
    """Two subagents of ``lead`` (Claude Code's headers) with the same instructions of their
    own: the second one's first call."""
    system = {"role": "system", "content": "You are a search subagent. " + text(seed + 900, pairs)}
    windows = [
        [system, {"role": "user", "content": f"Task {n}: " + text(seed + 900 + n, 40)}]
        for n in (1, 2)
    ]
    for n, window in enumerate(windows, 1):
        headers = {CLAUDE_CODE_SESSION_HEADER: lead, CLAUDE_CODE_AGENT_HEADER: f"sub-{n}"}
        hit = call(server, window, headers).cached
    return FirstCall(hit, shared(server, *windows), instruction_tokens(server, system))


def share(hit: int | None, of: int | None) -> str:
    if hit is None or not of:
        return "-"
    return f"{hit} / {of} ({100 * hit / of:.0f}%)"


def markdown(rows: list[dict[str, Any]], interval: int) -> str:
    names = {"vanilla": "vanilla", "interval": f"vanilla, interval {interval}", "plugin": "plugin"}
    lines = [
        "| model | side | path | compaction's first call: hit / kept | second session's first "
        "call: hit / shared | second subagent's first call: hit / shared | cached blocks after |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        cached = "-" if r["cached_blocks_after"] is None else r["cached_blocks_after"]
        lines.append(
            f"| {r['arch']} | {names[r['side']]} | {r['path']} | "
            f"{share(r['compaction_hit'], r['kept'])} | "
            f"{share(r['second_hit'], r['second_shared'])} | "
            f"{share(r.get('subagent_hit'), r.get('subagent_shared'))} | {cached} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument(
        "--interval",
        type=int,
        default=480,
        help="vLLM's --prefix-cache-retention-interval on the interval side (a multiple of "
        "every shape's block size: 32 and 160 here)",
    )
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(archs) - set(ARCHS)) + sorted(set(sides) - set(SIDES))
    if unknown:
        parser.error(f"unknown {', '.join(unknown)}; archs: {ARCHS}, sides: {SIDES}")
    rows: list[dict[str, Any]] = []
    for arch in archs:
        for side in sides:
            print(f"{arch}, {side}: starting its server ...", file=sys.stderr, flush=True)
            rows += measure_side(arch, side, args.interval)
            print(markdown(rows[-2:], args.interval), file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.hybrid.hybrid_checkpoints " + " ".join(argv or sys.argv[1:])
    write_json(
        args.out / "hybrid_checkpoints.json",
        {"command": command.strip(), "interval": args.interval, "rows": rows},
        echo=False,
    )
    table = markdown(rows, args.interval)
    (args.out / "hybrid_checkpoints.md").write_text(f"`{command.strip()}`\n\n{table}")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
