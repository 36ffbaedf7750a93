"""Pure core: compactions told from what coding agents already send, with no hook.

A coding agent that is a binary (Claude Code, the Codex CLI, opencode) never says "release".
It does say enough to know when its window was rewritten, and this module decides it, per
session, from two things:

- **What the agent says.** The Codex CLI names its context window (``x-codex-window-id``,
  ``window_number`` in ``x-codex-turn-metadata``) and each request's kind (``turn``,
  ``compaction``, ``prewarm``, ``memory``, ...). A ``turn`` in a newer window than the session's
  last one is a rewrite, exactly; any other kind is a side branch. Qwen Code (with request
  metadata on) names each request's kind in ``metadata.promptId``: a main turn's is
  ``<session>########<n>``, and its window is then judged by its shape as below; the memory
  extractor, the dreamer, the next-prompt suggestion and the compression request are side
  branches.
- **The window's shape, where the agent says nothing** (Claude Code and unknown agents). The
  session's *main thread* is its last window that carried the session's tools; each new window
  is compared with it message by message:

  - a window without tools, when the main thread has tools, is a **side** branch (Claude
    Code's per-turn side request): it never moves the main thread;
  - a window with tools, when the main thread has none, is the **first** of the main thread:
    what came before was a side branch that reached the server first (nothing released);
  - a window that keeps every message of the main thread is an **append** (a tool loop, a new
    turn, Claude Code's compaction request itself, which appends its summary instruction); so
    is one that changes or moves only the old window's trailing instructions (system or
    developer messages after its last conversational one, such as Claude Code's environment
    block on its first turn);
  - a window whose first change is the old window's last conversational message, and that
    holds at most one conversational message from there on, is a **retry** (Claude Code
    re-sends a changed last user message when an answer had no visible text, its environment
    block after it unchanged; a chat UI's edited last message): the next window decides which
    one the thread continues, so nothing is released; so is the same window again (a chat
    UI's regenerated answer, a client's retried call);
  - anything else drops or changes an earlier message, or moves on past the changed one: a
    **rewrite** (a compaction's new window, a rewind, a masked tool result; opencode's
    compaction right after a session's first turn, whose new window keeps only the
    instructions and goes on with the summary). The main thread's blocks that the new window
    cannot hit are dead; so is a side branch that carried the old conversation, past its own
    instructions and what the new window still carries (``PoolAffinity.release_rewritten``).

Messages are compared as canonical digests: content given as text parts equals the same text
given as a string, and ``cache_control`` marks (which agents move to the newest message every
turn) are ignored. Memory: one 8-byte digest per message of each tracked session's main
thread, at most ``max_sessions`` sessions (least recently seen first out).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from jiuwen_kv_protocol.headers import CODEX_METADATA_HEADER, CODEX_WINDOW_HEADER

from .tokens import common_prefix_length

#: ``first``: the session's first window; ``append``, ``retry``: nothing is dead yet;
#: ``rewrite``: the main thread's old window is dead from where the new one differs;
#: ``side``: a branch that leaves the main thread as it is.
Verdict = Literal["first", "append", "retry", "rewrite", "side"]
VERDICTS: tuple[Verdict, ...] = ("first", "append", "retry", "rewrite", "side")

#: Request kinds of the Codex CLI that continue its main thread.
CODEX_MAIN_KIND = "turn"
#: Qwen Code's ``metadata.promptId`` of a main turn: ``<session>########<n>``; any other
#: (``…#managed-auto-memory-extractor-…``, ``…-dreamer-…``, ``forked_query``, ``compress-<ms>``)
#: is a side request.
QWEN_MAIN_SEPARATOR = "########"
#: Joins a session and its side branch in the engine's session key: the side branch's blocks
#: are its own record, so it never replaces the main thread's (a header value cannot hold it).
BRANCH_SEPARATOR = "\x1f"
SIDE_BRANCH = "side"
#: Chat roles whose messages are instructions, not conversation (the server's instruction
#: lengths read them too; as ``jiuwen_hooks._diff.head_length``).
INSTRUCTION_ROLES = frozenset({"system", "developer"})
#: Content part types that are plain text, whatever the API calls them.
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
#: Keys that say how to cache a message, not what it says.
_IGNORED_KEYS = frozenset({"cache_control"})


#: The branch a retry replaced, kept until the next window says which one the thread continues.
RETRIED_BRANCH = "retried"


def side_branch(session: str) -> str:
    """The engine's key for ``session``'s side branch."""
    return f"{session}{BRANCH_SEPARATOR}{SIDE_BRANCH}"


def retried_branch(session: str) -> str:
    """The engine's key for the main-thread window a retry of ``session`` replaced."""
    return f"{session}{BRANCH_SEPARATOR}{RETRIED_BRANCH}"


def owner_of(session: str) -> str:
    """The session a branch key belongs to (a plain session is its own)."""
    return session.split(BRANCH_SEPARATOR, 1)[0]


#: A window on the wire: whether it carries tools, its digests and its instruction marks.
WindowWire = tuple[bool, bytes, bytes]


@dataclass(frozen=True, slots=True)
class Window:
    """What the rule compares: whether the window carries tools, its messages' digests and
    which of them are instructions (1 for a system or developer message, else 0)."""

    has_tools: bool
    messages: array[int]
    instructions: bytes = b""

    def __post_init__(self) -> None:
        if self.instructions and len(self.instructions) != len(self.messages):
            raise ValueError("one instruction mark per message is needed")

    @classmethod
    def of(cls, messages: Iterable[Any], tools: Any, memo: DigestMemo | None = None) -> Window:
        """``memo``: digests of messages seen before (an agent resends its whole window each
        turn), so that only the new ones are serialised and hashed."""
        messages = list(messages)
        marks = bytes(_role(m) in INSTRUCTION_ROLES for m in messages)
        digest_of = memo.digest if memo is not None else digest
        return cls(bool(tools), array("Q", (digest_of(m) for m in messages)), marks)

    def is_instruction(self, index: int) -> bool:
        return bool(self.instructions) and bool(self.instructions[index])

    def to_wire(self) -> WindowWire:
        """The window as an engine utility's argument (msgpack carries bytes as they are)."""
        return (self.has_tools, self.messages.tobytes(), self.instructions)

    @classmethod
    def from_wire(cls, wire: Any) -> Window:
        """The window ``to_wire`` gave; ``ValueError`` for anything else."""
        try:
            has_tools, digests, marks = wire
            messages = array("Q")
            messages.frombytes(bytes(digests))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not a window: {exc}") from None
        return cls(bool(has_tools), messages, bytes(marks))


def _role(message: Any) -> Any:
    if isinstance(message, Mapping):
        return message.get("role")
    return getattr(message, "role", None)


@dataclass(frozen=True, slots=True)
class AgentWindow:
    """What the Codex CLI says of a request: its kind and its context window's number."""

    kind: str
    number: int | None

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> AgentWindow | None:
        """From ``x-codex-turn-metadata`` (JSON) and ``x-codex-window-id`` (``<thread>:<n>``);
        ``None`` when neither says anything usable (an agent's malformed header is not an
        error to its call: the shape rule takes over)."""
        kind, number = None, None
        raw = headers.get(CODEX_METADATA_HEADER)
        if raw:
            try:
                meta = json.loads(raw)
            except ValueError:
                meta = None
            if isinstance(meta, dict):
                if isinstance(meta.get("request_kind"), str):
                    kind = meta["request_kind"]
                if isinstance(meta.get("window_number"), int):
                    number = meta["window_number"]
        suffix = (headers.get(CODEX_WINDOW_HEADER) or "").rpartition(":")[2]
        if number is None and suffix.isdigit():
            number = int(suffix)
        if kind is None:
            return None
        return cls(kind, number)

    def to_wire(self) -> tuple[str, int | None]:
        return (self.kind, self.number)

    @classmethod
    def from_wire(cls, wire: Any) -> AgentWindow | None:
        """What ``to_wire`` gave (``None``: the agent said nothing); ``ValueError`` else."""
        if wire is None:
            return None
        try:
            kind, number = wire
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not an agent window: {exc}") from None
        if not isinstance(kind, str) or not (number is None or isinstance(number, int)):
            raise ValueError("not an agent window: a kind and a number or None")
        return cls(kind, number)

    @classmethod
    def from_qwen_prompt_id(cls, prompt_id: str) -> AgentWindow:
        """Qwen Code's request kind, from its ``metadata.promptId``: a main turn (whose window
        has no number: its shape decides) or a side request."""
        _, separator, turn = prompt_id.partition(QWEN_MAIN_SEPARATOR)
        main = bool(separator) and turn.isdigit()
        return cls(CODEX_MAIN_KIND if main else SIDE_BRANCH, None)


def digest(message: Any) -> int:
    """A message's canonical digest (see the module's docstring)."""
    text = json.dumps(_canonical(message), sort_keys=True, separators=(",", ":"), default=str)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class DigestMemo:
    """Digests of messages seen before, keyed by Python's own hash of the message: a message
    of a role and a text (most of a window: user and assistant text, and system prompts) costs
    a hash of its text, not a serialisation and a BLAKE2b. Any other message is digested in
    full. At most ``max_entries`` (oldest out first); the text's length is checked too, so a
    hash collision must also match in length to give a wrong digest."""

    def __init__(self, max_entries: int = 65_536) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._entries: dict[int, tuple[int, int]] = {}
        self._max = max_entries

    def __len__(self) -> int:
        return len(self._entries)

    def digest(self, message: Any) -> int:
        if type(message) is not dict or len(message) != 2:
            return digest(message)
        role, content = message.get("role"), message.get("content")
        if type(role) is not str or type(content) is not str:
            return digest(message)
        key = hash((role, content))
        known = self._entries.get(key)
        if known is not None and known[1] == len(content):
            return known[0]
        value = digest(message)
        self._entries[key] = (value, len(content))
        if len(self._entries) > self._max:
            del self._entries[next(iter(self._entries))]
        return value


def _canonical(value: Any) -> Any:
    if hasattr(value, "model_dump"):  # a pydantic item (vLLM's Responses input)
        value = value.model_dump(exclude_none=True)
        # vLLM gives an output message the client sent without an id a random one (and a
        # status): neither is rendered, and the same message must digest the same every turn
        value.pop("id", None)
        value.pop("status", None)
    if isinstance(value, Mapping):
        return {
            k: _canonical(v) for k, v in value.items() if k not in _IGNORED_KEYS and v is not None
        }
    if isinstance(value, list | tuple):
        parts = [_canonical(v) for v in value]
        if parts and all(
            isinstance(p, dict) and p.get("type") in _TEXT_PARTS and set(p) <= {"type", "text"}
            for p in parts
        ):
            return "".join(str(p.get("text", "")) for p in parts)
        return parts
    return value


@dataclass(slots=True)
class _Thread:
    window: Window
    number: int | None = None  # the agent's own window number, when it says one


class CompactionRule:
    """Per session, the main thread's last window, and the verdict on each new one."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self._threads: OrderedDict[str, _Thread] = OrderedDict()
        self._max_sessions = max_sessions

    def __len__(self) -> int:
        return len(self._threads)

    def classify(self, session: str, window: Window, agent: AgentWindow | None = None) -> Verdict:
        """The verdict on ``session``'s new ``window``; the main thread moves to it unless it
        is a side branch."""
        thread = self._threads.get(session)
        verdict = _by_agent(thread, agent, window) if agent else _by_shape(thread, window)
        if verdict != "side":
            number = agent.number if agent is not None else None
            if thread is not None and number is None:
                number = thread.number
            self._threads[session] = _Thread(window, number)
        if session in self._threads:
            self._threads.move_to_end(session)
        while len(self._threads) > self._max_sessions:
            self._threads.popitem(last=False)
        return verdict

    def forget(self, session: str) -> None:
        self._threads.pop(session, None)


def _by_agent(thread: _Thread | None, agent: AgentWindow, window: Window) -> Verdict:
    """The agent's kind decides side or main; a main turn's window number, when it and the
    thread's are known, decides a rewrite; without numbers the window's shape does."""
    if agent.kind != CODEX_MAIN_KIND:
        return "side"
    if thread is None:
        return "first"
    if agent.number is None or thread.number is None:
        return _by_shape(thread, window)
    return "rewrite" if agent.number > thread.number else "append"


def _by_shape(thread: _Thread | None, window: Window) -> Verdict:
    if thread is None:
        return "first"
    old = thread.window
    if old.has_tools and not window.has_tools:
        return "side"
    if window.has_tools and not old.has_tools:
        return "first"  # the main thread starts: what came before it was a side branch
    kept = common_prefix_length(old.messages, window.messages)
    if kept == len(old.messages) == len(window.messages):
        return "retry"  # the same window again: its answer regenerated
    dropped = range(kept, len(old.messages))
    if all(old.is_instruction(i) for i in dropped):  # all kept, trailing instructions aside
        return "append"
    if kept == _last_conversational(old) and _conversational(window, kept) <= 1:
        return "retry"
    return "rewrite"


def _last_conversational(window: Window) -> int:
    """The index of the window's last message that is not an instruction (-1: none)."""
    for index in range(len(window.messages) - 1, -1, -1):
        if not window.is_instruction(index):
            return index
    return -1


def _conversational(window: Window, start: int) -> int:
    """How many of the window's messages from ``start`` on are not instructions."""
    return sum(not window.is_instruction(i) for i in range(start, len(window.messages)))
