"""nginx in front of several plugin replicas, routing each session to one of them.

A session's KV blocks live on the replica that served it, so its chat calls and its releases must
reach that replica. The hook puts the session in the ``X-Session-ID`` header of both, and nginx's
consistent hash on that header (``hash $http_x_session_id consistent``, ketama) sends them to the
same replica; when a replica fails, only its sessions move, each to the next replica on the ring,
and they come back when it does. Requests without the header (health checks, the hook's
capability probe) are spread round-robin.

    print(nginx_config(["127.0.0.1:8001", "127.0.0.1:8002"], listen=8000))

(``vllm_affinity.testing.NginxRouter`` runs it in front of test servers.)

``python -m vllm_affinity nginx-config --upstream HOST:PORT ... --listen PORT`` prints the same
configuration. nginx itself comes from the system (Debian: ``apt-get install nginx``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

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


def indent(text: str) -> str:
    return "".join(f"    {line}\n" if line else "\n" for line in text.splitlines())


TEMP_DIRS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def temp_paths(prefix: Path) -> str:
    """nginx's temporary files in the router's own directory (the compiled-in defaults are
    system paths a non-root user may not write)."""
    return "".join(f"    {n}_temp_path {prefix / n};\n" for n in TEMP_DIRS)
