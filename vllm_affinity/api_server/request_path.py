"""vLLM adapter, API-server side: the request's path, as named steps in order.

Before vLLM handles a parsed chat, completion or Responses request, ``serving.py`` runs it
through ``STEPS``, each a function of one ``RequestPath`` (what the earlier steps read and
decided), each testable alone:

1. ``cache_sharing``: the ``cache_sharing`` body field (the salt dropped, the session kept);
2. ``session_source``: the agents' own session headers, Qwen Code's metadata,
   ``prompt_cache_key``, and a subagent's parent;
3. ``principal``: the caller's tenant (``core/tenants.py``);
4. ``implicit_session``: a request that names no session gets the chain of the answers it
   carries back (``implicit_sessions.py``, when on);
5. ``session``: the key the engine binds under, judged by the compaction rule (a side branch's
   key, a rewrite or retry for the engine: ``agent_windows.py``);
6. ``next_use``: ``X-KV-Next-Use``, validated (a malformed one is refused), and carried to
   the engine core for the predicted-return picker when that is on;
7. ``engine``: a data-parallel server's engine for the session;
8. ``release_hint``: ``X-KV-Release``, validated and carried to the engine core;
9. ``checkpoint``: on a hybrid model, where the request's instructions end, for the engine to
   keep its sliding-window and Mamba state there (``checkpoints.py``).

A step refuses a request by raising ``Refusal`` (answered with vLLM's own 400, counted); a
step may be a coroutine function (``session`` asks the engine that serves the session when the
server runs several API servers). After vLLM's call, ``finish`` adds a subagent's or a side
request's instruction length, the record of an implicit session's answer and the lifecycle
watch. A new session source or rule is a new
step in the list.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import propagate, trace

from jiuwen_kv_protocol.headers import RELEASE_SPAN, SESSION_ATTRIBUTE, SESSION_HEADER
from jiuwen_kv_protocol.hint import HEADER as HINT_HEADER

from ..core import HintError, ReleaseHint, engine_rank
from ..core.answer_chains import Outcome
from ..core.compaction import BRANCH_SEPARATOR, Verdict, Window
from ..core.lifecycle import HEADER as NEXT_USE_HEADER
from ..core.lifecycle import NextUseError, parse_next_use
from ..core.request_keys import (
    CHECKPOINT_KEY,
    HEAD_KEY,
    HINT_KEY,
    NEXT_USE_KEY,
    PARENT_KEY,
    PRINCIPAL_KEY,
    RESERVED_KEYS,
)
from ..core.session_headers import parent_from_headers, session_from_headers
from ..core.tenants import UNSCOPED, scoped
from ..settings import Settings
from .agent_windows import (
    apply_verdict,
    prompt_cache_key,
    qwen_code_metadata,
    window_of,
    window_to_judge,
)
from .implicit_sessions import chain_window_of, with_answer
from .instructions import instructions_key
from .lifecycle import watched
from .release_service import ReleaseService

tracer = trace.get_tracer("vllm_affinity")
logger = logging.getLogger("vllm_affinity")


class Refusal(Exception):
    """A step refuses the request: vLLM's 400 with this message; ``count`` notes it."""

    def __init__(self, message: str, count: Callable[[], None]) -> None:
        super().__init__(message)
        self.count = count


@dataclass(slots=True)
class RequestPath:
    """One request on its way to vLLM: its parts, and what each step read or decided."""

    settings: Settings
    serving: Any  # vLLM's serving instance (its ``_get_session_id``, its error answers)
    request: Any
    raw_request: Any
    service: ReleaseService | None  # None: the plugin's routes are not attached
    count_hint: Callable[[str], None]
    principal: str = UNSCOPED
    owner: str | None = None  # the session, scoped, before any branch key
    session: str | None = None  # the key the engine binds under, scoped
    verdict: Verdict | None = None  # the compaction rule's, when it applied
    window: Window | None = None  # the window the rule judged
    chain: str | None = None  # the implicit session of a request that named none
    chain_outcome: Outcome | None = None  # how its window relates to the chain
    next_use: float | None = None


#: A step: a function of the path, or a coroutine function (``session`` may ask an engine).
Step = Callable[[RequestPath], Awaitable[None] | None]


def cache_sharing(path: RequestPath) -> None:
    apply_cache_sharing(path.request, path.settings.allow_cache_sharing)


def session_source(path: RequestPath) -> None:
    apply_session_headers(path.request, path.raw_request, path.settings.session_headers)


def principal(path: RequestPath) -> None:
    if path.service is not None:
        path.principal = path.service.principal_of(path.raw_request)
        apply_principal(path.request, path.principal)


async def implicit_session(path: RequestPath) -> None:
    """A chat request that names no session (no header, body field, salt or metadata) gets
    the chain of the answers it carries back, as its ``session_id``. A table that cannot be
    asked (its engine is gone) leaves the request as it is."""
    service = path.service
    if service is None or service.answers is None:
        return
    if not hasattr(path.request, "session_id") or path.request.session_id is not None:
        return
    if session_key(path.serving, path.request, path.raw_request):
        return
    window = chain_window_of(path.request)
    if window is None:
        return
    try:
        chain, outcome = await service.answers.chains.chain_of(path.principal, window)
    except Exception as exc:  # the engine is dying: the request goes on as vanilla's
        logger.warning("vllm_affinity: could not link a request to its session: %s", exc)
        return
    service.metrics.count_chain(outcome)
    path.chain, path.chain_outcome = chain, outcome
    path.request.session_id = chain


async def session(path: RequestPath) -> None:
    """The engine's key for the request, after the compaction rule's verdict (judged where
    every request of the session is seen: ``agent_windows.py``). A rule that cannot be asked
    (its engine is gone) leaves the request as it is."""
    if path.service is None:
        return
    named = session_key(path.serving, path.request, path.raw_request)
    if not named:
        return
    path.owner = scoped(path.principal, named)
    service = path.service
    if path.chain_outcome == "side":  # told by the chain table: the rule is not asked
        path.verdict, path.window = "side", window_of(path.request)
        service.metrics.count_window("side")
        path.session = scoped(path.principal, apply_verdict(path.request, named, "side"))
        return
    scope = "all" if path.chain is not None else path.settings.infer_compaction
    judged = window_to_judge(path.request, path.raw_request.headers, named, scope)
    if judged is not None:
        path.window = judged[0]
        try:
            path.verdict = await service.windows.classify(path.owner, *judged)
        except Exception as exc:  # the engine is dying: the request goes on unjudged
            logger.warning("vllm_affinity: could not judge a window of %r: %s", named, exc)
        else:
            service.metrics.count_window(path.verdict)
            named = apply_verdict(path.request, named, path.verdict)
    path.session = scoped(path.principal, named)


def next_use(path: RequestPath) -> None:
    if not (path.settings.lifecycle and path.session):
        return
    try:
        path.next_use = read_next_use(path.raw_request)
    except NextUseError as exc:
        service = path.service
        assert service is not None
        raise Refusal(str(exc), lambda: service.metrics.count_lifecycle("invalid")) from None
    if path.next_use is not None and path.settings.predict_return is not False:  # its due date
        path.request.vllm_xargs = {**(path.request.vllm_xargs or {}), NEXT_USE_KEY: path.next_use}


def engine(path: RequestPath) -> None:
    if path.settings.dp_session_affinity and path.owner and path.service is not None:
        pin_session_to_engine(path.service, path.owner, path.raw_request)  # a side branch too


def release_hint(path: RequestPath) -> None:
    try:
        hint = apply_release_hint(path.request, path.raw_request)
    except HintError as exc:
        raise Refusal(str(exc), lambda: path.count_hint("invalid")) from None
    if hint is not None:
        path.count_hint("accepted")
        _hint_span(path.raw_request, hint)


async def checkpoint(path: RequestPath) -> None:
    """A chat or Responses request to a model with a sliding-window or Mamba group tells the
    engine how many of its leading tokens are instructions (``instructions.py``), session or
    not: the engine keeps those groups' state there (``checkpoints.py``). A render that fails
    leaves the request as vanilla's."""
    service = path.service
    if service is None or not path.settings.checkpoints or not hasattr(path.request, "vllm_xargs"):
        return
    if not await service.sparse_groups():  # a one-group model: nothing to keep, nothing paid
        return
    key = instructions_key(path.request)
    if key is None:
        return
    tokens = await service.instructions.tokens(key, path.request)
    if tokens:
        path.request.vllm_xargs = {**(path.request.vllm_xargs or {}), CHECKPOINT_KEY: tokens}


#: The request's path, in order.
STEPS: tuple[Step, ...] = (
    cache_sharing,
    session_source,
    principal,
    implicit_session,
    session,
    next_use,
    engine,
    release_hint,
    checkpoint,
)


async def run_steps(path: RequestPath) -> None:
    """Each of ``STEPS`` in order (a ``Refusal`` stops the path)."""
    for step in STEPS:
        done = step(path)
        if inspect.isawaitable(done):
            await done


def finish(path: RequestPath, call: Any) -> Any:
    """After vLLM's call is made (not started): a subagent's, a side request's or a rewrite's
    instruction length, and the lifecycle watch of how the call ends."""
    settings, service, session_ = path.settings, path.service, path.session
    if not session_ or service is None:
        return call
    if settings.child_end == "release" and _names_parent(path.request):
        call = with_instructions(service, session_, path.request, call)
    elif path.verdict == "side" and path.window is not None:
        key = side_instructions_key(session_, path.window)
        call = with_instructions(service, key, path.request, call)
    elif path.verdict == "rewrite":  # the side branch keeps what the new window carries past them
        key = instructions_key(path.request)
        if key is not None:
            call = with_instructions(service, key, path.request, call)
    if path.chain is not None and service.answers:
        main = path.chain_outcome != "side"
        on_answer = service.answers.on_answer(path.principal, path.chain, main)
        call = with_answer(call, on_answer)
    if settings.lifecycle:
        named_tool = not isinstance(getattr(path.request, "tool_choice", None), str | None)
        on_finish = service.idle_signals.on_finish(
            session_, path.next_use, named_tool, side_branch=path.verdict == "side"
        )
        return watched(call, on_finish)
    return call


def apply_cache_sharing(request: Any, allow_sharing: bool) -> None:
    """``cache_sharing: true`` on a chat/completion request (kept by vLLM among the request's
    extra fields): drop ``cache_salt`` so identical prefixes are shared across sessions, and keep
    the session as ``session_id`` (block binding stays per session). ``cache_sharing`` itself
    is removed either way. When sharing is refused by the server settings, the salt is kept."""
    extra = request.model_extra
    if not extra or "cache_sharing" not in extra:
        return
    sharing = extra.pop("cache_sharing")
    salt = request.cache_salt
    if sharing is True and allow_sharing and isinstance(salt, str) and salt:
        if not request.session_id:
            request.session_id = salt
        request.cache_salt = None


def apply_session_headers(request: Any, raw_request: Any, names: tuple[str, ...]) -> None:
    """A request that names no session in its body gets the one its headers name (the agents'
    own session headers: ``core/session_headers.py``), as vLLM's own ``session_id``; a
    subagent's parent goes to the engine in ``vllm_xargs`` (unless ``agent_hint`` named it)."""
    headers = getattr(raw_request, "headers", None)
    if headers is None or not hasattr(request, "session_id"):
        return  # a request kind without session_id is left alone
    if request.session_id is None:  # a body session_id wins
        session = session_from_headers(headers, names) or qwen_code_session(request)
        session = session or prompt_cache_key(request)
        if session is not None:
            request.session_id = session
    parent = parent_from_headers(headers, names)
    if (
        parent is not None
        and hasattr(request, "vllm_xargs")
        and (PARENT_KEY not in (request.vllm_xargs or {}))
    ):
        request.vllm_xargs = {**(request.vllm_xargs or {}), PARENT_KEY: parent}


def qwen_code_session(request: Any) -> str | None:
    """Qwen Code's ``metadata.sessionId`` (``agent_windows.qwen_code_metadata``)."""
    meta = qwen_code_metadata(request)
    return meta[0] if meta is not None else None


def strip_reserved_args(request: Any) -> None:
    """A client's own ``vllm_xargs`` may not carry the keys only the plugin sets (a principal,
    a parent, an in-request release): they would let it act as another tenant."""
    xargs = getattr(request, "vllm_xargs", None)
    if xargs and any(key in xargs for key in RESERVED_KEYS):
        request.vllm_xargs = {k: v for k, v in xargs.items() if k not in RESERVED_KEYS}


def apply_principal(request: Any, principal: str) -> None:
    """The engine scopes the request's session to ``principal`` (``core/tenants.py``)."""
    if principal != UNSCOPED and hasattr(request, "vllm_xargs"):
        request.vllm_xargs = {**(request.vllm_xargs or {}), PRINCIPAL_KEY: principal}


def session_key(serving: Any, request: Any, raw_request: Any) -> str | None:
    """The key the engine binds a request's blocks under: vLLM's own session id (the body's
    ``session_id``, ``X-Session-ID``, ``vllm_xargs``), else the cache salt."""
    return serving._get_session_id(request, raw_request) or getattr(request, "cache_salt", None)


def pin_session_to_engine(service: ReleaseService, session: str, raw_request: Any) -> None:
    """On a data-parallel server, note the engine that serves ``session`` for
    ``_get_data_parallel_rank``: the session's cache and its releases stay on one engine (see
    ``core/placement.py``)."""
    if service.data_parallel_size > 1:
        rank = engine_rank(session, service.data_parallel_size)
        raw_request.state.jiuwen_engine_rank = rank


def apply_release_hint(request: Any, raw_request: Any) -> ReleaseHint | None:
    """Carry a valid ``X-KV-Release`` hint to the engine core in ``vllm_xargs`` (which vLLM
    passes on as ``sampling_params.extra_args``). Raises ``HintError`` for a malformed value."""
    headers = getattr(raw_request, "headers", None)
    value = headers.get(HINT_HEADER) if headers is not None else None
    if value is None:
        return None
    hint = ReleaseHint.parse(value)
    request.vllm_xargs = {**(request.vllm_xargs or {}), HINT_KEY: hint.header_value()}
    return hint


def _names_parent(request: Any) -> bool:
    return PARENT_KEY in (getattr(request, "vllm_xargs", None) or {})


def side_instructions_key(session: str, window: Window) -> str:
    """The instruction lengths' cache key of a side request: one session's side branch takes
    requests of several prompts (a title, a memory extractor, a compaction), each its own."""
    head = 0
    while head < len(window.messages) and window.is_instruction(head):
        head += 1
    return f"{session}{BRANCH_SEPARATOR}{hash((window.has_tools, *window.messages[:head]))}"


async def with_instructions(service: ReleaseService, key: str, request: Any, call: Any) -> Any:
    """A subagent's request (or a side request) tells the engine how many of its leading
    tokens are instructions (``instructions.py``, cached under ``key``), which its end (or a
    rewrite of its main thread) keeps; then vLLM handles it. On a hybrid model the
    ``checkpoint`` step rendered them already."""
    known = (request.vllm_xargs or {}).get(CHECKPOINT_KEY)
    tokens = known or await service.instructions.tokens(key, request)
    if tokens:
        request.vllm_xargs = {**(request.vllm_xargs or {}), HEAD_KEY: tokens}
    return await call


def read_next_use(raw_request: Any) -> float | None:
    """The ``X-KV-Next-Use`` seconds, if sent. Raises ``NextUseError`` for a malformed value."""
    value = raw_request.headers.get(NEXT_USE_HEADER)
    return None if value is None else parse_next_use(value)


def _hint_span(raw_request: Any, hint: ReleaseHint) -> None:
    """A short span per in-request release, joined to the caller's trace when it sent one; the
    blocks it released are counted in the engine (``/affinity/stats``, ``/metrics``)."""
    headers = getattr(raw_request, "headers", None)
    ctx = propagate.extract(dict(headers)) if headers is not None else None
    attributes: dict[str, Any] = {
        "jiuwen.release.mode": "in_request",
        "jiuwen.release.protocol": "x_kv_release",
        "jiuwen.release.messages_released_index": hint.messages_released_index,
    }
    if hint.tools_released_index is not None:
        attributes["jiuwen.release.tools_released_index"] = hint.tools_released_index
    session = headers.get(SESSION_HEADER) if headers is not None else None
    if session:
        attributes[SESSION_ATTRIBUTE] = session
    span = tracer.start_span(
        RELEASE_SPAN, context=ctx, kind=trace.SpanKind.SERVER, attributes=attributes
    )
    span.end()
