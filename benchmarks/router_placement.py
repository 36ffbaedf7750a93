"""Where vLLM's own router sends coding-agent sessions: two plugin replicas (the tiny model,
their KV events published over ZMQ) behind ``vllm-router``, sessions shaped as Claude Code's
(only ``x-claude-code-session-id`` names them; one shared system prompt), beside sessions
named by ``X-Session-ID`` (the control), one after the other,
a few turns each. Prints, per router configuration, the replica that served each call (told by
the replicas' own finished-request counters: calls are sequential).

    pip install vllm-router==0.1.17
    python -m benchmarks.router_placement [--sessions 6] [--turns 3] [--router-bin vllm-router]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from jiuwen_kv_protocol.headers import CLAUDE_CODE_SESSION_HEADER, SESSION_HEADER
from vllm_affinity.testing import BLOCK_SIZE, SERVED_NAME, VLLMServer, filler_text, free_port

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


def replicas(count: int) -> list[tuple[VLLMServer, int]]:
    """Plugin replicas that publish their KV events on a ZMQ port each."""
    out = []
    for _ in range(count):
        events = free_port()
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{events}", "topic": "kv-events"}  # fmt: skip
        server = VLLMServer(
            plugin=True, num_blocks=256, eager=True, worker_in_engine=True,
            extra_args=("--kv-events-config", json.dumps(config)),
        )  # fmt: skip
        out.append((server, events))
    return out


def finished(server: VLLMServer) -> float:
    return sum(
        server.metric("vllm:request_success_total", finished_reason=reason)
        for reason in ("length", "stop")
    )


def place(router_bin: str, flags: list[str], header: str, fleet: list[tuple[VLLMServer, int]],
          sessions: int, turns: int) -> list[list[int]]:  # fmt: skip
    port = free_port()
    cmd = [router_bin, "--host", "127.0.0.1", "--port", str(port), *flags, "--worker-urls"]
    cmd += [server.root_url for server, _ in fleet]
    if "kv_aware" in flags:
        cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", SERVED_NAME]
        for server, events in fleet:
            cmd += ["--kv-event-source", f"{server.root_url}=tcp://127.0.0.1:{events}"]
    log = Path(f"/tmp/vllm-router-{port}.log")
    router = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    system = {"role": "system", "content": filler_text(random.Random(1), 200)}
    placements: list[list[int]] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        for n in range(sessions):
            session, served = str(uuid.uuid4()), []
            text = f"task {n} " + filler_text(random.Random(n), 30)
            window: list[dict[str, Any]] = [system, {"role": "user", "content": text}]
            for turn in range(turns):
                before = [finished(server) for server, _ in fleet]
                body = {"model": SERVED_NAME, "messages": window, "max_tokens": 4}
                answer = httpx.post(url, json=body, timeout=120,
                                    headers={header: session})  # fmt: skip
                answer.raise_for_status()
                after = [finished(server) for server, _ in fleet]
                (replica,) = [
                    i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b
                ]
                served.append(replica)
                window += [
                    {
                        "role": "assistant",
                        "content": answer.json()["choices"][0]["message"]["content"],
                    },
                    {"role": "user", "content": filler_text(random.Random(100 + turn), 20)},
                ]
            placements.append(served)
    finally:
        router.terminate()
        router.wait(timeout=30)
    return placements


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--router-bin", default="vllm-router")
    args = parser.parse_args(argv)
    router_bin = shutil.which(args.router_bin) or args.router_bin
    if not Path(router_bin).exists():
        parser.error(f"{args.router_bin} not found: pip install vllm-router==0.1.17")
    fleet = replicas(2)
    for server, _ in fleet:
        server.start()
    try:
        for name, (flags, header) in CONFIGS.items():
            placements = place(router_bin, flags, header, fleet, args.sessions, args.turns)
            print(f"{name}: {json.dumps(placements)}", flush=True)
    finally:
        for server, _ in fleet:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
