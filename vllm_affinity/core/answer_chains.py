"""Pure core: the sessions of agents that name none, told by the answers they send back.

aider, mini-swe-agent, Qwen Code (by default) and chat UIs put no session on the wire, but each
of their requests carries the server's earlier answers to it: a tool call's id (random, chosen
by vLLM), the assistant's text as it was answered, or, after a compaction, the summary the
server wrote inside the new window's first user message (trimmed, its ``<analysis>`` block
cut, a trailer added). A window that carries an answer the server gave continues that
answer's conversation, its *chain*; the chain is the request's session, and the compaction
rule judges its windows as it judges a named session's. A window that carries none starts a
chain of its own (a conversation's first request, a one-shot request).

Two conversations are never joined, which keeps id-less sessions that share a system prompt
and tools apart (what makes the guess safe):

- a window is linked by the **latest** answer it carries that the server gave this principal
  (its last assistant message found in the table; an assistant message the server never wrote,
  such as aider's "Ok.", is passed over); an answer two chains gave alike (the same text) links
  neither, and nothing earlier in the window is tried;
- a window with other instructions (tools, leading system messages) than its chain's is a
  **side** request of that chain (a summarizer, a compaction or memory request carrying the
  conversation): it never becomes the chain's window;
- a window with no known answer is linked by a **stretch** of one of the principal's last
  answers found in its user messages (a compaction's summary): ``PROBES`` stretches of
  ``PROBE_CHARS`` characters spread over the answer's text, whitespace collapsed; two must
  be found (one for an answer too short for two) in the first ``SCAN_CHARS`` characters of the
  window's user messages (where a summary opens a compacted window), only one chain's answers
  may match, and the chain's instructions must be the window's;
- a window with **no instructions** (neither tools nor a leading system or developer message:
  a chat UI's, by default) is linked by no stretch: equal instructions that are none tell no
  conversation from another. Open WebUI's title, follow-up and tags requests quote the chat's
  last messages (its latest answer among them) in one user message, with no system prompt, as
  the chat's own windows have none: linked by the answer's stretches such a request continued
  the chat, and the compaction rule judged it a rewrite that released the live chat. It starts
  a chain of its own, as does a user's new chat that pastes another chat's answer. Such a
  window is still linked by the answers it carries back (a chat goes on turn by turn); an
  instruction-less agent's compaction starts a new chain (what it would have released stays
  cached, as on vanilla);
- an assistant message **before any user message** (an app's greeting, model-written once and
  then the same in every user's chat) answered nothing in the window: its text links nothing
  (its tool calls' ids still do, being vLLM's own). Linked by it, every chat opening with it
  would join the chain that wrote it, and so each other; each chat is linked by its own answers.

A chain's request whose answer never came back (answered, or given up on before its answer)
and whose last user message the next window dropped was a side request (Qwen Code's
next-prompt suggestion: the conversation and one fixed user message, answered and dropped): its
last user message is learned as a **side prompt** of the principal, and a later window of a
chain that ends with it is a side request.

Memory: one entry per link (a tool call id or a text digest; ~90 bytes), at most ``max_links``
(8 per chain by default; the least recently used out first, within a generation's span: see
``_Links``); one per chain (its instructions and its last request), at most
``max_chains``; per principal its last ``RECENT_ANSWERS`` answers' stretches (at most
``PROBES * PROBE_CHARS`` characters each) and its learned side prompts.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import secrets
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

#: Characters of one stretch of an answer searched for in a window's user messages.
PROBE_CHARS = 64
#: Stretches kept per answer, spread over its text.
PROBES = 8
#: Answers per principal whose stretches a window with no known answer is searched for.
RECENT_ANSWERS = 8
#: Characters of a window's user messages searched for stretches, from its first one: a
#: compaction's summary opens the new window; a long window with no known answer (a first
#: request, a one-shot prompt) costs no more than this.
SCAN_CHARS = 65_536
#: Side prompts learned per principal.
MAX_SIDE_PROMPTS = 64
#: A link two chains gave alike: it links neither.
_AMBIGUOUS = ""
#: Prefix of a chain's name: a header value cannot hold it, so no client names a chain.
CHAIN_PREFIX = "\x1eanswers-"
#: The instructions of a window with neither tools nor a leading system or developer message:
#: every such window has them, so they tell no conversation from another (no stretch links it).
NO_INSTRUCTIONS = ""

#: ``started``: a new chain; ``continued``: the chain's next window; ``side``: a side request of
#: the chain (other instructions, or a learned side prompt).
Outcome = Literal["started", "continued", "side"]
OUTCOMES: tuple[Outcome, ...] = ("started", "continued", "side")


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


def normalised(text: str) -> str:
    """``text`` with every run of whitespace one space, and none at its ends: what survives an
    agent's trimming and re-wrapping."""
    return " ".join(text.split())


def probes(text: str) -> tuple[str, ...]:
    """Up to ``PROBES`` stretches of ``PROBE_CHARS`` characters of the normalised ``text``, from
    its opening to its end, evenly spread (none for a text shorter than one)."""
    text = normalised(text)
    count = min(PROBES, len(text) // PROBE_CHARS)
    if count == 0:
        return ()
    step = (len(text) - PROBE_CHARS) / max(count - 1, 1)
    return tuple(text[round(i * step) : round(i * step) + PROBE_CHARS] for i in range(count))


#: Joins a window's user messages into one text to search: no stretch holds it (it is not
#: whitespace), so none is found across two messages.
_JOIN = "\x00"


def _found_in(stretches: tuple[str, ...], text: str) -> bool:
    """Whether enough of an answer's ``stretches`` are in ``text``: two (one where it has
    only one)."""
    needed, hits = min(2, len(stretches)), 0
    for left, stretch in zip(range(len(stretches), 0, -1), stretches, strict=True):
        if hits + left < needed:
            return False
        if stretch in text:
            hits += 1
            if hits >= needed:
                return True
    return False


@dataclass(frozen=True, slots=True)
class Answer:
    """What the server answered: its text and its tool calls' ids."""

    text: str = ""
    tool_call_ids: tuple[str, ...] = ()

    def links(self) -> list[str]:
        links = [id_link(i) for i in self.tool_call_ids if i]
        text = text_link(self.text)
        return [*links, text] if text else links

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


#: A user message as linking reads it: its length and its text's link (``""`` when empty).
UserKey = tuple[int, str]


@dataclass(frozen=True, slots=True)
class ChainWindow:
    """What linking reads of a window, and no more (with several API servers it crosses to
    the engine on every id-less request): its instructions' digest (``NO_INSTRUCTIONS`` when
    it has none), the links of each of its assistant messages (in order; an opening one's text
    left out), each user message's ``UserKey``, the text a stretch is searched in (its user
    messages of ``PROBE_CHARS`` or more, joined and normalised, the first ``SCAN_CHARS``
    characters; empty for a window with no instructions, which no stretch links), and whether
    its last message is a user message."""

    instructions: str
    answers: tuple[tuple[str, ...], ...]
    user_keys: tuple[UserKey, ...]
    scan: str = ""
    ends_with_user: bool = False

    @classmethod
    def of(cls, messages: Iterable[Any], tools: Any) -> ChainWindow:
        messages = [m for m in messages if isinstance(m, Mapping)]
        head = 0
        while head < len(messages) and messages[head].get("role") in ("system", "developer"):
            head += 1
        leading = [text_of(m.get("content")) for m in messages[:head]]
        instructions = (
            _digest(json.dumps([tools, leading], sort_keys=True, default=str))
            if tools or leading
            else NO_INSTRUCTIONS
        )
        answers: list[tuple[str, ...]] = []
        user_texts: list[str] = []
        for message in messages[head:]:
            role = message.get("role")
            if role == "assistant":
                calls = message.get("tool_calls") or ()
                ids = [c.get("id") for c in calls if isinstance(c, Mapping)]
                links = [id_link(i) for i in ids if isinstance(i, str) and i]
                # text before any user message (an app's greeting, the same in every chat)
                # answered nothing in this window: it links nothing (a call's id is vLLM's own)
                opening = not user_texts
                text = None if opening else text_link(text_of(message.get("content")))
                answers.append(tuple([*links, text] if text else links))
            elif role == "user":
                user_texts.append(text_of(message.get("content")))
        ends_with_user = len(messages) > head and messages[-1].get("role") == "user"
        long_texts = [t for t in user_texts if len(t) >= PROBE_CHARS]
        scan = (
            normalised(_JOIN.join(_leading(long_texts, SCAN_CHARS)))
            if instructions != NO_INSTRUCTIONS
            else ""
        )
        return cls(
            instructions, tuple(answers), tuple(map(user_key, user_texts)), scan, ends_with_user
        )

    def last_user(self) -> UserKey | None:
        """The ``UserKey`` of the window's last message when it is a user message."""
        return self.user_keys[-1] if self.ends_with_user and self.user_keys else None

    def carries(self, links: Iterable[str]) -> bool:
        """Whether one of its assistant messages has one of ``links``."""
        wanted = set(links)
        return any(link in wanted for answer in self.answers for link in answer)

    def to_wire(self) -> tuple[str, list[list[str]], list[list[Any]], str, bool]:
        return (
            self.instructions,
            [list(a) for a in self.answers],
            [list(k) for k in self.user_keys],
            self.scan,
            self.ends_with_user,
        )

    @classmethod
    def from_wire(cls, wire: Any) -> ChainWindow:
        try:
            instructions, answers, keys, scan, ends_with_user = wire
            window = cls(
                str(instructions),
                tuple(tuple(str(k) for k in a) for a in answers),
                tuple((int(length), str(link)) for length, link in keys),
                str(scan)[:SCAN_CHARS],
                bool(ends_with_user),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not a chain window: {exc}") from None
        return window


def user_key(text: str) -> UserKey:
    """A user message's ``UserKey``."""
    return (len(text), text_link(text) or "")


class _Links:
    """Which chain each (principal, link) was answered in: at most ``most`` entries, in two
    generations of plain dicts keyed by one 64-bit digest (a link recorded or found goes to
    the young one; a full young one becomes the old one, the old one dropped): ~90 bytes a
    link where an ordered dict of (principal, link) strings took ~280, for eviction that is
    least-recently-used within a generation's span."""

    __slots__ = ("_half", "_old", "_young")

    def __init__(self, most: int) -> None:
        self._half = max(1, most // 2)
        self._young: dict[int, str] = {}
        self._old: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    @staticmethod
    def _key(principal: str, link: str) -> int:
        digest = hashlib.blake2b(f"{principal}\x00{link}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    def get(self, principal: str, link: str) -> str | None:
        key = self._key(principal, link)
        chain = self._young.get(key)
        if chain is None:
            chain = self._old.pop(key, None)
            if chain is not None:
                self._put(key, chain)
        return chain

    def record(self, principal: str, link: str, chain: str) -> None:
        """``link`` was answered in ``chain``: in another chain before, it links neither."""
        key = self._key(principal, link)
        known = self._young.get(key)
        if known is None:
            known = self._old.pop(key, None)
        self._put(key, chain if known in (None, chain) else _AMBIGUOUS)

    def _put(self, key: int, chain: str) -> None:
        self._young[key] = chain
        if len(self._young) >= self._half:
            self._old, self._young = self._young, {}


@dataclass(slots=True)
class _Chain:
    """A chain: its instructions' digest, and its last main request's last user message (its
    length and link) and answer's links (``None`` until it is recorded)."""

    instructions: str
    last_user: UserKey | None = None
    answered: tuple[str, ...] | None = None


class AnswerChains:
    """Per principal, which chain each answer the server gave belongs to."""

    def __init__(self, max_chains: int = 100_000, max_links: int | None = None) -> None:
        if max_chains < 1:
            raise ValueError("max_chains must be at least 1")
        self._max_chains = max_chains
        self._max_links = max_links or 8 * max_chains
        self._chains: OrderedDict[str, _Chain] = OrderedDict()
        #: (principal, link) -> chain, or _AMBIGUOUS
        self._links = _Links(self._max_links)
        #: principal -> its last answers' (chain, stretches)
        self._recent: OrderedDict[str, deque[tuple[str, tuple[str, ...]]]] = OrderedDict()
        #: principal -> the links of the side prompts learned (the last MAX_SIDE_PROMPTS)
        self._side_prompts: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()
        self._names = (f"{CHAIN_PREFIX}{secrets.token_hex(4)}-{n}" for n in itertools.count())

    def __len__(self) -> int:
        return len(self._chains)

    def chain_of(self, principal: str, window: ChainWindow) -> tuple[str, Outcome]:
        """The window's chain, and how the window relates to it."""
        found = self._linked(principal, window)
        if found is None:
            chain = next(self._names)
            self._chains[chain] = _Chain(window.instructions, _last_user_key(window))
            self._bound(self._chains, self._max_chains)
            return chain, "started"
        chain, outcome = found
        state = self._chains[chain]
        self._chains.move_to_end(chain)
        if outcome == "continued":
            self._learn_side_prompt(principal, state, window)
            if self._is_side_prompt(principal, window):
                outcome = "side"
            else:
                state.last_user, state.answered = _last_user_key(window), None
        return chain, outcome

    def _linked(self, principal: str, window: ChainWindow) -> tuple[str, Outcome] | None:
        for links in reversed(window.answers):
            found = {
                c for c in (self._links.get(principal, link) for link in links) if c is not None
            }
            if not found:
                continue  # an assistant message this server never wrote
            chain = found.pop() if len(found) == 1 else _AMBIGUOUS
            state = self._chains.get(chain)
            if state is None:
                return None
            return chain, "continued" if state.instructions == window.instructions else "side"
        stretched = self._by_stretch(principal, window)
        return None if stretched is None else (stretched, "continued")

    def _by_stretch(self, principal: str, window: ChainWindow) -> str | None:
        recent = self._recent.get(principal)
        if not recent or not window.scan or window.instructions == NO_INSTRUCTIONS:
            return None
        found = {
            chain
            for chain, stretches in recent
            if chain in self._chains and _found_in(stretches, window.scan)
        }
        if len(found) != 1:
            return None  # none, or two conversations' answers: never joined
        chain = found.pop()
        return chain if self._chains[chain].instructions == window.instructions else None

    def _learn_side_prompt(self, principal: str, state: _Chain, window: ChainWindow) -> None:
        """The chain's last request's answer did not come back and its last user message is
        gone: that message is a side prompt. Answered or not: a request its client gave up on
        (Qwen Code aborts its suggestion when the user types on) or whose answer is recorded
        after the next window came was dropped all the same."""
        if state.last_user is None or (state.answered and window.carries(state.answered)):
            return
        if state.last_user in window.user_keys:
            return
        learned = self._side_prompts.pop(principal, None) or OrderedDict()
        learned[state.last_user[1]] = None
        self._bound(learned, MAX_SIDE_PROMPTS)
        self._side_prompts[principal] = learned
        self._bound(self._side_prompts, self._max_chains)

    def _is_side_prompt(self, principal: str, window: ChainWindow) -> bool:
        learned = self._side_prompts.get(principal)
        last = window.last_user()
        return learned is not None and last is not None and last[1] in learned

    def record(self, principal: str, chain: str, answer: Answer, main: bool = True) -> None:
        """The server answered ``chain``'s request with ``answer`` (``main``: the chain's
        window, not a side request)."""
        state = self._chains.get(chain)
        if state is None:
            return  # forgotten meanwhile
        links = answer.links()
        for link in links:
            self._links.record(principal, link, chain)
        if main:
            state.answered = tuple(links)
        stretches = probes(answer.text)
        if stretches:
            recent = self._recent.pop(principal, None) or deque(maxlen=RECENT_ANSWERS)
            recent.append((chain, stretches))
            self._recent[principal] = recent
            self._bound(self._recent, self._max_chains)

    @staticmethod
    def _bound(table: OrderedDict[Any, Any], most: int) -> None:
        while len(table) > most:
            table.popitem(last=False)


def _leading(texts: list[str], limit: int) -> list[str]:
    """``texts`` up to ``limit`` characters in all, the last one cut."""
    kept, left = [], limit
    for text in texts:
        if left <= 0:
            break
        kept.append(text[:left])
        left -= len(text)
    return kept


def _last_user_key(window: ChainWindow) -> UserKey | None:
    """The window's last user message's key, when it ends with a non-empty one."""
    last = window.last_user()
    return last if last is not None and last[1] else None
