"""vLLM adapter, API-server side: openJiuwen's ``agent_hint`` on chat requests (>= 0.1.19).

- ``agent_hint.session_id`` names the request's session (vLLM's own ``session_id``, which the
  engine binds blocks to) unless the body already names one. ``parent_session_id`` makes the
  session a subagent of that parent (``core/subagents.py``: the parent's blocks are protected
  while it runs) and is recorded on spans. A parent's session action does not reach its
  sub-agents, which openJiuwen manages under their own session ids (a sticky sub-agent may
  outlive its parent's action).
- A management request (``context_management.manage_request: true``) is answered here and never
  reaches inference. Its ``messages`` / ``tools`` are the old window:
  - ``evict`` of a messages/tools range releases the session's cache from the range's start (in
    a prefix cache every later token is stale), as ``/release_kv_cache`` would; of ``session``,
    all of the session's blocks that no other session holds;
  - ``offload``: this server has no second tier, so the most honest meaning is the same
    demotion: the blocks are reused first but keep their hashes, and hit until reused;
  - ``prefetch`` undoes that for the blocks not reused yet (back to most-recently-used).
  The answer is a chat completion with empty content and zero usage (what openJiuwen's client
  accepts), plus the figures under ``kv_cache``.
"""

from __future__ import annotations

import time
import uuid
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace
from pydantic import ValidationError

from jiuwen_kv_protocol.headers import MODEL_ATTRIBUTE, RELEASE_SPAN, SESSION_ATTRIBUTE
from jiuwen_kv_protocol.models import EngineRestore, ReleaseError, ReleaseRequest

from ..core.agent_hint import AgentHint, AgentHintError
from ..core.request_keys import PARENT_KEY
from ..core.tenants import scoped

if TYPE_CHECKING:
    from .release_service import ReleaseService

FIELD = "agent_hint"
tracer = trace.get_tracer("vllm_affinity")


def read_agent_hint(request: Any) -> AgentHint | None:
    """Take ``agent_hint`` out of a parsed chat request (vLLM keeps unknown body fields as
    extras) and apply its session. Raises ``AgentHintError`` for a malformed one."""
    extra = request.model_extra
    if not extra or FIELD not in extra:
        return None
    hint = AgentHint.parse(extra.pop(FIELD))
    if not request.session_id:
        request.session_id = hint.session_id
    if hint.parent_session_id and hint.parent_session_id != request.session_id:
        request.vllm_xargs = {**(request.vllm_xargs or {}), PARENT_KEY: hint.parent_session_id}
    return hint


async def answer_management(
    service: ReleaseService, request: Any, hint: AgentHint, raw_request: Any, principal: str
) -> Any:
    """Carry out a management request: vLLM's ``ChatCompletionResponse``, or its
    ``ErrorResponse`` (4xx) for a request that cannot be acted on, with nothing changed."""
    headers = dict(getattr(raw_request, "headers", None) or {})
    attributes = {
        "jiuwen.release.protocol": "agent_hint",
        "jiuwen.release.action": hint.action or "",
        SESSION_ATTRIBUTE: hint.session_id,
        MODEL_ATTRIBUTE: request.model,
    }
    if hint.parent_session_id:
        attributes["jiuwen.session.parent_id"] = hint.parent_session_id
    with tracer.start_as_current_span(
        RELEASE_SPAN,
        context=propagate.extract(headers),
        kind=trace.SpanKind.SERVER,
        attributes=attributes,
    ) as span:
        try:
            figures = await _act(service, request, hint, scoped(principal, hint.session_id))
        except ReleaseError as exc:
            service.metrics.count_management(hint.action or "", f"http_{exc.status}")
            span.set_attribute("error.type", str(exc.status))
            return service.serving_chat.create_error_response(
                exc.message, err_type=exc.kind, status_code=HTTPStatus(exc.status)
            )
        for key in ("block_released", "blocks_restored", "first_stale_block"):
            if key in figures:
                span.set_attribute(f"jiuwen.release.{key}", figures[key])
    service.metrics.count_management(hint.action or "", figures["status"])
    service.metrics.count_blocks(figures.get("block_released", 0))
    return _completion(request.model, figures)


async def _act(
    service: ReleaseService, request: Any, hint: AgentHint, session: str
) -> dict[str, Any]:
    """The management request's edit on ``session`` (the hint's, scoped to the caller)."""
    checked = await service.serving_chat._check_model(request)
    if checked is not None:  # vLLM's ErrorResponse for an unknown model
        raise ReleaseError(checked.error.code, checked.error.message, checked.error.type)
    session_edit = hint.start_of("session") is not None
    cut: list[int] = []
    if not session_edit:
        messages = list(request.messages)
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
        _check_ranges(hint, len(messages), len(tools))
        k, j = hint.start_of("messages"), hint.start_of("tools")
        try:
            window = ReleaseRequest(
                model=request.model,
                cache_salt=hint.session_id,
                messages=messages,
                messages_released_index=len(messages) if k is None else k,
                tools=tools or None,
                tools_released_index=j,
            )
        except ValidationError as exc:
            message = f"invalid management request: {exc.errors()[0]['msg']}"
            raise ReleaseError(400, message) from None
        cut = await service.render_cut(window)
    salt = request.cache_salt  # the salt the session's chat requests were hashed with
    started = time.perf_counter()
    if hint.action == "prefetch":
        results = await service.call_engines("affinity_restore_prompt", session, cut, salt)
        engines = [EngineRestore.model_validate(r) for r in results]
        figures: dict[str, Any] = EngineRestore.summed(engines).model_dump()
    else:
        results = await service.call_engines(
            "affinity_release_prompt", session, cut, salt, "agent_hint"
        )
        figures = service.summed(results)
    figures["action"] = hint.action
    figures["target"] = "session" if session_edit else "window"
    figures["engine_ms"] = round((time.perf_counter() - started) * 1e3, 3)
    return figures


def _check_ranges(hint: AgentHint, num_messages: int, num_tools: int) -> None:
    cm = hint.context_management
    for edit in cm.edits if cm is not None else ():
        size = num_messages if edit.target == "messages" else num_tools
        if edit.end is not None and edit.end > size:
            raise ReleaseError(
                400,
                f"agent_hint {edit.target} range [{edit.start}, {edit.end}) is beyond the "
                f"{size} {edit.target} sent",
            )


def _completion(model: str, figures: dict[str, Any]) -> Any:
    """An empty chat completion, zero usage: what openJiuwen's client takes as success."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    return ChatCompletionResponse(
        id=f"chatcmpl-kv-{uuid.uuid4().hex}",
        model=model,
        choices=[
            ChatCompletionResponseChoice(
                index=0, message=ChatMessage(role="assistant", content=""), finish_reason="stop"
            )
        ],
        usage=UsageInfo(prompt_tokens=0, completion_tokens=0, total_tokens=0),
        kv_cache=figures,
    )


__all__ = ["FIELD", "AgentHintError", "answer_management", "read_agent_hint"]
