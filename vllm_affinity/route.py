"""vLLM adapter, API-server side: ``POST /release_kv_cache``, ``GET /affinity/stats``,
``GET /affinity/capabilities``, and the request extensions read by a wrap of vLLM's serving
methods: the ``cache_sharing`` body field, the ``X-KV-Release`` in-request hint, and the
session's lifecycle after the call (``finish_reason`` or ``X-KV-Next-Use``, see
``lifecycle.py``).

A POSTed release is mapped to blocks exactly with one render: the previous window, cut at the
released indices, is rendered by vLLM's own chat renderer (same template, same tools); the engine
core (every data-parallel engine) hashes those tokens with its own block hasher and releases the
session's cached blocks from the first one whose hash differs. An in-request hint needs no render
at all: it rides to the engine core on the request (``sampling_params.extra_args``), where the
request's own block hashes are compared (see ``engine.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from opentelemetry import propagate, trace
from pydantic import ValidationError

from jiuwen_kv_protocol.headers import CAPABILITIES_PATH, RELEASE_PATH, SESSION_HEADER
from jiuwen_kv_protocol.hint import HEADER as HINT_HEADER
from jiuwen_kv_protocol.models import EngineRelease, ReleaseError, ReleaseRequest

from ._version import plugin_version
from .agent_hint import AgentHintError, answer_management, read_agent_hint
from .core import HintError, ReleaseHint, engine_rank
from .core.lifecycle import HEADER as NEXT_USE_HEADER
from .core.lifecycle import NextUseError, parse_next_use
from .core.session_headers import parent_from_headers, session_from_headers
from .core.tenants import ANONYMOUS, UNSCOPED, key_principal, scoped, tenant_principal
from .engine import HINT_KEY, PARENT_KEY, PRINCIPAL_KEY, RESERVED_KEYS
from .lifecycle import IdleSignals, watched
from .metrics import AffinityMetrics
from .settings import Settings

logger = logging.getLogger("vllm_affinity")
tracer = trace.get_tracer("vllm_affinity")
router = APIRouter()
#: The session header of the hook (and of vLLM's own session routing).

#: What ``GET /affinity/capabilities`` and every ``/release_kv_cache`` 200 answer advertise; the
#: hook switches an engine to in-request releases when it sees ``in_request_release``.
CAPABILITIES: dict[str, Any] = {
    "plugin": "vllm_affinity",
    "release_kv_cache": True,
    "in_request_release": True,
    "release_header": HINT_HEADER,
    "session_header": SESSION_HEADER,
    "agent_hint": True,
    "next_use_header": NEXT_USE_HEADER,
}


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    """vLLM's ``ErrorResponse`` JSON shape."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


@dataclass
class ReleaseService:
    """What the route needs, captured once in ``init_state``."""

    engine_client: Any
    serving_chat: Any
    serving_responses: Any
    #: vLLM's ``/v1/messages`` handler (Anthropic), when the server has one.
    serving_messages: Any
    block_size: int
    max_model_len: int
    api_tokens: list[bytes]
    settings: Settings
    metrics: AffinityMetrics
    #: Engine cores of a data-parallel server (1 without data parallelism).
    data_parallel_size: int = 1
    idle_signals: IdleSignals = field(init=False)

    def __post_init__(self) -> None:
        self.idle_signals = IdleSignals(
            self.call_engines, self.settings.idle_after, self.metrics.count_lifecycle
        )

    # -- request handling ---------------------------------------------------------------------
    async def handle(self, raw: Request) -> JSONResponse:
        if self.api_tokens and not self._authorised(raw):
            self.metrics.count_request("unauthorized")
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        ctx = propagate.extract(dict(raw.headers))
        with tracer.start_as_current_span(
            "kv_cache.release", context=ctx, kind=trace.SpanKind.SERVER
        ) as span:
            try:
                request = await self._parse(raw)
                span.set_attribute("jiuwen.release.protocol", "release_kv_cache")
                span.set_attribute("gen_ai.conversation.id", request.cache_salt)
                span.set_attribute("gen_ai.request.model", request.model)
                result = await self._release(request, self.principal_of(raw))
            except ReleaseError as exc:
                self.metrics.count_request(f"http_{exc.status}")
                span.set_attribute("error.type", str(exc.status))
                span.set_attribute("http.response.status_code", exc.status)
                return error_response(exc.status, exc.message, exc.kind)
            for key in ("block_released", "first_stale_block"):
                span.set_attribute(f"jiuwen.release.{key}", result[key])
            span.set_attribute("http.response.status_code", 200)
        self.metrics.count_request(result["status"])
        self.metrics.count_blocks(result["block_released"])
        return JSONResponse(result)

    def _authorised(self, raw: Request) -> bool:
        return self._api_key(raw) is not None

    def _api_key(self, raw: Any) -> str | None:
        """The server's API key the request authenticated with, if any."""
        scheme, _, token = raw.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        digest = hashlib.sha256(token.encode()).digest()
        return token if any(secrets.compare_digest(digest, t) for t in self.api_tokens) else None

    def principal_of(self, raw: Any) -> str:
        """Who the request comes from (``core/tenants.py``): the gateway's tenant header, else
        the API key; on a server with neither, nobody in particular (names stay unscoped)."""
        header = self.settings.tenant_header
        headers = getattr(raw, "headers", None)
        if header and headers is not None and (value := headers.get(header, "").strip()):
            return tenant_principal(value)
        if self.api_tokens and headers is not None and (key := self._api_key(raw)) is not None:
            return key_principal(key)
        return ANONYMOUS if header or self.api_tokens else UNSCOPED

    async def _read_body(self, raw: Request) -> bytes:
        """The body, refused with 413 past ``max_body_bytes`` (checked on the declared length
        and again while reading, for bodies sent without one)."""
        limit = self.settings.max_body_bytes
        declared = raw.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ReleaseError(413, f"request body over {limit} bytes", "PayloadTooLargeError")
        chunks, size = [], 0
        async for chunk in raw.stream():
            size += len(chunk)
            if size > limit:
                raise ReleaseError(413, f"request body over {limit} bytes", "PayloadTooLargeError")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _parse(self, raw: Request) -> ReleaseRequest:
        body = await self._read_body(raw)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ReleaseError(400, f"request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise ReleaseError(400, "request body is nested too deeply") from None
        try:
            return ReleaseRequest.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
            )
            raise ReleaseError(400, f"invalid release request: {problems}") from None
        except RecursionError:
            raise ReleaseError(400, "request body is nested too deeply") from None

    async def _release(self, request: ReleaseRequest, principal: str) -> dict[str, Any]:
        started = time.perf_counter()
        cut = await self.render_cut(request)
        rendered = time.perf_counter()
        salt = None if self._shares_cache(request) else request.cache_salt
        session = scoped(principal, request.cache_salt)
        results = await self.call_engines("affinity_release_prompt", session, cut, salt)
        done = time.perf_counter()
        return {
            "cache_salt": request.cache_salt,
            **self.summed(results),
            "render_ms": round((rendered - started) * 1e3, 3),
            "engine_ms": round((done - rendered) * 1e3, 3),
            "capabilities": CAPABILITIES,
        }

    @staticmethod
    def summed(results: list[dict[str, Any]]) -> dict[str, Any]:
        """One release's figures over every engine (data parallel), checked against the
        contract on the way."""
        engines = [EngineRelease.model_validate(r) for r in results]
        return EngineRelease.summed(engines).model_dump()

    def _shares_cache(self, request: ReleaseRequest) -> bool:
        """Whether the session's chat requests were hashed without their salt."""
        return bool(request.cache_sharing) and self.settings.allow_cache_sharing

    async def render_cut(self, request: ReleaseRequest) -> list[int]:
        """Tokens of the old window up to the released item (and tool), refused with 400 over
        ``max_model_len``."""
        if self.engine_client.errored:  # before any work: nothing can act on the cut
            raise ReleaseError(503, "the engine is not running", "ServiceUnavailableError")
        cut = await self._render_cut(request)
        if len(cut) > self.max_model_len:
            raise ReleaseError(
                400,
                f"the rendered window has {len(cut)} tokens, over max_model_len "
                f"{self.max_model_len}",
            )
        return cut

    async def _render_cut(self, request: ReleaseRequest) -> list[int]:
        """Tokens of the old window up to the released item (and tool): what is still valid.
        The whole window is validated (vLLM's request model, no render). Index 0 releases
        everything: only the first item is rendered, to check the model and the template
        (a template may not render an empty conversation)."""
        k, j = request.messages_released_index, request.tools_released_index
        tools = request.tools if j is None else (request.tools or [])[:j]
        if request.input is not None:
            return await self._render_responses_cut(request, k, tools)
        if request.is_messages:
            return await self._render_messages_cut(request, k, tools)
        messages = request.messages or []
        _chat_request(request, messages, request.tools)
        if k == 0:
            await self._render(request, messages[:1], None)
            return []
        return await self._render(request, messages[:k], tools or None)

    async def _render(
        self, request: ReleaseRequest, messages: list[dict[str, Any]], tools: list[Any] | None
    ) -> list[int]:
        return await self._render_chat(_chat_request(request, messages, tools))

    async def _render_chat(self, chat: Any) -> list[int]:
        try:
            rendered = await self.serving_chat.render_chat_request(chat)
        except ValueError as exc:  # template errors surface as ValueError
            raise ReleaseError(400, f"cannot render the window: {exc}") from None
        if not isinstance(rendered, tuple):  # vLLM's ErrorResponse: keep its status and text
            raise ReleaseError(rendered.error.code, rendered.error.message, rendered.error.type)
        _, engine_inputs = rendered
        return self._token_ids(engine_inputs[0])

    async def _render_responses_cut(
        self, request: ReleaseRequest, k: int, tools: list[Any] | None
    ) -> list[int]:
        """As vLLM's Responses endpoint renders: ``instructions`` (window item 0, when given)
        as the system message, then the ``input`` items before the released one."""
        if self.serving_responses is None:
            raise ReleaseError(
                400, "this server does not serve the Responses API", "NotImplementedError"
            )
        items = request.input or []
        offset = 1 if request.instructions else 0
        _responses_request(request, items, request.instructions, request.tools)
        if k == 0:
            await self._render_responses(request, items[:1], None, None)
            return []
        return await self._render_responses(
            request, items[: k - offset], request.instructions, tools or None
        )

    async def _render_responses(
        self,
        request: ReleaseRequest,
        items: list[dict[str, Any]],
        instructions: str | None,
        tools: list[Any] | None,
    ) -> list[int]:
        responses = _responses_request(request, items, instructions, tools)
        renderer = self.serving_responses.online_renderer
        try:
            rendered = await renderer.render_responses(responses)
        except ValueError as exc:
            raise ReleaseError(400, f"cannot render the window: {exc}") from None
        if not hasattr(rendered, "engine_input"):  # vLLM's ErrorResponse
            raise ReleaseError(rendered.error.code, rendered.error.message, rendered.error.type)
        return self._token_ids(rendered.engine_input)

    async def _render_messages_cut(
        self, request: ReleaseRequest, k: int, tools: list[Any] | None
    ) -> list[int]:
        """As vLLM's ``/v1/messages`` renders: its own Anthropic-to-chat conversion of
        ``system`` (window item 0, when given) and the messages before the released one."""
        serving = self.serving_messages
        if serving is None:
            raise ReleaseError(
                400, "this server does not serve the Messages API", "NotImplementedError"
            )
        messages = request.messages or []
        offset = 1 if request.system else 0
        _messages_request(request, messages, request.system, request.tools)  # all of it valid
        if k == 0:
            cut = _messages_request(request, messages[:1], None, None)
        else:
            cut = _messages_request(request, messages[: k - offset], request.system, tools)
        chat = serving.to_chat_completion_request(
            cut, merge_inline_system=getattr(serving, "_merge_inline_system", False)
        )
        tokens = await self._render_chat(chat)
        return [] if k == 0 else tokens

    def _token_ids(self, engine_input: Any) -> list[int]:
        return list(self.serving_chat._extract_prompt_components(engine_input).token_ids)

    async def call_engines(self, method: str, *args: Any) -> list[dict[str, Any]]:
        """A utility in every engine core (data parallel); 503 when the engine is dead."""
        if self.engine_client.errored:
            raise ReleaseError(503, "the engine is not running", "ServiceUnavailableError")
        core = self.engine_client.engine_core
        try:
            if hasattr(core, "call_utility_all_async"):
                return list(await core.call_utility_all_async(method, *args))
            return [await core.call_utility_async(method, *args)]
        except Exception as exc:
            logger.exception("vllm_affinity: engine call %s failed", method)
            raise ReleaseError(
                503, f"engine call failed: {exc}", "ServiceUnavailableError"
            ) from None

    async def stats(self) -> dict[str, Any]:
        engines = await self.call_engines("affinity_stats")
        self.metrics.update_engine_stats(engines)
        return {"engines": engines, "api_server": self.metrics.api_counts()}


def _chat_request(
    request: ReleaseRequest, messages: list[dict[str, Any]], tools: list[Any] | None
) -> Any:
    """vLLM's own chat request model over ``messages``/``tools``: a 400 when malformed."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    try:
        return ChatCompletionRequest(model=request.model, messages=messages, tools=tools)
    except ValidationError as exc:
        raise ReleaseError(400, f"invalid messages or tools: {exc.errors()[0]['msg']}") from None


def _responses_request(
    request: ReleaseRequest,
    items: list[dict[str, Any]],
    instructions: str | None,
    tools: list[Any] | None,
) -> Any:
    """vLLM's own Responses request model over ``items``: a 400 when malformed."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    try:
        return ResponsesRequest(
            model=request.model, input=items, instructions=instructions, tools=tools or []
        )
    except ValidationError as exc:
        raise ReleaseError(400, f"invalid input or tools: {exc.errors()[0]['msg']}") from None


def _messages_request(
    request: ReleaseRequest,
    messages: list[dict[str, Any]],
    system: Any,
    tools: list[Any] | None,
) -> Any:
    """vLLM's own Anthropic Messages request model over ``messages``: a 400 when malformed."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    try:
        return AnthropicMessagesRequest(
            model=request.model, messages=messages, system=system, tools=tools, max_tokens=1
        )
    except ValidationError as exc:
        raise ReleaseError(400, f"invalid messages or tools: {exc.errors()[0]['msg']}") from None


@router.post(RELEASE_PATH)
async def release_kv_cache(raw: Request) -> JSONResponse:
    return await _service(raw).handle(raw)


@router.get(CAPABILITIES_PATH)
async def affinity_capabilities(raw: Request) -> JSONResponse:
    service = _service(raw)
    if service.api_tokens and not service._authorised(raw):
        return JSONResponse({"error": "Unauthorized"}, status_code=401)
    return JSONResponse({**CAPABILITIES, "version": plugin_version()})


@router.get("/affinity/stats")
async def affinity_stats(raw: Request) -> JSONResponse:
    service = _service(raw)
    if service.api_tokens and not service._authorised(raw):
        return JSONResponse({"error": "Unauthorized"}, status_code=401)
    try:
        return JSONResponse(await service.stats())
    except ReleaseError as exc:
        return error_response(exc.status, exc.message, exc.kind)


@router.get("/affinity/check")
async def affinity_check(raw: Request) -> JSONResponse:
    """The plugin's invariants in every engine (free queue, pool, session table): for soak
    tests and operators. O(blocks + bindings) in the engine core: not for tight loops."""
    service = _service(raw)
    if service.api_tokens and not service._authorised(raw):
        return JSONResponse({"error": "Unauthorized"}, status_code=401)
    try:
        engines = await service.call_engines("affinity_check")
    except ReleaseError as exc:
        return error_response(exc.status, exc.message, exc.kind)
    ok = all(not e["problems"] for e in engines)
    return JSONResponse({"ok": ok, "engines": engines})


def _service(raw: Request) -> ReleaseService:
    return raw.app.state.jiuwen_affinity


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
        session = session_from_headers(headers, names)
        if session is not None:
            request.session_id = session
    parent = parent_from_headers(headers, names)
    if (
        parent is not None
        and hasattr(request, "vllm_xargs")
        and (PARENT_KEY not in (request.vllm_xargs or {}))
    ):
        request.vllm_xargs = {**(request.vllm_xargs or {}), PARENT_KEY: parent}


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
        session = None
        if service is not None:
            principal = service.principal_of(raw_request)
            apply_principal(request, principal)
            named = session_key(instance, request, raw_request)
            session = scoped(principal, named) if named else None
        next_use = None
        if settings.lifecycle and session:  # validated before anything is applied or counted
            try:
                next_use = read_next_use(raw_request)
            except NextUseError as exc:
                service.metrics.count_lifecycle("invalid")
                return _hint_error(instance, str(exc))
        if settings.dp_session_affinity and session:
            pin_session_to_engine(service, session, raw_request)
        try:
            hint = apply_release_hint(request, raw_request)
        except HintError as exc:
            count_hint("invalid")
            return _hint_error(instance, str(exc))
        if hint is not None:
            count_hint("accepted")
            _hint_span(raw_request, hint)
        if settings.lifecycle and session:
            named_tool = not isinstance(getattr(request, "tool_choice", None), str | None)
            on_finish = service.idle_signals.on_finish(session, next_use, named_tool)
            return watched(wrapped(*args, **kwargs), on_finish)
        return wrapped(*args, **kwargs)

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
            _service(raw_request).metrics.count_management("none", "invalid")
            return _hint_error(instance, str(exc))
        if agent_hint is not None and agent_hint.manage_request:
            apply_cache_sharing(request, settings.allow_cache_sharing)
            service = _service(raw_request)
            principal = service.principal_of(raw_request)
            return answer_management(service, request, agent_hint, raw_request, principal)
        return serve(wrapped, instance, args, kwargs)

    wrapt.wrap_function_wrapper(GenerateBaseServing, "_get_data_parallel_rank", session_rank)
    wrapt.wrap_function_wrapper(OpenAIServingChat, "create_chat_completion", before_chat)
    wrapt.wrap_function_wrapper(OpenAIServingCompletion, "create_completion", before)
    wrapt.wrap_function_wrapper(OpenAIServingResponses, "create_responses", before)
    _wrapped_serving = True


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
        attributes["gen_ai.conversation.id"] = session
    span = tracer.start_span(
        "kv_cache.release", context=ctx, kind=trace.SpanKind.SERVER, attributes=attributes
    )
    span.end()


def attach(app: FastAPI, settings: Settings, count_hint: Callable[[str], None]) -> None:
    app.include_router(router)
    wrap_serving(settings, count_hint)
