"""vLLM adapter, API-server side: the release service behind ``POST /release_kv_cache`` (and
openJiuwen's management requests). A POSTed release is mapped to blocks exactly with one render:
the previous window, cut at the released indices, is rendered by vLLM's own renderer (same
template, same tools); the engine core (every data-parallel engine) hashes those tokens with its
own block hasher and releases the session's cached blocks from the first one whose hash
differs."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from opentelemetry import propagate, trace
from pydantic import ValidationError

from jiuwen_kv_protocol.headers import (
    MODEL_ATTRIBUTE,
    RELEASE_SPAN,
    SESSION_ATTRIBUTE,
    SESSION_HEADER,
)
from jiuwen_kv_protocol.hint import HEADER as HINT_HEADER
from jiuwen_kv_protocol.models import EngineRelease, ReleaseError, ReleaseRequest

from ..core import engine_rank
from ..core.compaction import owner_of
from ..core.lifecycle import HEADER as NEXT_USE_HEADER
from ..core.request_keys import DENSE_KINDS
from ..core.tenants import ANONYMOUS, UNSCOPED, key_principal, scoped, tenant_principal
from ..settings import Settings
from .agent_windows import EngineWindows, LocalWindows
from .implicit_sessions import AnswerRecords, EngineChains, LocalChains
from .instructions import INSTRUCTION_ROLES, Instructions
from .lifecycle import IdleSignals
from .metrics import AffinityMetrics

logger = logging.getLogger("vllm_affinity")
tracer = trace.get_tracer("vllm_affinity")

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
    #: The server's API-server processes (``--api-server-count``; data parallelism's default).
    api_servers: int = 1
    idle_signals: IdleSignals = field(init=False)
    #: Coding agents' main threads, for their compactions (``agent_windows.py``): here with
    #: one API server, else in the engine that serves the session.
    windows: LocalWindows | EngineWindows = field(init=False)
    #: Subagents' instruction lengths, which their end keeps (``instructions.py``).
    instructions: Instructions = field(init=False)
    #: The chains of requests that name no session (``implicit_sessions.py``); ``None`` when
    #: ``VLLM_AFFINITY_IMPLICIT_SESSIONS`` is off.
    answers: AnswerRecords | None = field(init=False)
    #: Whether the engines have a sliding-window or Mamba group (their stats say; None: not
    #: asked yet): their requests carry the instructions' checkpoint (``checkpoints.py``).
    _sparse: bool | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.idle_signals = IdleSignals(
            self.call_engines, self.settings.idle_after, self.metrics.count_lifecycle
        )
        if self.api_servers > 1:
            self.windows = EngineWindows(self.call_engine_of)
        else:
            self.windows = LocalWindows(self.settings.max_sessions)
        self.answers = None
        if self.settings.implicit_sessions == "answers":
            chains = (
                EngineChains(self.call_engine_of)
                if self.api_servers > 1
                else LocalChains(self.settings.max_sessions)
            )
            self.answers = AnswerRecords(chains)
        self.instructions = Instructions(
            self.serving_chat, self.serving_responses, self.settings.max_sessions
        )

    # -- request handling ---------------------------------------------------------------------
    async def handle(self, raw: Request) -> JSONResponse:
        """A ``POST /release_kv_cache`` from an authorised caller (``route.py``)."""
        ctx = propagate.extract(dict(raw.headers))
        with tracer.start_as_current_span(
            RELEASE_SPAN, context=ctx, kind=trace.SpanKind.SERVER
        ) as span:
            try:
                request = await self._parse(raw)
                span.set_attribute("jiuwen.release.protocol", "release_kv_cache")
                span.set_attribute(SESSION_ATTRIBUTE, request.cache_salt)
                span.set_attribute(MODEL_ATTRIBUTE, request.model)
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

    def authorised(self, raw: Request) -> bool:
        """Whether the request carries one of the server's API keys."""
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
        # a cut that keeps only the instructions (an end, or a compaction down to them) keeps
        # the block straddling their end: the next session's or sibling's first message may
        # start as this one's did
        keep = len(cut) if _keeps_only_instructions(request) else 0
        results = await self.call_engines(
            "affinity_release_prompt", session, cut, salt, "post", keep
        )
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

    async def sparse_groups(self) -> bool:
        """Whether the model has a sliding-window or Mamba group (asked of the engines once;
        an engine that cannot answer yet: not known, no checkpoint)."""
        if self._sparse is None:
            try:
                await self.stats()
            except ReleaseError:
                return False
        return bool(self._sparse)

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

    async def call_engine_of(self, session: str, method: str, *args: Any) -> Any:
        """A utility in the engine core that serves ``session`` (``core/placement.py``)."""
        core = self.engine_client.engine_core
        engines = getattr(core, "core_engines", None)
        if self.data_parallel_size > 1 and engines and hasattr(core, "_call_utility_async"):
            engine = engines[engine_rank(owner_of(session), self.data_parallel_size)]
            return await core._call_utility_async(method, *args, engine=engine)
        return await core.call_utility_async(method, *args)

    async def stats(self) -> dict[str, Any]:
        engines = await self.call_engines("affinity_stats")
        self.metrics.update_engine_stats(engines)
        self._sparse = any(
            group["kind"] not in DENSE_KINDS for engine in engines for group in engine["groups"]
        )
        # "pid": which API server answered, where several share the port (counts are its own)
        return {"engines": engines, "api_server": {"pid": os.getpid(), **self.metrics.api_counts()}}


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


def service_of(raw: Any) -> ReleaseService:
    """The release service ``init_state`` put on the app, from a request."""
    return raw.app.state.jiuwen_affinity  # type: ignore[no-any-return]


def _keeps_only_instructions(request: ReleaseRequest) -> bool:
    """Whether the window cut at ``messages_released_index`` is its instructions alone."""
    k = request.messages_released_index
    if request.input is not None:
        return k == 1 and bool(request.instructions)
    if request.is_messages:
        return k == 1 and bool(request.system)
    kept = (request.messages or [])[:k]
    return bool(kept) and all(m.get("role") in INSTRUCTION_ROLES for m in kept)
