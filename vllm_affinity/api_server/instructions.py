"""API-server side: how many leading tokens of a subagent's prompt are its instructions.

A subagent's end releases its own blocks as dead (``VLLM_AFFINITY_CHILD_END=release``), but its
system prompt and tools are what the agent's next subagents send again: released, a later
subagent recomputes them, and the end costs more prompt tokens than no release at all (the
Claude Code trace, issue 31). So the end releases after them, as the hook's ``end_session``
does on the client.

The instructions' length is found by rendering, with vLLM's own renderer, the request's
instructions (leading system/developer messages, or the Responses API's ``instructions`` and
leading system/developer items, where the Codex CLI puts its own) and tools twice, each followed
by a different one-word user message: the tokens the two renders share are exactly what any
conversation with these instructions starts with, whatever the chat template does with tools or
turn markers. Once per session (bounded, least recently used out);
a render that fails gives 0 (the end then releases everything, as before), never an error.

On a hybrid model every request's instruction length is the position where the engine keeps
its sliding-window and Mamba state (``checkpoints.py``), cached by the instructions' content
(``instructions_key``): sessions with the same instructions render them once.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from typing import Any

from ..core import common_prefix_length
from ..core.compaction import INSTRUCTION_ROLES

logger = logging.getLogger(__name__)

__all__ = ["INSTRUCTION_ROLES", "Instructions", "instructions_key"]

#: Two user messages that differ from their first character on.
_PROBES = ("Alpha", "Omega")


class Instructions:
    """Per-session instruction lengths in tokens, rendered on first use."""

    def __init__(self, serving_chat: Any, serving_responses: Any, max_sessions: int) -> None:
        self._chat = serving_chat
        self._responses = serving_responses
        self._max_sessions = max(1, max_sessions)
        self._tokens: OrderedDict[str, int] = OrderedDict()

    async def tokens(self, session: str, request: Any) -> int:
        """Leading tokens of ``request``'s prompt that are its instructions (0: none or unknown)."""
        known = self._tokens.get(session)
        if known is not None:
            self._tokens.move_to_end(session)
            return known
        try:
            count = await self._render(request)
        except Exception:  # a template that cannot render a probe: release as before
            logger.debug("vllm_affinity: cannot render the instructions", exc_info=True)
            count = 0
        self._tokens[session] = count
        while len(self._tokens) > self._max_sessions:
            self._tokens.popitem(last=False)
        return count

    async def _render(self, request: Any) -> int:
        if hasattr(request, "messages"):
            render, probes = self._render_chat, _chat_probes(request)
        elif hasattr(request, "input") and self._responses is not None:
            render, probes = self._render_responses, _responses_probes(request)
        else:
            return 0
        if probes is None:
            return 0
        first, second = [await render(probe) for probe in probes]
        return common_prefix_length(first, second)

    async def _render_chat(self, request: Any) -> list[int]:
        rendered = await self._chat.render_chat_request(request)
        if not isinstance(rendered, tuple):  # vLLM's ErrorResponse
            raise ValueError(rendered.error.message)
        _, engine_inputs = rendered
        return self._token_ids(engine_inputs[0])

    async def _render_responses(self, request: Any) -> list[int]:
        rendered = await self._responses.online_renderer.render_responses(request)
        if not hasattr(rendered, "engine_input"):  # vLLM's ErrorResponse
            raise ValueError(rendered.error.message)
        return self._token_ids(rendered.engine_input)

    def _token_ids(self, engine_input: Any) -> list[int]:
        return list(self._chat._extract_prompt_components(engine_input).token_ids)


def instructions_key(request: Any) -> str | None:
    """A key for ``request``'s instructions and tools, whatever session sends them (None: it
    has neither): requests with equal keys start with the same tokens."""
    if hasattr(request, "messages"):
        parts: list[Any] = [_chat_head(request), request.tools]
    elif hasattr(request, "input"):
        parts = [[request.instructions, *_responses_head(request)], request.tools]
    else:
        return None
    if not any(parts[0]) and not parts[1]:
        return None
    text = json.dumps(parts, sort_keys=True, default=_plain)
    return "instructions:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _plain(value: Any) -> Any:
    """A pydantic model (a tool, a typed message) as the plain data it holds."""
    dump = getattr(value, "model_dump", None)
    return dump(mode="json") if callable(dump) else repr(value)


def _chat_head(request: Any) -> list[Any]:
    """The leading instruction messages (system, developer) of a chat request."""
    return _leading_instructions(request.messages or [])


def _responses_head(request: Any) -> list[Any]:
    """The leading instruction items (system, developer messages) of a Responses request's
    ``input``: the Codex CLI puts its instructions there, not in ``instructions``."""
    items = request.input
    return _leading_instructions(items) if isinstance(items, list) else []


def _leading_instructions(messages: list[Any]) -> list[Any]:
    head = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
        if role not in INSTRUCTION_ROLES:
            break
        head.append(message)
    return head


def _chat_probes(request: Any) -> tuple[Any, Any] | None:
    """The request cut to its instructions and tools, then one probe user message each."""
    head = _chat_head(request)
    if not head and not request.tools:
        return None
    return tuple(  # type: ignore[return-value]
        request.model_copy(update={"messages": [*head, {"role": "user", "content": probe}]})
        for probe in _PROBES
    )


def _responses_probes(request: Any) -> tuple[Any, Any] | None:
    head = _responses_head(request)
    if not request.instructions and not head and not request.tools:
        return None
    return tuple(  # type: ignore[return-value]
        request.model_copy(
            update={
                "input": [*head, {"role": "user", "content": probe}],
                "previous_response_id": None,
            }
        )
        for probe in _PROBES
    )
