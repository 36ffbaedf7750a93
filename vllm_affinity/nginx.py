"""nginx in front of several plugin replicas, routing each session to one of them.

A session's KV blocks live on the replica that served it, so all of its calls (and the hook's
releases) must reach that replica. nginx computes the session the plugin would read from a
request's headers, in the plugin's own order (``VLLM_AFFINITY_SESSION_HEADERS``; the hook's
``X-Session-ID``, Claude Code's, the Codex CLI's, opencode's: ``core/session_headers.py``), as a
chain of ``map`` blocks into ``$jiuwen_session``, and hashes it consistently (ketama): when a
replica fails, only its sessions move, each to the next replica on the ring, and they come back
when it does. Requests that name no session in a header (health checks, the hook's capability
probe) get an empty key, which nginx spreads round-robin. A session named only in the body
(``prompt_cache_key``, a body ``session_id``) is beyond nginx: such agents need a header.

    print(nginx_config(["127.0.0.1:8001", "127.0.0.1:8002"], listen=8000))

(``vllm_affinity.testing.NginxRouter`` runs it in front of test servers.)

``python -m vllm_affinity nginx-config --upstream HOST:PORT ... --listen PORT`` prints the same
configuration (for the headers of ``VLLM_AFFINITY_SESSION_HEADERS`` when it is set, the
server's setting). nginx itself comes from the system (Debian: ``apt-get install nginx``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from jiuwen_kv_protocol.headers import CLAUDE_CODE_AGENT_HEADER, CLAUDE_CODE_SESSION_HEADER

from .core.session_headers import DEFAULT_SESSION_HEADERS

Policy = Literal["session", "round_robin"]

#: One JSON object per request: which replica served which session, and whether the request
#: carried an in-request release. Tests and benchmarks read it; a deployment may drop it.
LOG_FORMAT = (
    'log_format fleet escape=json \'{"session":"$jiuwen_session",'
    '"upstream":"$upstream_addr","status":"$status","method":"$request_method",'
    '"uri":"$uri","release":"$http_x_kv_release"}\';'
)


#: The variable the chain of ``map`` blocks computes: the session the plugin reads.
SESSION_VARIABLE = "$jiuwen_session"


def header_variable(name: str) -> str:
    """nginx's variable for a request header: ``X-Session-ID`` → ``$http_x_session_id``."""
    return "$http_" + name.lower().replace("-", "_")


def session_maps(session_headers: Sequence[str] = DEFAULT_SESSION_HEADERS) -> str:
    """``map`` blocks that set ``$jiuwen_session`` to the first of ``session_headers`` a
    request carries, as the plugin reads it (``session_from_headers``): a Claude Code
    subagent's agent id appended to its session; empty when none is there."""
    if not session_headers:
        raise ValueError("give at least one session header")
    agent = "$jiuwen_claude_code_agent"
    blocks = []
    if CLAUDE_CODE_SESSION_HEADER.lower() in (n.lower() for n in session_headers):
        blocks += [
            f"map {header_variable(CLAUDE_CODE_AGENT_HEADER)} {agent} {{",
            '    "" "";',
            f"    default /{header_variable(CLAUDE_CODE_AGENT_HEADER)};",
            "}",
        ]
    for index, name in enumerate(session_headers):
        here = SESSION_VARIABLE if index == 0 else f"{SESSION_VARIABLE}_{index}"
        after = f"{SESSION_VARIABLE}_{index + 1}" if index + 1 < len(session_headers) else '""'
        value = header_variable(name)
        if name.lower() == CLAUDE_CODE_SESSION_HEADER.lower():
            value += agent  # a subagent is a session of its own, as on the server
        blocks += [
            f"map {header_variable(name)} {here} {{",  # "": the header is absent or empty
            f'    "" {after};',
            f"    default {value};",
            "}",
        ]
    return "\n".join(blocks)


def _upstream(upstreams: Sequence[str], policy: Policy) -> str:
    if not upstreams:
        raise ValueError("give at least one upstream replica (host:port)")
    balance = (
        # Ketama consistent hashing: adding or losing a replica moves only its own sessions.
        [f"    hash {SESSION_VARIABLE} consistent;"] if policy == "session" else []
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
    session_headers: Sequence[str] = DEFAULT_SESSION_HEADERS,
) -> str:
    """The ``http`` block's content: the session maps, the upstream group and a server that
    proxies everything to it, streaming (no buffering, for time to first token), with long
    read timeouts (a long prefill on a busy replica)."""
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
    maps = session_maps(session_headers)
    return "\n".join([maps, _upstream(upstreams, policy), *log, *server]) + "\n"


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
