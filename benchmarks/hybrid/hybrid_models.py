"""Hybrid models: what a compaction releases in every KV-cache group, through the hook and
through a coding agent's own header (no hook), on random-weight models of each shape
(``python -m vllm_affinity build-model --arch ...``) and the one-group Llama for comparison.

A session grows over four turns (a system prompt of ~700 tokens, ~300 tokens a turn), then
compacts (the system prompt kept, the rest replaced by a summary), then calls once more. One
plugin server per model, one at a time (1024 blocks: nothing is evicted). Per group: the old
window's stale blocks (full attention: its cached blocks past the cut; sliding-window and
Mamba groups cache only some blocks, so their count is what was released), the blocks each
path released, and the next call's hit.

    python -m benchmarks.hybrid.hybrid_models [--archs llama,gpt-oss,gemma3,qwen3-next]
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

import jiuwen_hooks
from jiuwen_kv_protocol.headers import CLAUDE_CODE_SESSION_HEADER
from jiuwen_replay.output import write_json
from vllm_affinity.core import common_prefix_length
from vllm_affinity.engine.checkpoints import DENSE_KINDS
from vllm_affinity.testing import SERVED_NAME, VLLMServer, filler_text
from vllm_affinity.testing.hybrid_model import build_hybrid
from vllm_affinity.testing.tiny_model import build

ARCHS = ("llama", "gpt-oss", "gemma3", "qwen3-next", "deepseek-v3")
#: Measured by default: vLLM's CPU build serves ``deepseek-v3`` (MLA) with prefix caching off
#: on CPUs without AMX (nothing to release there); ``--archs deepseek-v3`` runs it all the same.
DEFAULT_ARCHS = ARCHS[:4]
#: The kinds of group whose every block is cached (prefix caching keeps them densely).
DENSE = DENSE_KINDS


def text(seed: int, pairs: int) -> str:
    return filler_text(random.Random(seed), pairs)


@dataclass
class Call:
    prompt: int
    completion: int
    cached: int


def call(
    server: VLLMServer, messages: list[dict[str, Any]], headers: dict[str, str] | None = None
) -> Call:
    with openai.OpenAI(
        base_url=server.base_url, api_key=server.api_key or "none", max_retries=0
    ) as client:
        reply = client.chat.completions.create(
            model=SERVED_NAME,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            extra_headers=headers or {},
        )
    usage = reply.usage
    assert usage is not None
    details = usage.prompt_tokens_details
    return Call(
        usage.prompt_tokens, usage.completion_tokens, (details and details.cached_tokens) or 0
    )


def groups(server: VLLMServer) -> dict[int, dict[str, Any]]:
    """Per group, the plugin's stats (nothing for a vanilla server)."""
    if not server.plugin:
        return {}
    return {g["group"]: g for g in server.engine_stats()["groups"]}


def released_per_group(before: dict[int, Any], after: dict[int, Any]) -> dict[int, int]:
    return {g: after[g]["blocks_released"] - before[g]["blocks_released"] for g in after}


def rendered(server: VLLMServer, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt tokens of a window, rendered by the server as its chat requests are."""
    body = {"model": SERVED_NAME, "messages": messages}
    response = httpx.post(
        server.root_url + "/tokenize", json=body, headers=server.headers(), timeout=30
    )
    response.raise_for_status()
    return response.json()["tokens"]


def instruction_tokens(server: VLLMServer, system: dict[str, Any]) -> int:
    """The leading tokens every conversation that opens with ``system`` starts with: what two
    renders with different one-word user messages share. A hybrid model's hit on them ends at
    this length aligned down (the plugin's instructions' checkpoint), however much more of
    the next message two windows happen to share."""
    first, second = (
        rendered(server, [system, {"role": "user", "content": word}]) for word in ("Alpha", "Omega")
    )
    return common_prefix_length(first, second)


@dataclass
class Compaction:
    calls: list[Call]  # four turns, the compaction, the next turn
    released: dict[int, int]  # per group, the blocks released at the compaction
    groups: dict[int, dict[str, Any]]  # per group, its stats afterwards
    kept_tokens: int  # the old window's tokens the compacted one starts with


def system_prompt(seed: int, pairs: int = 150) -> str:
    """The instructions of session ``seed`` (about three tokens a pair)."""
    return f"You are coding agent {seed}. " + text(seed, pairs)


def grow_then_compact(
    server: VLLMServer,
    seed: int,
    headers: dict[str, str] | None = None,
    flush: Any = None,
    system_pairs: int = 150,
    turn_pairs: int = 120,
) -> Compaction:
    """Four turns, a compaction (the system prompt kept, a summary for the rest), one more
    turn."""
    window: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt(seed, system_pairs)}
    ]
    calls = []
    for turn in range(4):
        window.append({"role": "user", "content": text(seed * 10 + turn, turn_pairs)})
        calls.append(call(server, window, headers))
        window.append({"role": "assistant", "content": f"Done with step {turn}."})
    if flush:
        flush()
    before = groups(server)
    compacted = [
        window[0],
        {"role": "user", "content": "Summary of the work so far: " + text(seed, 20)},
    ]
    calls.append(call(server, compacted, headers))
    if flush:
        flush()
    after = groups(server)
    kept = common_prefix_length(rendered(server, window[:-1]), rendered(server, compacted))
    compacted += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Go on."}]
    calls.append(call(server, compacted, headers))
    return Compaction(calls, released_per_group(before, after), after, kept)


def stale_blocks(compaction: Compaction, block_size: int) -> int:
    """A dense group's cached blocks of the old window (its last prompt and answer; the
    answer's last token has no KV) past the cut."""
    last = compaction.calls[3]
    cached = (last.prompt + last.completion - 1) // block_size
    return cached - compaction.kept_tokens // block_size


def hybrid_vllm(arch: str, **kw: Any) -> VLLMServer:
    """A server of ``arch`` (``llama``: the one-group model), not started: by default with the
    plugin, a pool nothing is evicted from (every group draws from it: Gemma 3's 32 tokens
    cost four blocks, one per group), and every idle acted on."""
    model = build() if arch == "llama" else build_hybrid(arch)
    kw.setdefault("env", {"VLLM_AFFINITY_IDLE_GUARD": "false"})
    kw.setdefault("num_blocks", 1024)
    kw.setdefault("max_model_len", 4096)
    return VLLMServer(model=model, eager=True, **kw)


def measure(arch: str) -> list[dict[str, Any]]:
    """One server: the hook's compaction, then the header's, per group."""
    rows: dict[int, dict[str, Any]] = {}
    with hybrid_vllm(arch) as server:
        hook = jiuwen_hooks.install(in_request=True)
        try:
            with jiuwen_hooks.session(f"bench-hook-{arch}"):
                hooked = grow_then_compact(server, seed=1, flush=hook.flush)
        finally:
            jiuwen_hooks.uninstall()
        headers = {CLAUDE_CODE_SESSION_HEADER: f"bench-cc-{arch}"}
        told = grow_then_compact(server, seed=2, headers=headers)
        problems = [p for e in server.idle_check()["engines"] for p in e["problems"]]
    for group, stats in hooked.groups.items():
        kind, block_size = stats["kind"], stats["block_size"]
        dense = kind in DENSE
        rows[group] = {
            "arch": arch,
            "group": group,
            "kind": kind,
            "block_size": block_size,
            "stale_hook": stale_blocks(hooked, block_size) if dense else None,
            "released_hook": hooked.released[group],
            "stale_headers": stale_blocks(told, block_size) if dense else None,
            "released_headers": told.released[group],
            "next_hit_hook": hooked.calls[5].cached,
            "next_prompt_hook": hooked.calls[5].prompt,
            "next_hit_headers": told.calls[5].cached,
            "problems": len(problems),
        }
    return list(rows.values())


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | group | kind | block | stale (hook) | released via the hook | "
        "stale (header) | released via Claude Code's header | next call hit (hook) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        stale_h = "-" if r["stale_hook"] is None else r["stale_hook"]
        stale_c = "-" if r["stale_headers"] is None else r["stale_headers"]
        lines.append(
            f"| {r['arch']} | {r['group']} | {r['kind']} | {r['block_size']} | {stale_h} | "
            f"{r['released_hook']} | {stale_c} | {r['released_headers']} | "
            f"{r['next_hit_hook']} / {r['next_prompt_hook']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(DEFAULT_ARCHS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    unknown = sorted(set(archs) - set(ARCHS))
    if unknown:
        parser.error(f"unknown arch {', '.join(unknown)}; choose from {', '.join(ARCHS)}")
    rows: list[dict[str, Any]] = []
    for arch in archs:
        print(f"{arch}: starting its server ...", file=sys.stderr, flush=True)
        rows += measure(arch)
        print(markdown([r for r in rows if r["arch"] == arch]), file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "hybrid_models.json", {"rows": rows}, echo=False)
    (args.out / "hybrid_models.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
