"""Agents that name no session (aider, mini-swe-agent, Qwen Code by default), vanilla vLLM
against the plugin with ``VLLM_AFFINITY_IMPLICIT_SESSIONS=answers``, on real servers.

Each agent is scripted as those agents talk: a system prompt, a task, then per step the
model's answer (sent back verbatim, streamed as agents stream) and a tool's output; every
``--side-every`` steps a side request with a prompt of its own, shared by every session (a memory
extractor, a commit message); every ``--compact-every`` steps a compaction: the window plus a
summary instruction, then a new window of the system prompt and the summary (Qwen Code's and
aider's shape). No request carries a session: the plugin tells each conversation from the
answers its windows carry back (``core/answer_chains.py``).

Two grids, each side by side on one pool size per cell (in blocks per session): one session
alone, and four concurrent sessions that share the system prompt, the tools and the first
message (the case where a guess could join two sessions and release one's live blocks).

``--traffic`` adds a chat UI's backend (many users behind one key, every chat regenerated and
edited): ``chat`` (under the app's system prompt), ``webui`` (Open WebUI's shape: no system
prompt, and its title, tags and follow-up requests quoting the chat), ``greeting`` (one
model-written greeting opening every chat) and ``lookalike`` (the same first message answered
alike, pastes of another user's answer): the shapes where a guess could join two users' chats.
Reported per cell: prompt tokens
computed (not read from the prefix cache) by each side and the plugin's ratio to vanilla.

    python -m benchmarks.agents.idless_agents [--pools 64,76] [--sessions 1,4] [--steps 36]
    python -m benchmarks.agents.idless_agents --traffic webui,greeting,lookalike --sessions 12 \
        --pools 20,44 --steps 16 --out benchmarks/results/idless_chat_uis.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from jiuwen_replay.output import write_outputs
from vllm_affinity.testing import SERVED_NAME, VLLMServer, filler_text

TOOLS = [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}]


@dataclass(frozen=True)
class Shape:
    steps: int = 36
    system_pairs: int = 120  # the agents' shared system prompt
    side_pairs: int = 120  # the side request's own prompt
    output_pairs: int = 24  # a tool's output, per step
    answer_tokens: int = 24
    summary_tokens: int = 40
    side_every: int = 4
    compact_every: int = 10
    think_s: float = 0.05  # the longest pause between steps (a tool running)


@dataclass
class Tally:
    """Prompt tokens sent and read from the cache, per kind of request."""

    prompt: dict[str, int] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, usage: dict[str, Any]) -> None:
        self.prompt[kind] = self.prompt.get(kind, 0) + usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        self.cached[kind] = self.cached.get(kind, 0) + (details.get("cached_tokens") or 0)

    @property
    def computed(self) -> int:
        return sum(self.prompt.values()) - sum(self.cached.values())


async def ask(
    client: httpx.AsyncClient,
    messages: list[dict[str, Any]],
    max_tokens: int,
    tools: bool,
    seed: int | None,
) -> tuple[str, dict[str, Any]]:
    """One streamed call, as the agents make it: the answer's text and the usage. Sampled with
    a seed of the session's: sessions given the same window answer differently, as a real
    model's would, and every run gets the same answers (``None``: greedy). vLLM's CPU engine
    dies on a seeded request whose prefill is split over steps (its CPU generator has no offset
    to rewind): the many-user chat shapes take turns (``Board``), one request at a time."""
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 1.0 if seed is not None else 0.0,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if tools:
        body["tools"] = TOOLS
    text, usage = [], {}
    async with client.stream("POST", "/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                text.append((choice.get("delta") or {}).get("content") or "")
            usage = chunk.get("usage") or usage
    return "".join(text), usage


@dataclass
class Board:
    """What a run's users share: the app's greeting (model-written once, before the users
    come), each user's latest answer (what another user may paste), and their turn order: the
    chat-UI shapes take turns in a fixed order, one user's step at a time, so that both sides
    see the same sequence of requests (under concurrency the order, and with it vanilla's own
    evictions, changes from run to run: vanilla computed 48.6k and 55.0k on two runs of one
    cell)."""

    greeting: str = ""
    answers: dict[int, str] = field(default_factory=dict)
    users: int = 1
    _turn: int = 0
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def wait_turn(self, n: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._turn == n)

    async def pass_turn(self) -> None:
        async with self._changed:
            self._turn = (self._turn + 1) % self.users
            self._changed.notify_all()


async def agent(
    client: httpx.AsyncClient, n: int, shape: Shape, tally: Tally, board: Board
) -> None:
    """One session: steps, side requests and compactions (see the module's docstring)."""
    rng = random.Random(1000 + n)
    system = {"role": "system", "content": filler_text(random.Random(1), shape.system_pairs)}
    side = {"role": "system", "content": filler_text(random.Random(2), shape.side_pairs)}
    window: list[dict[str, Any]] = [system, {"role": "user", "content": "Fix the failing test."}]
    for step in range(1, shape.steps + 1):
        seed = n * 10_000 + step
        answer, usage = await ask(client, window, shape.answer_tokens, True, seed)
        tally.add("main", usage)
        output = filler_text(rng, shape.output_pairs)
        window += [{"role": "assistant", "content": answer}, {"role": "user", "content": output}]
        if step % shape.side_every == 0:
            note = [side, {"role": "user", "content": answer}]
            tally.add("side", (await ask(client, note, 4, False, seed))[1])
        if step % shape.compact_every == 0:
            instruction = {"role": "user", "content": "Summarize the conversation so far."}
            summary, usage = await ask(
                client, [*window, instruction], shape.summary_tokens, True, seed
            )
            tally.add("summary", usage)
            window = [
                system,
                {"role": "user", "content": f"Summary of the work so far:\n{summary}"},
                {"role": "assistant", "content": "Ok."},
                {"role": "user", "content": filler_text(rng, shape.output_pairs)},
            ]
        await asyncio.sleep(rng.uniform(0, shape.think_s))


async def one_shot(
    client: httpx.AsyncClient, n: int, shape: Shape, tally: Tally, board: Board
) -> None:
    """A load test's client: independent prompts (a system prompt every client shares, a
    question of its own), none followed up."""
    rng = random.Random(2000 + n)
    system = {"role": "system", "content": filler_text(random.Random(1), shape.system_pairs)}
    for step in range(1, shape.steps + 1):
        question = {"role": "user", "content": filler_text(rng, shape.output_pairs)}
        _, usage = await ask(
            client, [system, question], shape.answer_tokens, False, n * 10_000 + step
        )
        tally.add("main", usage)
        await asyncio.sleep(rng.uniform(0, shape.think_s))


async def chat(client: httpx.AsyncClient, n: int, shape: Shape, tally: Tally, board: Board) -> None:
    """A chat UI's user under the app's system prompt: the whole chat each time; every fifth
    answer regenerated (the same chat again), every seventh message edited (the last one
    replaced), and every eleventh an earlier message edited (the chat goes on from there)."""
    system = {"role": "system", "content": filler_text(random.Random(1), shape.system_pairs)}
    await _chat_ui(client, n, shape, tally, board, [system, _user("Hello!")])


async def webui(
    client: httpx.AsyncClient, n: int, shape: Shape, tally: Tally, board: Board
) -> None:
    """Open WebUI's user, as it talks by default: no system prompt, regenerations and edits as
    ``chat``'s, and its background tasks, each one user message quoting the chat's last
    messages with no system prompt (the title and the tags after the first answer, follow-up
    suggestions after every answer)."""
    opening = [_user(f"Hello! I am user {n}.")]
    await _chat_ui(client, n, shape, tally, board, opening, tasks=True, in_turn=True)


async def greeting(
    client: httpx.AsyncClient, n: int, shape: Shape, tally: Tally, board: Board
) -> None:
    """An app that opens every chat with one model-written greeting (the same text in every
    user's chat) under its system prompt."""
    system = {"role": "system", "content": filler_text(random.Random(1), shape.system_pairs)}
    greeted = [system, {"role": "assistant", "content": board.greeting}]
    opening = [*greeted, _user(f"Hello! I am user {n}.")]
    await _chat_ui(client, n, shape, tally, board, opening, in_turn=True)


async def lookalike(
    client: httpx.AsyncClient, n: int, shape: Shape, tally: Tally, board: Board
) -> None:
    """Users who look alike under one system prompt: the same first message answered alike
    (one seed), regenerations and edits, and every sixth message a stretch of another user's
    latest answer pasted in."""
    system = {"role": "system", "content": filler_text(random.Random(1), shape.system_pairs)}
    opening = [system, _user("Hello!")]
    await _chat_ui(client, n, shape, tally, board, opening, pastes=True, in_turn=True, same=True)


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


#: Open WebUI's task prompts (shortened): each quotes the chat history in one user message.
TASKS = {
    "title": "### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat.",
    "tags": "### Task:\nGenerate 1-3 broad tags categorizing the main themes of the chat.",
    "follow_up": "### Task:\nSuggest 3-5 relevant follow-up questions the user might ask.",
}


def _task(kind: str, window: list[dict[str, Any]]) -> list[dict[str, Any]]:
    history = "\n".join(
        f"{m['role'].upper()}: {m['content']}" for m in window[-6:] if m["role"] != "system"
    )
    return [_user(f"{TASKS[kind]}\n### Chat History:\n<chat_history>\n{history}\n</chat_history>")]


async def _chat_ui(
    client: httpx.AsyncClient,
    n: int,
    shape: Shape,
    tally: Tally,
    board: Board,
    window: list[dict[str, Any]],
    tasks: bool = False,
    pastes: bool = False,
    in_turn: bool = False,
    same: bool = False,
) -> None:
    rng = random.Random(3000 + n)
    for step in range(1, shape.steps + 1):
        if in_turn:
            await board.wait_turn(n)
        seed = 7 if same and step == 1 else n * 10_000 + step
        answer, usage = await ask(client, window, shape.answer_tokens, False, seed)
        tally.add("main", usage)
        if step % 5 == 0:  # regenerate
            answer, usage = await ask(client, window, shape.answer_tokens, False, seed + 5000)
            tally.add("regenerate", usage)
        if step % 7 == 0:  # the last message edited
            window[-1] = _user(filler_text(rng, shape.output_pairs))
            answer, usage = await ask(client, window, shape.answer_tokens, False, seed + 7000)
            tally.add("edit", usage)
        window += [{"role": "assistant", "content": answer}]
        board.answers[n] = answer
        for kind in ("title", "tags", "follow_up") if tasks else ():
            if step == 1 or kind == "follow_up":
                tally.add(kind, (await ask(client, _task(kind, window), 16, False, seed))[1])
        text = filler_text(rng, shape.output_pairs)
        others = [a for user, a in board.answers.items() if user != n and len(a) > 40]
        if pastes and step % 6 == 0 and others:  # a stretch of another user's answer
            theirs = rng.choice(others)
            text = f"What about this: {theirs[len(theirs) // 4 :]}\n{text}"
        window.append(_user(text))
        if step % 11 == 0 and len(window) > 6:  # an earlier message edited: a branch
            first = next(i for i, m in enumerate(window) if m["role"] == "user")
            window = [*window[: first + 2], _user(filler_text(rng, shape.output_pairs))]
        if in_turn:
            await board.pass_turn()
        else:
            await asyncio.sleep(rng.uniform(0, shape.think_s))


#: The traffic a grid runs: agents that name no session, a load test, chat UIs (a chat UI's
#: backend: many users behind one key).
TRAFFIC = {
    "agents": agent,
    "one-shot": one_shot,
    "chat": chat,
    "webui": webui,
    "greeting": greeting,
    "lookalike": lookalike,
}


async def run_sessions(base_url: str, sessions: int, shape: Shape, traffic: str) -> Tally:
    tally, board = Tally(), Board(users=sessions)
    client_of = TRAFFIC[traffic]
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        if traffic == "greeting":  # the app's greeting, written once by the model
            board.greeting, usage = await ask(
                client, [_user("Greet a new user of the app.")], shape.answer_tokens, False, 1
            )
            tally.add("greeting", usage)
        await asyncio.gather(*(client_of(client, n, shape, tally, board) for n in range(sessions)))
    return tally


def measure(
    plugin: bool, pool: int, sessions: int, shape: Shape, traffic: str = "agents"
) -> dict[str, Any]:
    env: dict[str, str] = {}  # the plugin as it ships: implicit sessions on by default
    longest = min(4096, (pool - 4) * 32)  # vLLM needs a whole request to fit in the pool
    server = VLLMServer(plugin=plugin, num_blocks=pool, max_model_len=longest, eager=True, env=env)
    with server:
        tally = asyncio.run(run_sessions(server.base_url, sessions, shape, traffic))
        extra: dict[str, Any] = {}
        if plugin:
            (engine,) = server.affinity_stats()["engines"]
            extra = {
                "released": sum(v for k, v in engine.items() if k.startswith("block_released_")),
                "released_hit": engine.get("released_hit", 0),
                "chains_continued": int(
                    server.metric("vllm_affinity_implicit_sessions_total", outcome="continued")
                ),
                "chains_started": int(
                    server.metric("vllm_affinity_implicit_sessions_total", outcome="started")
                ),
                "rewrites": int(
                    server.metric("vllm_affinity_agent_windows_total", verdict="rewrite")
                ),
            }
    return {
        "prompt": sum(tally.prompt.values()),
        "computed": tally.computed,
        "by_kind": {k: (tally.prompt[k], tally.cached[k]) for k in tally.prompt},
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pools", default="64,76", help="pool sizes in blocks per session, comma-separated"
    )
    parser.add_argument("--sessions", default="1,4", help="concurrent sessions per grid")
    parser.add_argument(
        "--traffic", default="agents,one-shot,chat", help=f"among {', '.join(TRAFFIC)}"
    )
    parser.add_argument("--steps", type=int, default=Shape.steps)
    parser.add_argument("--out", default="benchmarks/results/idless_agents.json")
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m benchmarks.agents.idless_agents", *given])
    shape = Shape(steps=args.steps)
    traffics = args.traffic.split(",")
    unknown = set(traffics) - set(TRAFFIC)
    if unknown:
        parser.error(
            f"unknown traffic {', '.join(sorted(unknown))}: choose among {', '.join(TRAFFIC)}"
        )
    cells = []
    grid = [
        (traffic, sessions, int(p) * sessions)
        for traffic in traffics
        for sessions in (int(s) for s in args.sessions.split(","))
        for p in args.pools.split(",")
    ]
    for traffic, sessions, pool in grid:
        cell: dict[str, Any] = {"traffic": traffic, "sessions": sessions, "pool_blocks": pool}
        for side in ("vanilla", "plugin"):
            print(f"{traffic}: {sessions} session(s), {pool} blocks, {side} ...", flush=True)
            cell[side] = measure(side == "plugin", pool, sessions, shape, traffic)
        cell["ratio"] = round(cell["plugin"]["computed"] / cell["vanilla"]["computed"], 3)
        print(f"  computed: vanilla {cell['vanilla']['computed']}, plugin "
                  f"{cell['plugin']['computed']} (x{cell['ratio']})", flush=True)  # fmt: skip
        cells.append(cell)
    lines = [
        f"Command: `{command}`",
        "",
        "| traffic | sessions | pool (blocks) | prompt (vanilla / plugin) | vanilla computed | "
        "plugin computed | ratio | released | released hit | chains continued / started |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        p = c["plugin"]
        lines.append(
            f"| {c['traffic']} | {c['sessions']} | {c['pool_blocks']} | "
            f"{c['vanilla']['prompt']} / {p['prompt']} | {c['vanilla']['computed']} | "
            f"{p['computed']} | {c['ratio']} | {p['released']} | {p['released_hit']} | "
            f"{p['chains_continued']} / {p['chains_started']} |"
        )
    lines.append(
        "\nPrompt tokens differ between the sides where an answer did (vLLM's CPU sampling is "
        "seeded, but a batch's make-up can change a logit's last bits)."
    )
    result = {"shape": asdict(shape), "cells": cells}
    out = Path(args.out)
    write_outputs(out.parent, out.stem, result, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
