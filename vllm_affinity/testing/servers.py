"""Start a real vLLM server (CPU build) with or without the plugin, for tests and benchmarks.

    with VLLMServer(num_blocks=64) as server:           # plugin enabled
        client = openai.OpenAI(base_url=server.base_url, api_key=server.api_key)

Each server is a ``python -m vllm_affinity serve`` subprocess on a free loopback port, logging to
a file; start-up waits for ``/health`` (about 30 s for the small model on 2 cores) and fails with
the log's tail if the server dies or times out.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from jiuwen_kv_protocol.headers import RELEASE_PATH

from .processes import (
    LoopbackServer,
    core_set,
    die_with_parent,
    free_port,
    stop_process_group,
)
from .tiny_model import build

SERVED_NAME = "tiny"
BLOCK_SIZE = 32


class ServerStartError(RuntimeError):
    pass


def tool_call_parser(model: str) -> str:
    """The tool-call parser for a model folder: vLLM renders gpt-oss's chats with harmony and
    refuses any parser but harmony's own (``openai``) there; ``hermes`` for the others."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return "hermes"
    return "openai" if config.get("model_type") == "gpt_oss" else "hermes"


class VLLMServer(LoopbackServer):
    """A vLLM OpenAI-compatible server process on 127.0.0.1."""

    def __init__(
        self,
        *,
        model: str | Path | None = None,
        plugin: bool = True,
        num_blocks: int = 64,
        max_model_len: int | None = None,
        api_key: str | None = None,
        more_api_keys: tuple[str, ...] = (),
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        startup_timeout: float = 300.0,
        log_dir: str | Path | None = None,
        cpu_cores: str | None = None,
        pin_process: bool = False,
        port: int | None = None,
        eager: bool = False,
        launcher: Sequence[str] | None = None,
        worker_in_engine: bool = False,
    ) -> None:
        self.model = str(model or build())
        #: The command that starts vLLM, before the model (default: this package's launcher;
        #: a peer's benchmark starts another system's server with the same flags).
        self.launcher = list(launcher) if launcher is not None else None
        self.plugin = plugin
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len or min(4096, (num_blocks - 1) * BLOCK_SIZE // 2)
        self.api_key = api_key  # the key this object's own requests use
        self.more_api_keys = more_api_keys  # further keys the server accepts (tenants)
        self.extra_args = extra_args
        self.env = dict(env or {})
        if cpu_cores is not None:
            # Pin the model worker's threads. Two servers compared side by side on a small
            # machine must not share cores: one server's threads keep spinning for a while after
            # its request and slow the other's next request by ~0.4 s (measured on 2 cores).
            self.env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores
        #: Also pin the whole process tree (API server, engine core) to ``cpu_cores``, so that
        #: two servers compared side by side never share a core.
        self.pinned = core_set(cpu_cores) if pin_process and cpu_cores else None
        self.startup_timeout = startup_timeout
        #: A fixed port lets runs that start servers one after the other keep their identity
        #: (a router hashing sessions onto ``host:port`` places them the same way).
        self.port = port or free_port()
        self.log_path = Path(log_dir or tempfile.gettempdir()) / (
            f"vllm-{'affinity' if plugin else 'vanilla'}-{self.port}.log"
        )
        #: ``--enforce-eager``: no torch.compile warm-up, for tests: start-up is about 14 s
        #: shorter (44 s against 58 s here). Benchmarks and the demo keep vLLM's default, so
        #: their figures stay comparable with earlier runs (the agent benchmark's vanilla TTFT
        #: p50 at 0.5x was 63 ms either way here).
        self.eager = eager
        if worker_in_engine:
            # vLLM's UniProcExecutor (one GPU's layout): the model runs in the engine core's
            # process. On CPU vLLM otherwise spawns a worker process, which imports torch and
            # vLLM again (about 15 s of CPU), after the engine core's own import. Tests use
            # it; benchmarks keep the CPU default, where the worker's OpenMP threads are pinned.
            self.env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        """Started and not stopped or killed since."""
        return self._process is not None

    def command(self) -> list[str]:
        if self.launcher is not None:
            cmd = [*self.launcher, self.model]
        else:
            cmd = [sys.executable, "-m", "vllm_affinity", "serve", self.model]
            if not self.plugin:
                cmd.append("--vanilla")
        cmd += [
            "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--block-size", str(BLOCK_SIZE),
            "--num-gpu-blocks-override", str(self.num_blocks),
            "--max-model-len", str(self.max_model_len),
            "--dtype", "bfloat16",
            "--gpu-memory-utilization", "0.3",
            "--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser(self.model),
            "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if self.eager:
            cmd.append("--enforce-eager")
        if self.api_key:
            cmd += ["--api-key", self.api_key, *self.more_api_keys]
        return [*cmd, *self.extra_args]

    def start(self, wait: bool = True) -> VLLMServer:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **self.env}
        log = self.log_path.open("wb")
        self._process = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=self._in_child,
        )
        log.close()
        if wait:
            self.wait_healthy()
        return self

    def _in_child(self) -> None:
        die_with_parent()
        if self.pinned:
            os.sched_setaffinity(0, self.pinned)

    def pin(self, cores: str) -> None:
        """Move every thread of the running server (API server, engine core, worker) to
        ``cores``: a benchmark swaps two servers' cores between rounds, so that neither keeps the
        core that the rest of the machine disturbs more."""
        import psutil

        if self._process is None:
            raise RuntimeError("pin() needs a running server")
        self.pinned = core_set(cores)
        for process in self._process_tree():
            try:
                for thread in process.threads():
                    os.sched_setaffinity(thread.id, self.pinned)
            except (psutil.NoSuchProcess, ProcessLookupError):
                continue  # a short-lived helper process ended meanwhile

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise ServerStartError(f"vLLM exited during start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.root_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise ServerStartError(
            f"vLLM not healthy after {self.startup_timeout:.0f} s:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        process, self._process = self._process, None
        stop_process_group(process, signal.SIGINT, timeout=30)

    def kill(self) -> None:
        """SIGKILL the whole server (API server and engine core), as a crash would; ``start()``
        brings it back on the same port."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- observations -------------------------------------------------------------------------
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _process_tree(self) -> list[Any]:
        """The running server's processes (psutil), its own first."""
        import psutil

        assert self._process is not None
        root = psutil.Process(self._process.pid)
        return [root, *root.children(recursive=True)]

    def cpu_seconds(self) -> float:
        """CPU time (user and system) the server's running processes have used so far: the
        API server, the engine core, the model worker (benchmarks compare it across runs)."""
        return sum(self.cpu_seconds_by_process().values())

    def cpu_seconds_by_process(self) -> dict[str, float]:
        """``cpu_seconds`` per process kind: ``api`` (the API servers and the launcher),
        ``engine`` (vLLM's ``EngineCore`` processes) and ``worker`` (model workers), told
        apart by the titles vLLM gives its processes; helpers count as ``api``. A benchmark
        reads which process a change loads."""
        import psutil

        out = {"api": 0.0, "engine": 0.0, "worker": 0.0}
        if self._process is None:
            return out
        for process in self._process_tree():
            try:
                times, title = process.cpu_times(), process.name()
            except (psutil.NoSuchProcess, ProcessLookupError):
                continue
            kind = "engine" if "EngineCor" in title else "worker" if "Worker" in title else "api"
            out[kind] += times.user + times.system
        return out

    def metrics(self) -> dict[str, float]:
        """Unlabelled-sum view of ``/metrics``: ``{"name{labels}": value}``."""
        text = httpx.get(self.root_url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        """Sum of ``name`` over the series whose labels include ``labels``."""
        total = 0.0
        for key, value in self.metrics().items():
            base, _, label_text = key.partition("{")
            if base != name:
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
            if all(found.get(k) == v for k, v in labels.items()):
                total += value
        return total

    def engine_stats(self) -> dict[str, Any]:
        """The only engine's entry of ``/affinity/stats`` (a server without data parallelism)."""
        (stats,) = self.affinity_stats()["engines"]
        return stats

    def tokenize(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt tokens of a chat window, rendered by the server's own template."""
        body = {"model": SERVED_NAME, "messages": messages}
        response = httpx.post(
            self.root_url + "/tokenize", json=body, headers=self.headers(), timeout=30
        )
        response.raise_for_status()
        return response.json()["tokens"]

    def idle_check(self, timeout: float = 60.0) -> dict[str, Any]:
        """``GET /affinity/check`` once every engine is idle (or after ``timeout`` seconds): the
        engines' invariants, with ``problems`` empty where all hold."""
        deadline = time.monotonic() + timeout
        while True:
            answer: dict[str, Any] = httpx.get(
                self.root_url + "/affinity/check", headers=self.headers(), timeout=30
            ).json()
            if all(e["idle"] for e in answer["engines"]) or time.monotonic() > deadline:
                return answer
            time.sleep(0.5)

    def affinity_stats(self) -> dict[str, Any]:
        response = httpx.get(self.root_url + "/affinity/stats", headers=self.headers(), timeout=30)
        response.raise_for_status()
        return response.json()

    def release(
        self, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> httpx.Response:
        return httpx.post(
            self.root_url + RELEASE_PATH,
            json=body,
            headers=headers if headers is not None else self.headers(),
            timeout=60,
        )


# -- nginx in front of test servers (the configuration: nginx.py) --------------------------
