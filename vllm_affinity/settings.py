"""Server-side settings, from ``VLLM_AFFINITY_*`` environment variables (they reach every vLLM
process, which command-line flags of the plugin would not)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .core.session_headers import DEFAULT_SESSION_HEADERS, parse_header_list

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class Settings:
    #: ``False`` refuses ``cache_sharing: true``: every session keeps its own salted prefix cache.
    #: Sharing identical prefixes across sessions lets one tenant learn, from timing, whether
    #: another already sent the same prefix; deployments with mutually distrustful tenants
    #: should refuse it.
    allow_cache_sharing: bool = True
    #: Seconds between refreshes of the segment gauges on /metrics.
    stats_interval: float = 2.0
    #: Release a session's diverging blocks on every request of a known session, hinted or not
    #: (for clients that cannot send ``X-KV-Release``). Off by default: a session that branches
    #: (parallel samples, retries from an earlier turn, sub-agents sharing one id) would release
    #: the blocks of a branch it is about to continue.
    release_on_divergence: bool = False
    #: Sessions each engine tracks (least recently active out first). Memory: about 16 bytes per
    #: block of each tracked session's latest request, plus a counter per cached block.
    max_sessions: int = 100_000
    #: Largest ``/release_kv_cache`` body accepted; larger ones get 413.
    max_body_bytes: int = 32 * 1024 * 1024
    #: On a data-parallel server, send every request of a session to one engine core (by a
    #: stable hash of the session), so its prefix cache and its releases stay together. Off:
    #: vLLM's balancer picks the least-loaded engine per request. A client's or router's
    #: ``X-data-parallel-rank`` header wins either way.
    dp_session_affinity: bool = True
    #: Move the blocks of a session whose call ended waiting on its user (``finish_reason``
    #: ``stop``, or ``X-KV-Next-Use`` at least ``idle_after`` seconds) to the IDLE segment,
    #: reused after released blocks and before those of live sessions.
    lifecycle: bool = True
    #: Seconds of an ``X-KV-Next-Use`` hint from which the session counts as idle.
    idle_after: float = 10.0
    #: Act on a session's idle signal only when its last absence outlasted LRU's reach
    #: (``core/idle_guard.py``): an agent whose driver answers its ``end_turn`` in seconds
    #: keeps its cache. Off: every idle signal is acted on.
    idle_guard: bool = True
    #: Where LRU would evict a block one session alone holds, evict instead from the session
    #: predicted back last (``core/returns.py``): closer to Belady at tight pools. ``None``
    #: (``auto``): on for a model with one KV-cache group, off for a hybrid model (a replay
    #: there computed one block more than vanilla: docs/decisions.md) and where a CPU offload
    #: tier backs the GPU pool (``PoolAffinity.attach_tier``).
    predict_return: bool | None = None
    #: Headers that name a request's session, first found wins (see
    #: ``core/session_headers.py``); a ``session_id`` in the body comes first either way.
    session_headers: tuple[str, ...] = DEFAULT_SESSION_HEADERS
    #: What a subagent's call that ends its task (``stop``: a session that named a parent)
    #: does with its blocks: ``release`` them as dead, or ``idle`` them as any session's.
    child_end: str = "release"
    #: Largest share of the pool a parent waiting on running subagents may keep in the
    #: PROTECTED segment (reused after every other cached block); 0, the default, turns
    #: protection off: on the replayed Claude Code trace it made the plugin compute 23% more
    #: prompt tokens than vanilla (subagents run many calls; their caches are worth more than
    #: the one call their parent makes when they are done). See docs/coding-agents.md.
    protect_share: float = 0.0
    #: Which sessions' compactions the server tells from their own requests
    #: (``core/compaction.py``): ``agents``, requests that carry a coding agent's own headers
    #: or ``prompt_cache_key`` (the hook's and vLLM's ``X-Session-ID`` alone do not: the hook
    #: releases exactly); ``all``, every session; ``off``.
    infer_compaction: str = "agents"
    #: A header a trusted gateway sets to name the request's tenant: sessions are scoped to it
    #: (``core/tenants.py``); empty: scoped to the API key, when the server has keys.
    tenant_header: str = ""
    #: Sessions for requests that name none (aider, mini-swe-agent, Qwen Code by default, chat
    #: UIs), told by the answers each window carries back (``core/answer_chains.py``):
    #: ``answers``, the default; ``off`` serves them as vanilla vLLM does.
    implicit_sessions: str = "answers"
    #: On a model with a sliding-window or Mamba group, keep that state at the end of each
    #: request's instructions (``checkpoints.py``); off: vLLM's own junctions only.
    checkpoints: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        sharing = env.get("VLLM_AFFINITY_CACHE_SHARING", "allow").strip().lower()
        if sharing not in ("allow", "refuse"):
            raise ValueError(
                f"VLLM_AFFINITY_CACHE_SHARING={sharing!r}: expected 'allow' or 'refuse'"
            )
        return cls(
            allow_cache_sharing=sharing == "allow",
            stats_interval=_seconds(env, "VLLM_AFFINITY_STATS_INTERVAL", 2.0),
            lifecycle=_flag(env, "VLLM_AFFINITY_LIFECYCLE", True),
            idle_after=_seconds(env, "VLLM_AFFINITY_IDLE_AFTER_S", 10.0),
            idle_guard=_flag(env, "VLLM_AFFINITY_IDLE_GUARD", True),
            predict_return=_auto_flag(env, "VLLM_AFFINITY_PREDICT_RETURN"),
            release_on_divergence=_flag(env, "VLLM_AFFINITY_RELEASE_ON_DIVERGENCE", False),
            dp_session_affinity=_flag(env, "VLLM_AFFINITY_DP_SESSION_AFFINITY", True),
            max_sessions=_positive_int(env, "VLLM_AFFINITY_MAX_SESSIONS", 100_000),
            max_body_bytes=_positive_int(env, "VLLM_AFFINITY_MAX_BODY_BYTES", 32 * 1024 * 1024),
            session_headers=session_headers_from_env(env),
            child_end=_choice(env, "VLLM_AFFINITY_CHILD_END", ("release", "idle"), "release"),
            protect_share=_share(env, "VLLM_AFFINITY_PROTECT_SHARE", 0.0),
            tenant_header=_header_name(env, "VLLM_AFFINITY_TENANT_HEADER"),
            implicit_sessions=_choice(
                env, "VLLM_AFFINITY_IMPLICIT_SESSIONS", ("answers", "off"), "answers"
            ),
            infer_compaction=_choice(
                env, "VLLM_AFFINITY_INFER_COMPACTION", ("agents", "all", "off"), "agents"
            ),
            checkpoints=_flag(env, "VLLM_AFFINITY_CHECKPOINTS", True),
        )


def session_headers_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """``VLLM_AFFINITY_SESSION_HEADERS``, or the default list: the server reads it, and the
    router configuration it prints (``nginx.py``), so that the two never drift apart."""
    return _header_list(os.environ if environ is None else environ, SESSION_HEADERS_SETTING)


SESSION_HEADERS_SETTING = "VLLM_AFFINITY_SESSION_HEADERS"


def _header_name(env: Mapping[str, str], name: str) -> str:
    raw = env.get(name, "").strip()
    if not raw:
        return ""
    try:
        (header,) = parse_header_list(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r}: expected one header name ({exc})") from None
    return header


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    value = env.get(name, default).strip().lower()
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def _header_list(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    raw = env.get(name)
    if raw is None:
        return DEFAULT_SESSION_HEADERS
    try:
        return parse_header_list(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r}: {exc}") from None


def _auto_flag(env: Mapping[str, str], name: str) -> bool | None:
    """``auto`` (or unset): ``None``, decided where the model is known; else a flag."""
    raw = env.get(name)
    if raw is None or raw.strip().lower() == "auto":
        return None
    if raw.strip().lower() not in _TRUE + _FALSE:
        raise ValueError(f"{name}={raw!r}: expected auto, true or false")
    return _flag(env, name, False)


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"{name}={raw!r}: expected true or false")
    return value in _TRUE


def _number(
    env: Mapping[str, str], name: str, default: float, expected: str, high: float = math.inf
) -> float:
    """A finite number from 0 to ``high``; ``expected`` says what it is in the error."""
    raw = env.get(name, str(default))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or not 0 <= value <= high:
        raise ValueError(f"{name}={raw!r}: expected {expected}")
    return value


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    return _number(env, name, default, "seconds (a finite, non-negative number)")


def _share(env: Mapping[str, str], name: str, default: float) -> float:
    return _number(env, name, default, "a share of the pool between 0 and 1", high=1.0)


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={raw!r}: expected a positive integer")
    return value
