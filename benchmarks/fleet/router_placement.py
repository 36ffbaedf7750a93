"""Where vLLM's own router sends coding-agent sessions: two plugin replicas (the tiny model,
their KV events published over ZMQ) behind ``vllm-router``, sessions shaped as Claude Code's
(only ``x-claude-code-session-id`` names them; one shared system prompt), beside sessions
named by ``X-Session-ID`` (the control), one after the other,
a few turns each. Prints, per router configuration, the replica that served each call (told by
the replicas' own finished-request counters: calls are sequential).

    make test                      # installs vllm-router 0.1.17 in .venv-router
    python -m benchmarks.fleet.router_placement [--sessions 6] [--turns 3] [--router-bin PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import uuid
from typing import Any

import httpx

from jiuwen_kv_protocol.headers import CLAUDE_CODE_SESSION_HEADER, SESSION_HEADER
from vllm_affinity.testing import SERVED_NAME, VLLMServer, filler_text

from .vllm_router import Router, event_replica, router_binary, served_by

#: The configurations measured: a name, vllm-router's flags (the KV event sources added) and
#: the header that names the session. The first is the control: a session named by
#: ``X-Session-ID``, which vllm-router's consistent hash reads.
CONFIGS: dict[str, tuple[list[str], str]] = {
    "consistent_hash, X-Session-ID": (["--policy", "consistent_hash"], SESSION_HEADER),
    "consistent_hash": (["--policy", "consistent_hash"], CLAUDE_CODE_SESSION_HEADER),
    "kv_aware+affinity": (
        ["--policy", "kv_aware", "--kv-aware-session-affinity-ttl-secs", "600"],
        CLAUDE_CODE_SESSION_HEADER,
    ),
    "sticky_least_loaded": (["--policy", "sticky_least_loaded"], CLAUDE_CODE_SESSION_HEADER),
    "kv_aware+affinity, temperature 1": (
        [
            "--policy",
            "kv_aware",
            "--kv-aware-session-affinity-ttl-secs",
            "600",
            "--router-temperature",
            "1",
        ],
        CLAUDE_CODE_SESSION_HEADER,
    ),
    "program_scheduling": (
        ["--policy", "consistent_hash", "--enable-program-scheduling"],
        CLAUDE_CODE_SESSION_HEADER,
    ),
}


def place(binary: str, flags: list[str], header: str, fleet: list[VLLMServer],
          sessions: int, turns: int) -> list[list[int]]:  # fmt: skip
    system = {"role": "system", "content": filler_text(random.Random(1), 200)}
    placements: list[list[int]] = []
    with Router(binary, fleet, flags) as router:
        for n in range(sessions):
            session, served = str(uuid.uuid4()), []
            text = f"task {n} " + filler_text(random.Random(n), 30)
            window: list[dict[str, Any]] = [system, {"role": "user", "content": text}]
            for turn in range(turns):
                body = {"model": SERVED_NAME, "messages": window, "max_tokens": 4}

                def send(body: dict[str, Any] = body, session: str = session) -> httpx.Response:
                    return httpx.post(router.url + "/v1/chat/completions", json=body,
                                      headers={header: session}, timeout=120)  # fmt: skip

                replica, answer = served_by(fleet, send)
                served.append(replica)
                window += [
                    {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                    {"role": "user", "content": filler_text(random.Random(100 + turn), 20)},
                ]
            placements.append(served)
    return placements


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--router-bin", default=None)
    args = parser.parse_args(argv)
    binary = router_binary(args.router_bin)
    if binary is None:
        parser.error("vllm-router not found: make test installs it (or pip install vllm-router)")
    fleet = [event_replica() for _ in range(2)]
    for server in fleet:
        server.start()
    try:
        for name, (flags, header) in CONFIGS.items():
            placements = place(binary, flags, header, fleet, args.sessions, args.turns)
            print(f"{name}: {json.dumps(placements)}", flush=True)
    finally:
        for server in fleet:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
