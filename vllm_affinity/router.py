"""nginx in front of several plugin replicas, routing each session to one of them.

A session's KV blocks live on the replica that served it, so its chat calls and its releases must
reach that replica. The hook puts the session in the ``X-Session-ID`` header of both, and nginx's
consistent hash on that header (``hash $http_x_session_id consistent``, ketama) sends them to the
same replica; when a replica fails, only its sessions move, each to the next replica on the ring,
and they come back when it does. Requests without the header (health checks, the hook's
capability probe) are spread round-robin.

    print(nginx_config(["127.0.0.1:8001", "127.0.0.1:8002"], listen=8000))   # for deployment
    with NginxRouter(["127.0.0.1:8001", "127.0.0.1:8002"]) as router:        # for tests
        client = openai.OpenAI(base_url=router.base_url, ...)

``python -m vllm_affinity nginx-config --upstream HOST:PORT ... --listen PORT`` prints the same
configuration. nginx itself comes from the system (Debian: ``apt-get install nginx``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .testing import LoopbackServer, _die_with_parent, free_port

Policy = Literal["session", "round_robin"]

#: One JSON object per request: which replica served which session, and whether the request
#: carried an in-request release. Tests and benchmarks read it; a deployment may drop it.
LOG_FORMAT = (
    'log_format fleet escape=json \'{"session":"$http_x_session_id",'
    '"upstream":"$upstream_addr","status":"$status","method":"$request_method",'
    '"uri":"$uri","release":"$http_x_kv_release"}\';'
)


def _upstream(upstreams: Sequence[str], policy: Policy) -> str:
    if not upstreams:
        raise ValueError("give at least one upstream replica (host:port)")
    balance = (
        # Ketama consistent hashing: adding or losing a replica moves only its own sessions.
        ["    hash $http_x_session_id consistent;"] if policy == "session" else []
    )
    # A replica that refuses a connection is skipped for fail_timeout; the request goes to the
    # next replica (for the session hash: the next one on the ring).
    servers = [f"    server {u} max_fails=1 fail_timeout=10s;" for u in upstreams]
    return "\n".join(["upstream vllm_replicas {", *balance, *servers, "    keepalive 64;", "}"])


def nginx_config(
    upstreams: Sequence[str],
    listen: int | str = 8000,
    *,
    policy: Policy = "session",
    access_log: str | None = None,
) -> str:
    """The ``http`` block's content: the upstream group and a server that proxies everything
    to it, streaming (no buffering, for time to first token), with long read timeouts (a long
    prefill on a busy replica)."""
    log = [LOG_FORMAT, f"access_log {access_log} fleet;"] if access_log else []
    location = [
        "    location / {",
        "        proxy_pass http://vllm_replicas;",
        "        proxy_http_version 1.1;",
        '        proxy_set_header Connection "";',
        "        proxy_set_header Host $host;",
        "        proxy_buffering off;",
        "        proxy_request_buffering off;",
        "        proxy_read_timeout 600s;",
        "        proxy_next_upstream error timeout;",
        "    }",
    ]
    server = ["server {", f"    listen {listen};", "    client_max_body_size 64m;", *location, "}"]
    return "\n".join([_upstream(upstreams, policy), *log, *server]) + "\n"


class RouterStartError(RuntimeError):
    pass


def find_nginx() -> str:
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if found is None:
        raise RouterStartError(
            "nginx is not installed: on Debian or Ubuntu run `apt-get install nginx` "
            "(`make test` does this when run as root)"
        )
    return found


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
            f"http {{\n{_temp_paths(self.prefix)}{_indent(http)}}}\n"
        )

    def start(self, timeout: float = 30.0) -> NginxRouter:
        nginx = find_nginx()
        for temp in _TEMP_DIRS:
            (self.prefix / temp).mkdir(exist_ok=True)
        conf = self.prefix / "nginx.conf"
        conf.write_text(self.config())
        test = subprocess.run(
            [nginx, "-t", "-p", str(self.prefix), "-c", str(conf)], capture_output=True, text=True
        )
        if test.returncode != 0:
            raise RouterStartError(f"nginx rejected its configuration:\n{test.stderr}")
        self._process = subprocess.Popen(
            [nginx, "-p", str(self.prefix), "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=(self.prefix / "stderr.log").open("wb"),
            start_new_session=True,
            preexec_fn=_die_with_parent,
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
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGQUIT)  # graceful: finish the requests in flight
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)

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

    def replica_of(self) -> dict[str, str]:
        """Session → the replica that served its latest request."""
        return {r.session: r.upstream for r in self.routed() if r.session}


def _indent(text: str) -> str:
    return "".join(f"    {line}\n" if line else "\n" for line in text.splitlines())


_TEMP_DIRS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def _temp_paths(prefix: Path) -> str:
    """nginx's temporary files in the router's own directory (the compiled-in defaults are
    system paths a non-root user may not write)."""
    return "".join(f"    {n}_temp_path {prefix / n};\n" for n in _TEMP_DIRS)
