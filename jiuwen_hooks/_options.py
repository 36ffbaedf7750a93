"""Options of ``install()``: keyword arguments, falling back to ``JIUWEN_*`` environment variables.

Bad values raise ``ValueError`` at install time, naming the option or variable: misconfiguration
is loud once at start-up, and never an exception during a model call.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from jiuwen_kv_protocol.headers import RELEASE_PATH

SessionResolver = Callable[[dict[str, Any]], str | None]
DispatchMode = Literal["inline", "background"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Options:
    """Every option, its environment variable (``JIUWEN_`` + upper-case name) and its default."""

    enabled: bool = True
    #: Full URL of the release endpoint; default: the openai client's base URL without ``/v1``
    #: followed by ``release_path``.
    release_url: str | None = None
    release_path: str = RELEASE_PATH
    #: Seconds for the whole release request (connect + response).
    timeout: float = 1.0
    #: Send the session as the ``X-Session-ID`` header of tracked chat requests (no body field).
    inject_session: bool = True
    #: Also put ``cache_salt`` (and ``cache_sharing``) in tracked chat bodies, for servers of the
    #: openJiuwen 0.1.16 POST contract that bind sessions by salt. Off: strict servers answer
    #: 400 to unknown fields, and a salt splits vanilla vLLM's prefix cache per session.
    session_body: bool = False
    #: Sent as ``cache_sharing`` beside the injected ``cache_salt`` (``session_body``); ``None``
    #: sends none. Releases always say how the chat requests were hashed.
    cache_sharing: bool | None = True
    #: Carry a release on the chat request itself (``X-KV-Release``) where the engine advertises
    #: it: no extra round trip. Off: always ``POST /release_kv_cache``.
    in_request: bool = True
    #: Seconds what an engine advertised is trusted before it is asked again.
    capability_ttl: float = 300.0
    #: Seconds for the capability probe. It runs on the hook's background thread, never on the
    #: agent's path, so a busy server gets longer for it than for a release the agent may wait for.
    probe_timeout: float = 5.0
    min_released_messages: int = 1
    ignore_trailing_messages: int = 0
    max_sessions: int = 10_000
    session_ttl: float = 3600.0
    dispatch: DispatchMode = "inline"
    #: Seconds an endpoint that answered 404/405 is left alone.
    unsupported_cooldown: float = 300.0
    #: Seconds an endpoint whose release timed out or refused the connection is left alone (the
    #: agent waits for ``timeout`` at most once per cool-down).
    failure_cooldown: float = 15.0
    #: At most one warning per kind of failure per this many seconds.
    warning_interval: float = 60.0
    compressors: tuple[str, ...] = ()
    session_resolver: SessionResolver | None = field(default=None, compare=False)
    #: Anthropic Messages calls with no other session source take ``metadata.user_id`` as their
    #: session (Claude-Code-style agents put their session id there). Off by default: in most
    #: applications it names a user, whose conversations are many sessions.
    session_from_user_id: bool = False
    tracer_provider: Any = field(default=None, compare=False)
    meter_provider: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        checks = {
            "timeout": self.timeout > 0,
            "probe_timeout": self.probe_timeout > 0,
            "min_released_messages": self.min_released_messages >= 0,
            "ignore_trailing_messages": self.ignore_trailing_messages >= 0,
            "max_sessions": self.max_sessions >= 1,
            "session_ttl": self.session_ttl > 0,
            "unsupported_cooldown": self.unsupported_cooldown >= 0,
            "failure_cooldown": self.failure_cooldown >= 0,
            "capability_ttl": self.capability_ttl >= 0,
            "warning_interval": self.warning_interval >= 0,
            "dispatch": self.dispatch in ("inline", "background"),
            "release_path": self.release_path.startswith("/"),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            values = ", ".join(f"{n}={getattr(self, n)!r}" for n in bad)
            raise ValueError(f"jiuwen_hooks: invalid option value(s): {values}")

    @classmethod
    def resolve(
        cls, overrides: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> Options:
        """Keyword arguments win over environment variables, which win over defaults."""
        environ = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise TypeError(f"jiuwen_hooks.install() got unknown option(s): {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for name, f in known.items():
            if name in overrides:
                values[name] = overrides[name]
            elif f.compare and (raw := environ.get(env_name(name))) is not None:
                values[name] = _parse(name, raw, cls.__dataclass_fields__[name].default)
        if isinstance(values.get("compressors"), str | Sequence):
            values["compressors"] = _as_tuple(values["compressors"])
        return cls(**values)


def env_name(option: str) -> str:
    return "JIUWEN_" + option.upper()


def _as_tuple(value: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(p.strip() for p in value.split(",") if p.strip())
    return tuple(value)


def _parse(name: str, raw: str, default: Any) -> Any:
    text = raw.strip()
    try:
        if name == "cache_sharing" and text.lower() in ("", "none"):
            return None
        if isinstance(default, bool) or name == "cache_sharing":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError("expected true/false")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if name == "release_url":
            return text or None
        return text
    except ValueError as exc:
        raise ValueError(
            f"jiuwen_hooks: environment variable {env_name(name)}={raw!r}: {exc}"
        ) from None
