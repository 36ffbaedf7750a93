"""Which data-parallel engine serves a session (pure).

Each engine core of a data-parallel server has its own KV pool and prefix cache, and vLLM's
balancer picks the least-loaded engine per request: a session's next request lands on either
engine, so half its prefix is cached in the wrong place and an in-request release reaches an
engine that does not hold the session. Pinning a session to one engine keeps both together.

The hash is stable across processes (several API servers must agree; Python's ``hash`` of a
string is salted per process) and is taken modulo the engine count, which is fixed for a
server's life.
"""

from __future__ import annotations

import hashlib


def engine_rank(session: str, engines: int) -> int:
    """The data-parallel rank (0 .. engines-1) that serves ``session``."""
    if engines < 1:
        raise ValueError(f"engines={engines}: expected at least one engine")
    digest = hashlib.blake2b(session.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % engines
