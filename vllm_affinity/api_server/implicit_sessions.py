"""vLLM adapter, API-server side: sessions for agents that name none
(``VLLM_AFFINITY_IMPLICIT_SESSIONS=answers``, the default).

A chat request with no session gets the one its window continues (``core/answer_chains.py``):
the chain of the latest answer it carries back (or of an answer's stretch in its user
messages), else a new chain. The chain is bound as the request's ``session_id`` (a side
request of it under its side branch), the compaction rule judges its windows, and this module
reads the answer vLLM gives (its text and tool call ids, from the response or the stream's
chunks) to record it under the chain once it is complete.

The table lives where every request is seen: in this API-server process with one API server
(``LocalChains``), else in the engine core (``EngineChains``: one engine utility call to link a
window and one to record its answer; with data parallelism the engine is chosen by the
principal: a conversation's side requests have other instructions than its main thread).

Costs, only for requests that name no session: the window's assistant and user messages read
and digested once; for a stream, one JSON parse per chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

from ..core.answer_chains import OUTCOMES, Answer, AnswerChains, ChainWindow, Outcome

logger = logging.getLogger("vllm_affinity")

OnAnswer = Callable[[Answer], None]


def chain_window_of(request: Any) -> ChainWindow | None:
    """The window of a chat request (``None`` for other kinds: they are not linked)."""
    messages = getattr(request, "messages", None)
    if not isinstance(messages, list):
        return None
    return ChainWindow.of(messages, getattr(request, "tools", None))


class LocalChains:
    """The chains in this API-server process (the server runs one)."""

    def __init__(self, max_chains: int) -> None:
        self.table = AnswerChains(max_chains)

    async def chain_of(self, principal: str, window: ChainWindow) -> tuple[str, Outcome]:
        return self.table.chain_of(principal, window)

    def record(self, principal: str, chain: str, answer: Answer, main: bool) -> None:
        """At once: the conversation's next request may follow the answer at once."""
        self.table.record(principal, chain, answer, main)


#: Calls an engine utility on the engine core that serves a key.
CallEngine = Callable[..., Awaitable[Any]]


class EngineChains:
    """The chains in an engine core (``EngineCore.affinity_chain_of``,
    ``affinity_record_answer``): with several API servers each sees only some requests. A
    principal's requests reach one engine."""

    def __init__(self, call_engine: CallEngine) -> None:
        self._call_engine = call_engine

    async def chain_of(self, principal: str, window: ChainWindow) -> tuple[str, Outcome]:
        chain, outcome = await self._call_engine(
            principal, "affinity_chain_of", principal, window.to_wire()
        )
        if outcome not in OUTCOMES:
            raise ValueError(f"the engine answered {outcome!r}, not a chain outcome")
        return str(chain), cast(Outcome, outcome)

    def record(self, principal: str, chain: str, answer: Answer, main: bool) -> Awaitable[None]:
        """The engine utility call, to be awaited (``AnswerRecords`` runs it in the background)."""
        return self._call_engine(
            principal, "affinity_record_answer", principal, chain, answer.to_wire(), main
        )


class AnswerRecords:
    """Records answers as background tasks (with several API servers a record is an engine
    utility call), keeping them referenced until they end; a failure is logged, never raised."""

    def __init__(self, chains: LocalChains | EngineChains) -> None:
        self.chains = chains
        self._tasks: set[asyncio.Task[None]] = set()

    def on_answer(self, principal: str, chain: str, main: bool = True) -> OnAnswer:
        def answered(answer: Answer) -> None:
            record = self.chains.record(principal, chain, answer, main)
            if record is None:  # recorded here, at once
                return
            task = asyncio.get_running_loop().create_task(self._send(record))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return answered

    @staticmethod
    async def _send(record: Awaitable[None]) -> None:
        try:
            await record
        except Exception as exc:  # the engine is gone or dying: the next window starts a chain
            logger.warning("vllm_affinity: could not record an answer: %s", exc)

    async def drain(self) -> None:
        """Wait for the records under way."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def with_answer(result: Awaitable[Any], on_answer: OnAnswer) -> Any:
    """``result`` (a serving coroutine) as it is, with ``on_answer`` called with each choice's
    answer once it is complete (not for errors)."""
    response = await result
    if hasattr(response, "__aiter__"):
        return _read_stream(response, on_answer)
    for answer in answers_of(response):
        on_answer(answer)
    return response


def answers_of(response: Any) -> list[Answer]:
    """The answers in a Chat Completions response (none in an error)."""
    answers = []
    for choice in getattr(response, "choices", None) or ():
        message = getattr(choice, "message", None)
        if message is None:
            continue
        ids = tuple(getattr(c, "id", None) or "" for c in getattr(message, "tool_calls", ()) or ())
        answers.append(Answer(getattr(message, "content", None) or "", ids))
    return answers


async def _read_stream(stream: Any, on_answer: OnAnswer) -> AsyncIterator[Any]:
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[str]] = {}
    try:
        async for chunk in stream:
            _read_chunk(chunk, texts, ids)
            yield chunk
    finally:
        await stream.aclose()
    for index in sorted(texts.keys() | ids.keys()):
        on_answer(Answer("".join(texts.get(index, ())), tuple(ids.get(index, ()))))


def _read_chunk(chunk: Any, texts: dict[int, list[str]], ids: dict[int, list[str]]) -> None:
    if not isinstance(chunk, str) or not chunk.startswith("data: {"):
        return
    try:
        data = json.loads(chunk[len("data: ") :])
    except json.JSONDecodeError:
        return
    for choice in data.get("choices") or ():
        delta = choice.get("delta") or {}
        index = choice.get("index", 0)
        if isinstance(delta.get("content"), str):
            texts.setdefault(index, []).append(delta["content"])
        for call in delta.get("tool_calls") or ():
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                ids.setdefault(index, []).append(call["id"])
