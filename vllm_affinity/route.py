"""vLLM adapter, API-server side: ``POST /release_kv_cache``, ``GET /affinity/stats`` and the
``cache_sharing`` request field.

The release is mapped to blocks exactly: the previous window is rendered by vLLM's own chat
renderer (same template, same tools) in full and cut at the released indices; the longest common
prefix of the two token lists is the first stale token; ``t // block_size`` the first stale block.
The engine core (every data-parallel engine) then moves the session's blocks from there on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from opentelemetry import propagate, trace
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .core import common_prefix_length, first_stale_block
from .metrics import AffinityMetrics
from .settings import Settings

logger = logging.getLogger("vllm_affinity")
tracer = trace.get_tracer("vllm_affinity")
router = APIRouter()


class ReleaseRequest(BaseModel):
    """The body of ``POST /release_kv_cache`` (see the README for the contract)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    cache_salt: str = Field(min_length=1, max_length=512)
    cache_sharing: bool | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    messages_released_index: int = Field(ge=0)
    tools: list[dict[str, Any]] | None = None
    tools_released_index: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _indices_in_range(self) -> ReleaseRequest:
        if self.messages_released_index > len(self.messages):
            raise ValueError(
                f"messages_released_index={self.messages_released_index} is beyond the "
                f"{len(self.messages)} messages sent"
            )
        if self.tools_released_index is not None:
            if self.tools is None:
                raise ValueError("tools_released_index given without tools")
            if self.tools_released_index > len(self.tools):
                raise ValueError(
                    f"tools_released_index={self.tools_released_index} is beyond the "
                    f"{len(self.tools)} tools sent"
                )
        return self


class ReleaseError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    """vLLM's ``ErrorResponse`` JSON shape."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


@dataclass
class ReleaseService:
    """What the route needs, captured once in ``init_state``."""

    engine_client: Any
    serving_chat: Any
    block_size: int
    max_model_len: int
    api_tokens: list[bytes]
    settings: Settings
    metrics: AffinityMetrics

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
                span.set_attribute("gen_ai.conversation.id", request.cache_salt)
                span.set_attribute("gen_ai.request.model", request.model)
                result = await self._release(request)
            except ReleaseError as exc:
                self.metrics.count_request(f"http_{exc.status}")
                span.set_attribute("error.type", str(exc.status))
                span.set_attribute("http.response.status_code", exc.status)
                return error_response(exc.status, exc.message, exc.kind)
            for key in ("block_released", "first_stale_token", "first_stale_block"):
                span.set_attribute(f"jiuwen.release.{key}", result[key])
            span.set_attribute("http.response.status_code", 200)
        self.metrics.count_request(result["status"])
        self.metrics.count_blocks(result["block_released"])
        return JSONResponse(result)

    def _authorised(self, raw: Request) -> bool:
        scheme, _, token = raw.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        return any(secrets.compare_digest(digest, t) for t in self.api_tokens)

    async def _parse(self, raw: Request) -> ReleaseRequest:
        try:
            data = json.loads(await raw.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ReleaseError(400, f"request body is not valid JSON: {exc}") from None
        try:
            return ReleaseRequest.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
            )
            raise ReleaseError(400, f"invalid release request: {problems}") from None

    async def _release(self, request: ReleaseRequest) -> dict[str, Any]:
        if self.engine_client.errored:
            raise ReleaseError(503, "the engine is not running", "ServiceUnavailableError")
        started = time.perf_counter()
        full = await self._render(request, request.messages, request.tools)
        if len(full) > self.max_model_len:
            raise ReleaseError(
                400,
                f"the rendered window has {len(full)} tokens, over max_model_len "
                f"{self.max_model_len}",
            )
        first_stale_token = await self._first_stale_token(request, full)
        block = first_stale_block(first_stale_token, self.block_size)
        rendered = time.perf_counter()
        results = await self._call_engines("affinity_release", request.cache_salt, block, len(full))
        done = time.perf_counter()
        merged: dict[str, Any] = {
            "cache_salt": request.cache_salt,
            "block_released": sum(r["block_released"] for r in results),
            "moved": sum(r["moved"] for r in results),
            "pending": sum(r["pending"] for r in results),
            "kept_shared": sum(r["kept_shared"] for r in results),
            "status": _merge_status(r["status"] for r in results),
            "first_stale_token": first_stale_token,
            "first_stale_block": block,
            "prompt_tokens": len(full),
            "render_ms": round((rendered - started) * 1e3, 3),
            "engine_ms": round((done - rendered) * 1e3, 3),
        }
        return merged

    async def _first_stale_token(self, request: ReleaseRequest, full: list[int]) -> int:
        k, j = request.messages_released_index, request.tools_released_index
        tools = request.tools if j is None else (request.tools or [])[:j]
        if k == len(request.messages) and j is None:
            return len(full)  # only what followed the window (the reply) is stale
        if k == 0:
            return 0  # the template may not render an empty conversation
        cut = await self._render(request, request.messages[:k], tools or None)
        return common_prefix_length(full, cut)

    async def _render(
        self, request: ReleaseRequest, messages: list[dict[str, Any]], tools: list[Any] | None
    ) -> list[int]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            chat = ChatCompletionRequest(model=request.model, messages=messages, tools=tools)
        except ValidationError as exc:
            raise ReleaseError(
                400, f"invalid messages or tools: {exc.errors()[0]['msg']}"
            ) from None
        try:
            rendered = await self.serving_chat.render_chat_request(chat)
        except ValueError as exc:  # template errors surface as ValueError
            raise ReleaseError(400, f"cannot render the window: {exc}") from None
        if not isinstance(rendered, tuple):  # vLLM's ErrorResponse: keep its status and text
            raise ReleaseError(rendered.error.code, rendered.error.message, rendered.error.type)
        _, engine_inputs = rendered
        return list(self.serving_chat._extract_prompt_components(engine_inputs[0]).token_ids)

    async def _call_engines(self, method: str, *args: Any) -> list[dict[str, Any]]:
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
        engines = await self._call_engines("affinity_stats")
        self.metrics.update_engine_stats(engines)
        return {"engines": engines, "api_server": self.metrics.api_counts()}


def _merge_status(statuses: Any) -> str:
    statuses = set(statuses)
    return "ok" if "ok" in statuses else (statuses.pop() if len(statuses) == 1 else "mixed")


@router.post("/release_kv_cache")
async def release_kv_cache(raw: Request) -> JSONResponse:
    return await _service(raw).handle(raw)


@router.get("/affinity/stats")
async def affinity_stats(raw: Request) -> JSONResponse:
    service = _service(raw)
    if service.api_tokens and not service._authorised(raw):
        return JSONResponse({"error": "Unauthorized"}, status_code=401)
    try:
        return JSONResponse(await service.stats())
    except ReleaseError as exc:
        return error_response(exc.status, exc.message, exc.kind)


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


_wrapped_serving = False


def wrap_serving(settings: Settings) -> None:
    """Thin wrapt patches of vLLM's chat and completion entry methods (API server process only):
    apply ``cache_sharing`` to the parsed request before vLLM handles it. Idempotent."""
    global _wrapped_serving
    if _wrapped_serving:
        return
    import wrapt
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    def before(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        request = args[0] if args else kwargs["request"]
        apply_cache_sharing(request, settings.allow_cache_sharing)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(OpenAIServingChat, "create_chat_completion", before)
    wrapt.wrap_function_wrapper(OpenAIServingCompletion, "create_completion", before)
    _wrapped_serving = True


def attach(app: FastAPI, settings: Settings) -> None:
    app.include_router(router)
    wrap_serving(settings)
