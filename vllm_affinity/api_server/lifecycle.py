"""vLLM adapter, API-server side: tell the engine when a session starts waiting on its user.

The engine core cannot tell a tool call from an answer (both finish as ``STOPPED``); the API
server can, once vLLM's own tool parser has run: the rule is in ``core/lifecycle.py``. This
module watches what vLLM's serving method returns and, when the session goes idle, sends the
engine utility ``affinity_session_idle`` as a background task, after the answer is complete:
the answer is never delayed, and a failure is logged, never raised.

Costs: nothing for a request of no session; for a stream, one ``deque.append`` per chunk and one
JSON parse of the last chunks at its end; one engine utility call per idle session.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ..core.lifecycle import ends_task, goes_idle

logger = logging.getLogger("vllm_affinity")

#: Chunks kept from the end of a stream: the finish chunk, a usage chunk, ``[DONE]``.
_TAIL = 3

OnFinish = Callable[[list[str | None]], None]


async def watched(result: Awaitable[Any], on_finish: OnFinish) -> Any:
    """``result`` (a serving coroutine) as it is, with ``on_finish`` called with its choices'
    finish reasons once the answer is complete (not for errors, nor for a stream the client
    left)."""
    answer = await result
    if hasattr(answer, "__aiter__"):
        return _watched_stream(answer, on_finish)
    reasons = finish_reasons(answer)
    if reasons:
        on_finish(reasons)
    return answer


async def _watched_stream(stream: Any, on_finish: OnFinish) -> AsyncIterator[Any]:
    tail: deque[Any] = deque(maxlen=_TAIL)
    try:
        async for chunk in stream:
            tail.append(chunk)
            yield chunk
    finally:
        await stream.aclose()
    reasons = [r for chunk in tail for r in finish_reasons(chunk)]
    if reasons:
        on_finish(reasons)


def finish_reasons(answer: Any) -> list[str | None]:
    """The finish reasons in a chat or completion answer, an SSE chunk of one, or a Responses
    answer (or its final stream event); empty when there are none (errors, middle chunks)."""
    if isinstance(answer, str):
        return _sse_finish_reasons(answer)
    response = getattr(answer, "response", None) or answer  # a Responses stream event
    output = getattr(response, "output", None)
    if output is not None and getattr(response, "status", None) is not None:
        return [_responses_finish(response)]
    choices = getattr(answer, "choices", None) or ()
    return [getattr(choice, "finish_reason", None) for choice in choices]


def _sse_finish_reasons(chunk: str) -> list[str | None]:
    if not chunk.startswith("data: ") or chunk.startswith("data: [DONE]"):
        return []
    try:
        data = json.loads(chunk[len("data: ") :])
    except json.JSONDecodeError:
        return []
    choices = data.get("choices") if isinstance(data, dict) else None
    return [c.get("finish_reason") for c in choices or () if c.get("finish_reason")]


def _responses_finish(response: Any) -> str | None:
    """A Responses answer in Chat Completions' terms."""
    if any(getattr(item, "type", None) == "function_call" for item in response.output):
        return "tool_calls"
    return {"completed": "stop", "incomplete": "length"}.get(response.status)


class IdleSignals:
    """Sends ``affinity_session_idle`` for finished calls whose session goes idle, keeping the
    background tasks referenced until they end. ``count`` gets each call's outcome:
    ``idle.<source>`` or ``live.<source>`` (source ``finish_reason`` or ``hint``), and
    ``failed`` for a signal the engine did not take."""

    def __init__(
        self,
        call_engines: Callable[..., Awaitable[list[dict[str, Any]]]],
        idle_after: float,
        count: Callable[[str], None],
    ) -> None:
        self._call_engines = call_engines
        self._idle_after = idle_after
        self._count = count
        self._tasks: set[asyncio.Task[None]] = set()

    def on_finish(
        self,
        session: str,
        next_use: float | None,
        named_tool: bool = False,
        side_branch: bool = False,
    ) -> OnFinish:
        """The callback for one call of ``session`` (with its ``X-KV-Next-Use``, if any).
        ``named_tool``: the request forced a named tool, which vLLM (as OpenAI) reports as
        ``stop``; it is a tool call all the same. ``side_branch``: a coding agent's one-shot
        side request (a title, a topic check, a compaction summary), idle once it ends however
        it ended: nothing extends it, and a cut-off answer says nothing of its session."""

        def finished(reasons: list[str | None]) -> None:
            if named_tool:
                reasons = ["tool_calls" if r == "stop" else r for r in reasons]
            if side_branch and next_use is None:
                idle, source = True, "side_branch"
            else:
                idle = goes_idle(reasons, next_use, self._idle_after)
                source = "hint" if next_use is not None else "finish_reason"
            self._count(f"{'idle' if idle else 'live'}.{source}")
            if idle:
                ended = ends_task(next_use)
                send = self._send(session, ended, next_use)
                task = asyncio.get_running_loop().create_task(send)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

        return finished

    async def _send(self, session: str, ended: bool, next_use: float | None) -> None:
        try:
            await self._call_engines("affinity_session_idle", session, ended, next_use)
        except Exception as exc:  # the engine is gone or dying: nothing to keep
            logger.warning("vllm_affinity: could not mark session %r idle: %s", session, exc)
            self._count("failed")

    async def drain(self) -> None:
        """Wait for the signals under way."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
