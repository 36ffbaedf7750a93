"""A chat UI's backend: the real Open WebUI (PyPI ``open-webui``, in a virtualenv of its own,
``WEBUI_AUTH=False``) in front of vanilla vLLM and of the plugin as it ships (implicit sessions
on), the same traffic through each, at a tight pool and a loose one.

Open WebUI names no session and sends no system prompt by default; after a chat's first answer
it asks the model for the chat's title and tags, and after every answer for follow-up
suggestions, each one user message quoting the chat's last messages (its own task prompts,
through its task endpoints). Several users chat through its HTTP API, taking turns, each chat
with regenerations, an edited last message and an edited earlier one (a branch). Where a guess
could join two users' chats or release a live one, the plugin must not: reported per side are
the prompt tokens vLLM computed (not read from the prefix cache; from vLLM's own counters), and
for the plugin the blocks released, released blocks hit again, and how it linked the requests.

    python -m benchmarks.agents.open_webui [--users 6] [--turns 6] [--pools 20,48]

``make test-long`` runs it (``tests/coding_agents/test_open_webui.py``) and asserts no join,
nothing released hit again, and the plugin never computing more than vanilla.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from jiuwen_replay.output import write_outputs
from vllm_affinity.testing import (
    BLOCK_SIZE,
    SERVED_NAME,
    LoopbackServer,
    ServerStartError,
    VLLMServer,
    filler_text,
    free_port,
    start_process_group,
    stop_process_group,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]
#: Where ``make open-webui`` installs it.
OPEN_WEBUI = ROOT / ".cache" / "openwebui-venv" / "bin" / "open-webui"
#: Tokens of each task answer (an admin's task-model setting; Open WebUI's default is 1,000).
TASK_TOKENS = 16


class OpenWebUI(LoopbackServer):
    """The real Open WebUI serving on loopback, its OpenAI connection pointed at ``upstream``
    (a vLLM server's ``/v1``), auth off, its data in a directory of its own, no network use."""

    def __init__(self, upstream: str, data_dir: Path, binary: Path = OPEN_WEBUI) -> None:
        self.upstream = upstream
        self.data_dir = data_dir
        self.binary = binary
        self.port = free_port()
        self.token = ""
        self.log_path = data_dir / "open-webui.log"
        self._process: subprocess.Popen[Any] | None = None

    def start(self, timeout: float = 240.0) -> OpenWebUI:
        if not self.binary.exists():
            raise ServerStartError(f"{self.binary} is missing: run `make open-webui` first")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "DATA_DIR": str(self.data_dir),
            "WEBUI_AUTH": "False",
            "WEBUI_SECRET_KEY": "jiuwen-test",
            "ENABLE_OLLAMA_API": "False",
            "OPENAI_API_BASE_URL": self.upstream,
            "OPENAI_API_KEY": "none",
            # no model hub, no update check, no telemetry: nothing leaves the machine
            "OFFLINE_MODE": "True",
            "HF_HUB_OFFLINE": "1",
            "BYPASS_EMBEDDING_AND_RETRIEVAL": "True",
            "ENABLE_VERSION_UPDATE_CHECK": "False",
            "ANONYMIZED_TELEMETRY": "False",
            "SCARF_NO_ANALYTICS": "true",
            "DO_NOT_TRACK": "true",
        }
        command = [str(self.binary), "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        with self.log_path.open("wb") as log:
            self._process = start_process_group(
                command, env=env, cwd=self.data_dir, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            wait_until(self._healthy, timeout, "Open WebUI to answer /health", interval=1.0)
            # auth off: signing in with nothing gives the one (admin) user's token
            signed = httpx.post(
                f"{self.root_url}/api/v1/auths/signin",
                json={"email": "", "password": ""},
                timeout=30,
            )
            signed.raise_for_status()
            self.token = signed.json()["token"]
            config = self.get("/api/v1/tasks/config")
            config["TASK_MODEL_PARAMS"] = {"max_tokens": TASK_TOKENS}
            self.post("/api/v1/tasks/config/update", config)
        except Exception:
            self.stop()
            raise ServerStartError(f"Open WebUI did not start:\n{self.log_tail()}") from None
        return self

    def _healthy(self) -> bool:
        if self._process is not None and self._process.poll() is not None:
            raise ServerStartError(f"Open WebUI exited:\n{self.log_tail()}")
        try:
            return httpx.get(f"{self.root_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def get(self, path: str) -> Any:
        reply = httpx.get(self.root_url + path, headers=self.headers, timeout=30)
        reply.raise_for_status()
        return reply.json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        reply = httpx.post(self.root_url + path, json=body, headers=self.headers, timeout=60)
        reply.raise_for_status()
        return reply.json()

    def stop(self) -> None:
        stop_process_group(self._process, signal.SIGTERM, timeout=20)
        self._process = None

    def __enter__(self) -> OpenWebUI:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@dataclass
class Traffic:
    """What the users sent through Open WebUI: chat requests, and of them those carrying an
    earlier answer (each continues its chat), and task requests."""

    chats: int = 0
    carrying: int = 0
    tasks: dict[str, int] = field(default_factory=dict)


async def _ask(
    client: httpx.AsyncClient, messages: list[dict[str, Any]], seed: int, traffic: Traffic
) -> str:
    """A chat request, sampled with a seed of the user's (the two sides get the same answers;
    users answer differently, as a real model's would)."""
    body = {
        "model": SERVED_NAME,
        "messages": messages,
        "stream": False,
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": seed,
    }
    reply = await client.post("/api/chat/completions", json=body)
    reply.raise_for_status()
    traffic.chats += 1
    traffic.carrying += any(m["role"] == "assistant" for m in messages)
    return str(reply.json()["choices"][0]["message"]["content"])


async def _task(
    client: httpx.AsyncClient, kind: str, chat_id: str, messages: list[dict[str, Any]], t: Traffic
) -> None:
    body = {"model": SERVED_NAME, "messages": messages, "chat_id": chat_id}
    reply = await client.post(f"/api/v1/tasks/{kind}/completions", json=body)
    reply.raise_for_status()
    t.tasks[kind] = t.tasks.get(kind, 0) + 1


@dataclass
class _User:
    """One user's chat: a turn per answer, the title and tags after the first, follow-ups
    after each; the third turn regenerated, the fourth's message edited, the fifth a branch
    (the first message's answer kept, what followed replaced)."""

    n: int
    chat: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(500 + self.n)
        self.chat = [{"role": "user", "content": f"Hello! I am user {self.n}."}]

    async def turn(self, client: httpx.AsyncClient, turn: int, traffic: Traffic) -> None:
        chat, seed = self.chat, self.n * 1000 + turn
        answer = await _ask(client, chat, seed, traffic)
        if turn == 3:  # regenerate
            answer = await _ask(client, chat, seed + 500, traffic)
        if turn == 4:  # the last message edited
            chat[-1] = {"role": "user", "content": filler_text(self.rng, 24)}
            answer = await _ask(client, chat, seed + 700, traffic)
        chat.append({"role": "assistant", "content": answer})
        kinds = ("title", "tags", "follow_up") if turn == 1 else ("follow_up",)
        for kind in kinds:
            await _task(client, kind, f"chat-{self.n}", chat, traffic)
        chat.append({"role": "user", "content": filler_text(self.rng, 24)})
        if turn == 5:  # an earlier message edited: the chat goes on from there
            self.chat = [*chat[:2], {"role": "user", "content": filler_text(self.rng, 24)}]


async def _drive(owui: OpenWebUI, users: int, turns: int) -> Traffic:
    """The users take turns, one at a time in a fixed order: both sides see the same sequence
    of requests (under concurrency vanilla's own evictions change from run to run, and vLLM's
    CPU engine dies on a seeded request whose prefill is split over steps)."""
    traffic = Traffic()
    chats = [_User(n) for n in range(users)]
    async with httpx.AsyncClient(base_url=owui.root_url, headers=owui.headers, timeout=300) as c:
        for turn in range(1, turns + 1):
            for user in chats:
                await user.turn(c, turn, traffic)
    return traffic


def measure(plugin: bool, pool: int, users: int, turns: int) -> dict[str, Any]:
    """One side: a vLLM server with ``pool`` blocks, Open WebUI in front, the users' traffic."""
    longest = min(4096, (pool - 4) * BLOCK_SIZE)  # a request must fit in the pool
    server = VLLMServer(plugin=plugin, num_blocks=pool, max_model_len=longest, eager=True)
    with server, tempfile.TemporaryDirectory(prefix="jiuwen-open-webui-") as data:
        with OpenWebUI(server.base_url, Path(data)) as owui:
            traffic = asyncio.run(_drive(owui, users, turns))
        computed = server.metric("vllm:prompt_tokens_by_source_total", source="local_compute")
        hit = server.metric("vllm:prompt_tokens_by_source_total", source="local_cache_hit")
        side: dict[str, Any] = {
            "computed": int(computed),
            "prompt": int(computed + hit),
            "traffic": asdict(traffic),
        }
        if plugin:
            (engine,) = server.affinity_stats()["engines"]
            side["released"] = sum(v for k, v in engine.items() if k.startswith("block_released_"))
            side["released_hit"] = engine.get("released_hit", 0)
            side["chains"] = {
                outcome: int(
                    server.metric("vllm_affinity_implicit_sessions_total", outcome=outcome)
                )
                for outcome in ("started", "continued", "side")
            }
    return side


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--pools", default="20,48", help="blocks per user, comma-separated")
    parser.add_argument("--out", default="benchmarks/results/open_webui.json")
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m benchmarks.agents.open_webui", *given])
    cells = []
    for per_user in (int(p) for p in args.pools.split(",")):
        pool = per_user * args.users
        cell: dict[str, Any] = {"users": args.users, "turns": args.turns, "pool_blocks": pool}
        for side in ("vanilla", "plugin"):
            print(f"Open WebUI, {args.users} users, {pool} blocks, {side} ...", flush=True)
            cell[side] = measure(side == "plugin", pool, args.users, args.turns)
        cell["ratio"] = round(cell["plugin"]["computed"] / cell["vanilla"]["computed"], 3)
        print(f"  computed: vanilla {cell['vanilla']['computed']}, plugin "
              f"{cell['plugin']['computed']} (x{cell['ratio']})", flush=True)  # fmt: skip
        cells.append(cell)
    lines = [
        f"Command: `{command}`",
        "",
        "| users | pool (blocks) | prompt (vanilla / plugin) | vanilla computed | "
        "plugin computed | ratio | released | released hit | chains started / continued / side "
        "| chat requests (carrying an answer) | task requests |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        p, t = c["plugin"], c["plugin"]["traffic"]
        chains = p["chains"]
        lines.append(
            f"| {c['users']} | {c['pool_blocks']} | {c['vanilla']['prompt']} / {p['prompt']} | "
            f"{c['vanilla']['computed']} | {p['computed']} | {c['ratio']} | {p['released']} | "
            f"{p['released_hit']} | {chains['started']} / {chains['continued']} / "
            f"{chains['side']} | {t['chats']} ({t['carrying']}) | {sum(t['tasks'].values())} |"
        )
    out = Path(args.out)
    write_outputs(out.parent, out.stem, {"cells": cells}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
