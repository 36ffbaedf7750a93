"""vLLM's own router (``vllm-router`` on PyPI, a Rust binary) in front of plugin replicas that
publish their KV events, and a subscriber that replays those events as a KV-aware router does:
the harness of ``tests/e2e/test_vllm_router.py`` and of ``benchmarks.fleet.router_placement`` /
``benchmarks.fleet.router_idless``. ``make test`` installs the router in ``.venv-router``."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

from vllm_affinity.engine import event_hash_text
from vllm_affinity.testing import (
    BLOCK_SIZE,
    SERVED_NAME,
    VLLMServer,
    free_port,
    start_process_group,
    stop_process_group,
)

ROUTER_VERSION = "0.1.17"
#: Where ``make test`` installs it.
ROUTER_BIN = Path(__file__).resolve().parents[2] / ".venv-router" / "bin" / "vllm-router"

#: The policies measured (``docs/deployment.md``), by name: vllm-router's flags.
POLICIES: dict[str, list[str]] = {
    "round_robin": ["--policy", "round_robin"],
    "consistent_hash": ["--policy", "consistent_hash"],
    "cache_aware": ["--policy", "cache_aware"],
    "kv_aware": ["--policy", "kv_aware"],
    "kv_aware+affinity": ["--policy", "kv_aware", "--kv-aware-session-affinity-ttl-secs", "600"],
    "sticky_least_loaded": ["--policy", "sticky_least_loaded"],
}


def router_binary(given: str | None = None) -> str | None:
    """The router's executable: ``given`` (a path or a name on ``PATH``), else the one
    ``make test`` installs, else ``vllm-router`` on ``PATH``; ``None`` when there is none."""
    for candidate in (given,) if given else (str(ROUTER_BIN), "vllm-router"):
        found = shutil.which(candidate) or (candidate if Path(candidate).exists() else None)
        if found:
            return found
    return None


def apply_kv_events(cached: dict[int, set[str]], events: Iterable[Any]) -> int:
    """Replay vLLM's KV events into ``cached`` (per group, the hashes as ``event_hash_text``
    spells them), as a KV-aware router does; returns how many hashes were removed."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    removed = 0
    for event in events:
        if isinstance(event, AllBlocksCleared):
            cached.clear()
            continue
        hashes = {event_hash_text(h) for h in event.block_hashes}
        group = cached.setdefault(event.group_idx or 0, set())
        if isinstance(event, BlockStored):
            group.update(hashes)
        elif isinstance(event, BlockRemoved):
            group.difference_update(hashes)
            removed += len(hashes)
    return removed


class KvEventView:
    """What a KV-aware router holds of one replica: per KV-cache group, the hashes of the blocks
    its events say are cached (``BlockStored`` adds, ``BlockRemoved`` takes away,
    ``AllBlocksCleared`` empties). Subscribes over ZMQ in a thread of its own; ``gaps`` counts
    batches lost on the way (their sequence numbers skipped), which would make it inexact."""

    def __init__(self, endpoint: str, topic: str = "kv-events") -> None:
        self.endpoint, self.topic = endpoint, topic
        self.cached: dict[int, set[str]] = defaultdict(set)
        self.batches = self.gaps = 0
        #: Block hashes the events said were evicted (a test that wants evictions checks it).
        self.removed = 0
        self._last_seq: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> KvEventView:
        import vllm.distributed.kv_events  # noqa: F401 (seconds of imports, not on the thread)

        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"could not subscribe to {self.endpoint}")
        time.sleep(0.5)  # ZMQ's slow joiner: the subscription reaches the publisher
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def snapshot(self) -> dict[str, list[str]]:
        """Per group (as text), the sorted hashes: ``/affinity/check?blocks=true``'s shape."""
        with self._lock:
            return {str(g): sorted(hashes) for g, hashes in self.cached.items() if hashes}

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch  # imported by start() already

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        context = zmq.Context()
        socket = context.socket(zmq.SUB)
        socket.connect(self.endpoint)
        socket.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not socket.poll(100):
                    continue
                _, seq_bytes, payload = socket.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                batch = decoder.decode(payload)
                with self._lock:
                    if self._last_seq is not None and seq != self._last_seq + 1:
                        self.gaps += 1
                    self._last_seq = seq
                    self.batches += 1
                    self.removed += apply_kv_events(self.cached, batch.events)
        finally:
            socket.close(linger=0)
            context.term()


def event_replica(num_blocks: int = 256, model: str | None = None, **kwargs: Any) -> VLLMServer:
    """A plugin replica that publishes its KV events over ZMQ on a port of its own
    (``server.kv_events_port``); vLLM's publisher must bind ``tcp://*:PORT``, as the router
    accepts only ``tcp://HOST:PORT`` sources."""
    port = free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{port}", "topic": "kv-events"}  # fmt: skip
    extra = tuple(kwargs.pop("extra_args", ()))
    kwargs.setdefault("eager", True)
    kwargs.setdefault("worker_in_engine", True)
    server = VLLMServer(
        model=model, plugin=kwargs.pop("plugin", True), num_blocks=num_blocks,
        extra_args=("--kv-events-config", json.dumps(config), *extra), **kwargs,
    )  # fmt: skip
    server.kv_events_port = port  # type: ignore[attr-defined]
    return server


def engine_cached_blocks(server: VLLMServer) -> dict[str, list[str]]:
    """The engine's own prefix cache, per group (``/affinity/check?blocks=true``)."""
    answer = httpx.get(
        server.root_url + "/affinity/check", params={"blocks": "true"},
        headers=server.headers(), timeout=60,
    ).json()  # fmt: skip
    (engine,) = answer["engines"]
    return {g: hashes for g, hashes in engine["cached_blocks"].items() if hashes}


def views_agree(server: VLLMServer, view: KvEventView, timeout: float = 20.0) -> str | None:
    """``None`` once the events' view equals the engine's cache (the publisher runs a step
    behind), else what differs after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        server.idle_check(timeout=timeout)
        engine, seen = engine_cached_blocks(server), view.snapshot()
        if engine == seen and not view.gaps:
            return None
        if time.monotonic() > deadline:
            groups = sorted(set(engine) | set(seen))
            return (
                "; ".join(
                    f"group {g}: engine {len(engine.get(g, []))}, events {len(seen.get(g, []))}, "
                    f"only in the events {len(set(seen.get(g, [])) - set(engine.get(g, [])))}"
                    for g in groups
                )
                + f"; {view.gaps} gaps in {view.batches} batches"
            )
        time.sleep(0.5)


class Router:
    """``vllm-router`` on loopback in front of ``replicas`` with ``flags``; a kv_aware policy
    gets every replica's KV events (``--kv-event-source``)."""

    def __init__(self, binary: str, replicas: list[VLLMServer], flags: list[str]) -> None:
        self.port = free_port()
        self.replicas, self.flags = replicas, flags
        command = [binary, "--host", "127.0.0.1", "--port", str(self.port), *flags]
        command += ["--worker-urls", *(r.root_url for r in replicas)]
        if "kv_aware" in flags:
            command += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", SERVED_NAME]
            for replica in replicas:
                endpoint = f"tcp://127.0.0.1:{replica.kv_events_port}"  # type: ignore[attr-defined]
                command += ["--kv-event-source", f"{replica.root_url}={endpoint}"]
        self.command = command
        handle, log = tempfile.mkstemp(prefix="vllm-router-", suffix=".log")
        self.log_path = Path(log)
        self._log = open(handle, "wb")  # noqa: SIM115 (closed in stop)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> Router:
        self._process = start_process_group(
            self.command, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"vllm-router did not start; see {self.log_path}")

    def stop(self) -> None:
        process, self._process = self._process, None
        stop_process_group(process, signal.SIGTERM, timeout=20)
        self._log.close()

    def __enter__(self) -> Router:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def finished(server: VLLMServer) -> float:
    """Requests the replica has finished (its own counter)."""
    return sum(
        server.metric("vllm:request_success_total", finished_reason=reason)
        for reason in ("length", "stop", "abort")
    )


def served_by(replicas: list[VLLMServer], call: Callable[[], httpx.Response]) -> tuple[int, Any]:
    """Run one call (nothing else in flight) and tell which replica served it, by the replicas'
    finished-request counters."""
    before = [finished(r) if r.running else 0.0 for r in replicas]
    answer = call()
    answer.raise_for_status()
    deadline = time.monotonic() + 10
    while True:
        after = [finished(r) if r.running else 0.0 for r in replicas]
        moved = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
        if len(moved) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if len(moved) != 1:
        raise RuntimeError(f"one call, finished on replicas {moved}")
    return moved[0], answer.json()
