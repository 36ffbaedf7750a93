"""nginx on loopback in front of vLLM replicas, with the configuration the plugin prints
(``python -m vllm_affinity nginx-config``): the router of the fleet tests and benchmarks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..nginx import (
    TEMP_DIRS,
    Policy,
    RouterStartError,
    find_nginx,
    indent,
    nginx_config,
    temp_paths,
)
from .processes import LoopbackServer, free_port, start_process_group, stop_process_group


@dataclass(frozen=True)
class Routed:
    """One request as the router's access log saw it."""

    session: str
    #: The replica that answered (the last one tried, when nginx moved on from a failed one).
    upstream: str
    status: int
    method: str
    uri: str
    release: bool


class NginxRouter(LoopbackServer):
    """A real nginx process on 127.0.0.1, in a prefix directory of its own (configuration,
    logs, temporary files), in the foreground so that ``stop()`` ends it."""

    def __init__(
        self, upstreams: Sequence[str], *, policy: Policy = "session", port: int | None = None
    ) -> None:
        self.upstreams = list(upstreams)
        self.policy = policy
        self.port = port or free_port()
        self.prefix = Path(tempfile.mkdtemp(prefix="jiuwen-nginx-"))
        self.access_log = self.prefix / "access.log"
        self._process: subprocess.Popen[bytes] | None = None

    def config(self) -> str:
        http = nginx_config(
            self.upstreams, f"127.0.0.1:{self.port}", policy=self.policy,
            access_log=str(self.access_log),
        )  # fmt: skip
        # Workers run as the starting user (as root nginx would switch them to nobody, who may
        # not write the prefix directory).
        user = "user root;\n" if os.geteuid() == 0 else ""
        return (
            f"{user}daemon off;\nworker_processes 1;\npid {self.prefix}/nginx.pid;\n"
            f"error_log {self.prefix}/error.log warn;\nevents {{ worker_connections 1024; }}\n"
            f"http {{\n{temp_paths(self.prefix)}{indent(http)}}}\n"
        )

    def start(self, timeout: float = 30.0) -> NginxRouter:
        nginx = find_nginx()
        for temp in TEMP_DIRS:
            (self.prefix / temp).mkdir(exist_ok=True)
        conf = self.prefix / "nginx.conf"
        conf.write_text(self.config())
        test = subprocess.run(
            [nginx, "-t", "-p", str(self.prefix), "-c", str(conf)], capture_output=True, text=True
        )
        if test.returncode != 0:
            raise RouterStartError(f"nginx rejected its configuration:\n{test.stderr}")
        self._process = start_process_group(
            [nginx, "-p", str(self.prefix), "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=(self.prefix / "stderr.log").open("wb"),
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RouterStartError(f"nginx exited:\n{self.error_log()}")
            try:  # a bare connect: a request would reach (and, if down, mark) the replicas
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RouterStartError(f"nginx did not listen within {timeout:.0f} s:\n{self.error_log()}")

    def error_log(self) -> str:
        parts = []
        for name in ("stderr.log", "error.log"):
            path = self.prefix / name
            if path.exists():
                parts.append(path.read_text(errors="replace")[-4000:])
        return "\n".join(parts) or "(no log)"

    def stop(self) -> None:
        process, self._process = self._process, None
        # SIGQUIT: nginx's graceful stop, finishing the requests in flight
        stop_process_group(process, signal.SIGQUIT, timeout=10)

    def __enter__(self) -> NginxRouter:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def routed(self) -> list[Routed]:
        """Every request logged so far (nginx writes a line when a request ends)."""
        if not self.access_log.exists():
            return []
        out = []
        for line in self.access_log.read_text().splitlines():
            entry = json.loads(line)
            out.append(
                Routed(
                    session=entry["session"],
                    upstream=entry["upstream"].split(",")[-1].strip(),
                    status=int(entry["status"]),
                    method=entry["method"],
                    uri=entry["uri"],
                    release=bool(entry["release"]),
                )
            )
        return out

    def wait_routed(self, count: int, timeout: float = 10.0) -> list[Routed]:
        """``routed()`` once at least ``count`` requests are logged: nginx writes a request's
        line after its response is sent, so a client that got its answer can read the log
        before the line is there (a busy machine widens that window)."""
        deadline = time.monotonic() + timeout
        while len(routed := self.routed()) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return routed

    def replica_of(self) -> dict[str, str]:
        """Session → the replica that served its latest request."""
        return {r.session: r.upstream for r in self.routed() if r.session}
