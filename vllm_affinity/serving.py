"""vLLM adapter, API-server side: thin wrapt patches of vLLM's chat, completion, Responses (and,
through chat, Messages) entry methods. Before vLLM handles a parsed request they apply the
``cache_sharing`` body field, the agents' own session headers and a subagent's parent, the
caller's principal (``core/tenants.py``), the ``X-KV-Release`` in-request hint (it rides to the
engine core in ``sampling_params.extra_args``: no render) and openJiuwen's ``agent_hint``; after
the call they watch how it ended (``lifecycle.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry import propagate, trace

from jiuwen_kv_protocol.headers import RELEASE_SPAN, SESSION_ATTRIBUTE, SESSION_HEADER
from jiuwen_kv_protocol.hint import HEADER as HINT_HEADER

from .agent_hint import AgentHintError, answer_management, read_agent_hint
from .agent_windows import apply_compaction_rule, prompt_cache_key, qwen_code_metadata
from .core import HintError, ReleaseHint, engine_rank
from .core.lifecycle import HEADER as NEXT_USE_HEADER
from .core.lifecycle import NextUseError, parse_next_use
from .core.session_headers import parent_from_headers, session_from_headers
from .core.tenants import UNSCOPED, scoped
from .lifecycle import watched
from .pool_affinity import HEAD_KEY, HINT_KEY, PARENT_KEY, PRINCIPAL_KEY, RESERVED_KEYS
from .release_service import ReleaseService, service_of
from .settings import Settings

tracer = trace.get_tracer("vllm_affinity")


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


_wrapped_serving = False


def wrap_serving(settings: Settings, count_hint: Callable[[str], None]) -> None:
    """Thin wrapt patches of vLLM's chat, completion and Responses entry methods (API server
    process only):
    apply ``cache_sharing`` and the in-request hint to the parsed request before vLLM handles it.
    A malformed hint is answered with vLLM's own 400 error. Idempotent."""
    global _wrapped_serving
    if _wrapped_serving:
        return
    import wrapt
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    def before(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        request = args[0] if args else kwargs["request"]
        strip_reserved_args(request)
        return serve(wrapped, instance, args, kwargs)

    def serve(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        request = args[0] if args else kwargs["request"]
        raw_request = args[1] if len(args) > 1 else kwargs.get("raw_request")
        apply_cache_sharing(request, settings.allow_cache_sharing)
        apply_session_headers(request, raw_request, settings.session_headers)
        service = getattr(raw_request.app.state, "jiuwen_affinity", None) if raw_request else None
        session = owner = verdict = None
        if service is not None:
            principal = service.principal_of(raw_request)
            apply_principal(request, principal)
            named = session_key(instance, request, raw_request)
            owner = scoped(principal, named) if named else None
            if named:
                named, verdict = apply_compaction_rule(
                    service.compaction,
                    request,
                    raw_request.headers,
                    principal,
                    named,
                    settings.infer_compaction,
                )
                if verdict is not None:
                    service.metrics.count_window(verdict)
            session = scoped(principal, named) if named else None
        next_use = None
        if settings.lifecycle and session:  # validated before anything is applied or counted
            try:
                next_use = read_next_use(raw_request)
            except NextUseError as exc:
                service.metrics.count_lifecycle("invalid")
                return _hint_error(instance, str(exc))
        if settings.dp_session_affinity and owner:  # a side branch on its session's engine
            pin_session_to_engine(service, owner, raw_request)
        try:
            hint = apply_release_hint(request, raw_request)
        except HintError as exc:
            count_hint("invalid")
            return _hint_error(instance, str(exc))
        if hint is not None:
            count_hint("accepted")
            _hint_span(raw_request, hint)
        call = wrapped(*args, **kwargs)  # not started: the request may still change
        if session and settings.child_end == "release" and _names_parent(request):
            call = with_instructions(service, session, request, call)
        if settings.lifecycle and session:
            named_tool = not isinstance(getattr(request, "tool_choice", None), str | None)
            on_finish = service.idle_signals.on_finish(
                session, next_use, named_tool, side_branch=verdict == "side"
            )
            return watched(call, on_finish)
        return call

    def session_rank(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        """A rank the client or router chose (``X-data-parallel-rank``) wins; else the
        session's engine, when ``before`` pinned one."""
        rank = wrapped(*args, **kwargs)
        raw_request = args[0] if args else kwargs.get("raw_request")
        if rank is not None or raw_request is None:
            return rank
        return getattr(raw_request.state, "jiuwen_engine_rank", None)

    def before_chat(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        """openJiuwen's ``agent_hint`` first (see ``agent_hint.py``), then as ``before``."""
        request = args[0] if args else kwargs["request"]
        raw_request = args[1] if len(args) > 1 else kwargs.get("raw_request")
        strip_reserved_args(request)
        try:
            agent_hint = read_agent_hint(request)
        except AgentHintError as exc:
            service_of(raw_request).metrics.count_management("none", "invalid")
            return _hint_error(instance, str(exc))
        if agent_hint is not None and agent_hint.manage_request:
            apply_cache_sharing(request, settings.allow_cache_sharing)
            service = service_of(raw_request)
            principal = service.principal_of(raw_request)
            return answer_management(service, request, agent_hint, raw_request, principal)
        return serve(wrapped, instance, args, kwargs)

    wrapt.wrap_function_wrapper(GenerateBaseServing, "_get_data_parallel_rank", session_rank)
    wrapt.wrap_function_wrapper(OpenAIServingChat, "create_chat_completion", before_chat)
    wrapt.wrap_function_wrapper(OpenAIServingCompletion, "create_completion", before)
    wrapt.wrap_function_wrapper(OpenAIServingResponses, "create_responses", before)
    _wrapped_serving = True


def _names_parent(request: Any) -> bool:
    return PARENT_KEY in (getattr(request, "vllm_xargs", None) or {})


async def with_instructions(service: ReleaseService, session: str, request: Any, call: Any) -> Any:
    """A subagent's request tells the engine how many of its leading tokens are instructions
    (``instructions.py``), which its end keeps; then vLLM handles it."""
    tokens = await service.instructions.tokens(session, request)
    if tokens:
        request.vllm_xargs = {**(request.vllm_xargs or {}), HEAD_KEY: tokens}
    return await call


def read_next_use(raw_request: Any) -> float | None:
    """The ``X-KV-Next-Use`` seconds, if sent. Raises ``NextUseError`` for a malformed value."""
    value = raw_request.headers.get(NEXT_USE_HEADER)
    return None if value is None else parse_next_use(value)


async def _hint_error(serving: Any, message: str) -> Any:
    return serving.create_error_response(message)


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
