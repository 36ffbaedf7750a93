"""Pure core: the sessions of agents that name none, told by the answers they send back.

aider, mini-swe-agent and Qwen Code (by default) put no session on the wire, but each of their
requests carries the server's earlier answers to it: a tool call's id (random, chosen by
vLLM), the assistant's text as it was answered, or, after a compaction, the summary the server
wrote inside the new window's first user message. A window that carries an answer the server
gave continues that answer's conversation, its *chain*; the chain is the request's session,
and the compaction rule judges its windows as it judges a named session's. A window that
carries none starts a chain of its own (a conversation's first request, a side request).

Two conversations are never joined, which keeps id-less sessions that share a system prompt
and tools apart (what makes the guess safe):

- a window is linked by the **latest** answer it carries that the server gave this principal
  (its last assistant message found in the table; an assistant message the server never wrote,
  such as aider's "Ok.", is passed over); an answer two chains gave alike (the same text) links
  neither, and nothing earlier in the window is tried;
- a chain's instructions (its tools and leading system messages) must be the window's;
- a summary links a window with no known answer only when it is the opening of one of the
  last answers given under the same instructions (at least ``MIN_OPENING`` characters).

Memory: one entry per link (a tool call id or a text digest), at most ``max_links`` (least
recently used out first), and one per chain, at most ``max_chains``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import secrets
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: An answer's opening searched for in a window's user messages (a compaction's summary).
MIN_OPENING = 64
#: Answers per (principal, instructions) whose openings a window with no known answer is
#: searched for.
RECENT_OPENINGS = 8
#: A link two chains gave alike: it links neither.
_AMBIGUOUS = ""
#: Prefix of a chain's name: a header value cannot hold it, so no client names a chain.
CHAIN_PREFIX = "\x1eanswers-"


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def text_link(text: str) -> str | None:
    """The link of an answer's (or an assistant message's) text; ``None`` when it is empty."""
    text = text.strip()
    return f"t:{_digest(text)}" if text else None


def id_link(tool_call_id: str) -> str:
    return f"i:{tool_call_id}"


def text_of(content: Any) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list | tuple):
        parts = (p.get("text") for p in content if isinstance(p, Mapping))
        return "".join(p for p in parts if isinstance(p, str))
    return ""


@dataclass(frozen=True, slots=True)
class Answer:
    """What the server answered: its text and its tool calls' ids."""

    text: str = ""
    tool_call_ids: tuple[str, ...] = ()

    def links(self) -> list[str]:
        links = [id_link(i) for i in self.tool_call_ids if i]
        text = text_link(self.text)
        return [*links, text] if text else links

    def opening(self) -> str | None:
        text = self.text.strip()
        return text[:MIN_OPENING] if len(text) >= MIN_OPENING else None

    def to_wire(self) -> tuple[str, list[str]]:
        return (self.text, list(self.tool_call_ids))

    @classmethod
    def from_wire(cls, wire: Any) -> Answer:
        try:
            text, ids = wire
            answer = cls(str(text), tuple(str(i) for i in ids))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not an answer: {exc}") from None
        return answer


@dataclass(frozen=True, slots=True)
class ChainWindow:
    """What linking reads of a window: its instructions' digest, the links of each of its
    assistant messages (in order) and its user messages' texts."""

    instructions: str
    answers: tuple[tuple[str, ...], ...]
    user_texts: tuple[str, ...]

    @classmethod
    def of(cls, messages: Iterable[Any], tools: Any) -> ChainWindow:
        messages = [m for m in messages if isinstance(m, Mapping)]
        head = 0
        while head < len(messages) and messages[head].get("role") in ("system", "developer"):
            head += 1
        leading = [text_of(m.get("content")) for m in messages[:head]]
        instructions = _digest(json.dumps([tools, leading], sort_keys=True, default=str))
        answers: list[tuple[str, ...]] = []
        user_texts: list[str] = []
        for message in messages[head:]:
            role = message.get("role")
            if role == "assistant":
                calls = message.get("tool_calls") or ()
                ids = [c.get("id") for c in calls if isinstance(c, Mapping)]
                links = [id_link(i) for i in ids if isinstance(i, str) and i]
                text = text_link(text_of(message.get("content")))
                answers.append(tuple([*links, text] if text else links))
            elif role == "user":
                user_texts.append(text_of(message.get("content")))
        return cls(instructions, tuple(answers), tuple(user_texts))

    def to_wire(self) -> tuple[str, list[list[str]], list[str]]:
        return (self.instructions, [list(a) for a in self.answers], list(self.user_texts))

    @classmethod
    def from_wire(cls, wire: Any) -> ChainWindow:
        try:
            instructions, answers, texts = wire
            window = cls(
                str(instructions),
                tuple(tuple(str(k) for k in a) for a in answers),
                tuple(str(t) for t in texts),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not a chain window: {exc}") from None
        return window


class AnswerChains:
    """Per principal, which chain each answer the server gave belongs to."""

    def __init__(self, max_chains: int = 100_000, max_links: int | None = None) -> None:
        if max_chains < 1:
            raise ValueError("max_chains must be at least 1")
        self._max_chains = max_chains
        self._max_links = max_links or 16 * max_chains
        #: chain -> its instructions' digest
        self._chains: OrderedDict[str, str] = OrderedDict()
        #: (principal, link) -> chain, or _AMBIGUOUS
        self._links: OrderedDict[tuple[str, str], str] = OrderedDict()
        #: (principal, instructions) -> the last answers' (chain, opening)
        self._openings: OrderedDict[tuple[str, str], deque[tuple[str, str]]] = OrderedDict()
        self._names = (f"{CHAIN_PREFIX}{secrets.token_hex(4)}-{n}" for n in itertools.count())

    def __len__(self) -> int:
        return len(self._chains)

    def chain_of(self, principal: str, window: ChainWindow) -> tuple[str, bool]:
        """The window's chain, and whether it continues one (``False``: a new chain)."""
        chain = self._linked(principal, window)
        if chain is None:
            chain = next(self._names)
            self._chains[chain] = window.instructions
            while len(self._chains) > self._max_chains:
                self._chains.popitem(last=False)
            return chain, False
        self._chains.move_to_end(chain)
        return chain, True

    def _linked(self, principal: str, window: ChainWindow) -> str | None:
        for links in reversed(window.answers):
            found = {
                c for c in (self._links.get((principal, link)) for link in links) if c is not None
            }
            if not found:
                continue  # an assistant message this server never wrote
            chain = found.pop() if len(found) == 1 else _AMBIGUOUS
            if chain == _AMBIGUOUS or self._chains.get(chain) != window.instructions:
                return None
            return chain
        recent = self._openings.get((principal, window.instructions), ())
        for chain, opening in reversed(recent):
            if chain in self._chains and any(opening in text for text in window.user_texts):
                return chain
        return None

    def record(self, principal: str, chain: str, answer: Answer) -> None:
        """The server answered ``chain``'s request with ``answer``."""
        instructions = self._chains.get(chain)
        if instructions is None:
            return  # forgotten meanwhile
        for link in answer.links():
            key = (principal, link)
            known = self._links.get(key)
            self._links[key] = chain if known in (None, chain) else _AMBIGUOUS
            self._links.move_to_end(key)
        while len(self._links) > self._max_links:
            self._links.popitem(last=False)
        opening = answer.opening()
        if opening is not None:
            place = (principal, instructions)
            recent = self._openings.pop(place, None) or deque(maxlen=RECENT_OPENINGS)
            recent.append((chain, opening))
            self._openings[place] = recent
            while len(self._openings) > self._max_chains:
                self._openings.popitem(last=False)
