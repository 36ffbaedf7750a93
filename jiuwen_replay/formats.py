"""Trace files in, ``Trace`` out: the project's own format and three public ones.

- ``project``: JSON lines; a header ``{"format": "jiuwen-trace", "version": 1, "block_tokens":
  N}``, then one request a line ``{"session", "at", "blocks", "output_tokens"[, "parent",
  "input_tokens"]}``. ``write_project`` writes it; ``synthetic.py`` makes one.
- ``mooncake`` (the Mooncake FAST'25 traces): ``{"timestamp" (ms), "input_length",
  "output_length", "hash_ids"}`` a line, 512-token blocks, no session ids. A request whose ids
  extend a session's latest prompt is that session's next turn (also when only its last block
  changed, if that block was partial: ``input_length`` not a multiple of 512, so the answer
  filled it; at least two blocks in common, as the system prompt every session shares is one);
  anything else starts a session. A rewrite is never guessed: a request that keeps only part of
  a prompt may be another conversation with the same start, and releasing on a guess would drop
  what that conversation still reads.
- ``agentx``: one session a line ``{"id", "block_size", "hash_id_scope": "local", "requests":
  [{"t", "in", "out", "hash_ids", ...} | {"type": "subagent", "agent_id", "requests": [...]}]}``.
  Ids are local to a line (the lead and its subagents share them), so they are made unique per
  line; ``t`` counts from the session's first request and every session starts at 0.
- ``agentinfer`` (the Claude Code trace that ``agentinfer`` ships: per request ``session_id``,
  ``actor_id``, ``actor_role``, ``started_at``, ``input_tokens``, ``output_tokens``): token counts
  only, so blocks are made up. Every lead starts with the same system prompt and so does every
  subagent (as long as the shortest first prompt of that role); a prompt that grew appends new
  blocks; one that shrank was compacted (the system prompt stays, the rest is new). Each actor is
  a session of its own; a subagent names its lead as parent. Failed requests are dropped.

Every reader raises ``TraceFormatError`` naming the file and line on bad input.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from vllm_affinity.core import common_prefix_length

from .trace import Trace, TraceRequest

FORMATS = ("project", "agentx", "mooncake", "agentinfer")
PROJECT_HEADER = {"format": "jiuwen-trace", "version": 1}
MOONCAKE_BLOCK_TOKENS = 512
#: Block size the ``agentinfer`` reader makes its blocks of.
AGENTINFER_BLOCK_TOKENS = 128


class TraceFormatError(ValueError):
    """A trace file that does not read as its format says."""


def read_trace(path: str | Path, fmt: str) -> Trace:
    """Read ``path`` as ``fmt`` (one of ``FORMATS``)."""
    readers: dict[str, Callable[[Path], Trace]] = {
        "project": read_project,
        "agentx": read_agentx,
        "mooncake": read_mooncake,
        "agentinfer": read_agentinfer,
    }
    if fmt not in readers:
        raise TraceFormatError(f"unknown trace format {fmt!r}; expected one of {FORMATS}")
    path = Path(path)
    if not path.is_file():
        raise TraceFormatError(f"{path}: no such file")
    trace = readers[fmt](path)
    if not trace.requests:
        raise TraceFormatError(f"{path}: no requests in this {fmt} trace")
    return trace


def agentinfer_trace_path() -> Path:
    """The Claude Code trace inside the installed ``agentinfer`` package."""
    from importlib.util import find_spec

    spec = find_spec("agentinfer")
    if spec is None or not spec.submodule_search_locations:
        raise TraceFormatError(
            "the agentinfer package is not installed: pip install 'agentinfer==0.2.0', "
            "or give --trace PATH"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    return root / "agentbench" / "data" / "agentinfer_trace_requests.jsonl"


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise TraceFormatError(f"{path}:{number}: expected a JSON object")
            yield number, row


def _field(row: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = row.get(name)
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if ok and isinstance(value, (int, float)):
        ok = math.isfinite(value) and value >= 0
    if not ok:
        raise TraceFormatError(f"{where}: {name!r} missing or invalid ({value!r})")
    return value


def _ids(row: dict[str, Any], name: str, where: str) -> list[int]:
    ids = row.get(name)
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise TraceFormatError(f"{where}: {name!r} must be a non-empty list of integers")
    return ids


def _in_time_order(requests: list[TraceRequest]) -> tuple[TraceRequest, ...]:
    return tuple(sorted(requests, key=lambda r: r.at))


# --- project ---------------------------------------------------------------------------------


def read_project(path: Path) -> Trace:
    rows = _lines(path)
    first = next(rows, None)
    if first is None or {k: first[1].get(k) for k in PROJECT_HEADER} != PROJECT_HEADER:
        raise TraceFormatError(f"{path}:1: expected the header {json.dumps(PROJECT_HEADER)}")
    block_tokens = _field(first[1], "block_tokens", int, f"{path}:1")
    requests = []
    for number, row in rows:
        where = f"{path}:{number}"
        parent = row.get("parent")
        if parent is not None and not isinstance(parent, str):
            raise TraceFormatError(f"{where}: 'parent' must be a string")
        requests.append(
            TraceRequest(
                session=_field(row, "session", str, where),
                at=float(_field(row, "at", (int, float), where)),
                blocks=tuple(_ids(row, "blocks", where)),
                output_tokens=_field(row, "output_tokens", int, where),
                parent=parent,
                input_tokens=row.get("input_tokens"),
                instructions=_instructions(row, where),
            )
        )
    return Trace("project", block_tokens, _in_time_order(requests), str(path))


def _instructions(row: dict[str, Any], where: str) -> int:
    """A row's leading instruction blocks (optional; 0: not known)."""
    value = row.get("instructions", 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceFormatError(f"{where}: 'instructions' must be a count of blocks (0 or more)")
    return value


def write_project(trace: Trace, path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as out:
        out.write(json.dumps({**PROJECT_HEADER, "block_tokens": trace.block_tokens}) + "\n")
        for r in trace.requests:
            row: dict[str, Any] = {
                "session": r.session,
                "at": round(r.at, 3),
                "blocks": list(r.blocks),
                "output_tokens": r.output_tokens,
            }
            if r.parent is not None:
                row["parent"] = r.parent
            if r.input_tokens is not None:
                row["input_tokens"] = r.input_tokens
            if r.instructions:
                row["instructions"] = r.instructions
            out.write(json.dumps(row) + "\n")


# --- mooncake --------------------------------------------------------------------------------


class _SessionFinder:
    """Which earlier conversation a Mooncake request continues or rewrites (see the module)."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[int, ...]] = {}
        self.partial: dict[str, bool] = {}  # whether a session's latest prompt ends mid-block
        #: Prefix chain key of every prefix (2 blocks and longer) of each session's latest
        #: prompt → that session (the last one to have it).
        self.by_prefix: dict[int, str] = {}
        self.whole: dict[int, str] = {}  # chain key of a whole latest prompt → its session
        self.counter = itertools.count()
        self.inferred = {"continued": 0, "started": 0}

    @staticmethod
    def _chain(ids: tuple[int, ...]) -> list[int]:
        keys, key = [], 0
        for i in ids:
            key = hash((key, i))
            keys.append(key)
        return keys

    def session_of(self, ids: tuple[int, ...], partial: bool = True) -> str:
        """The session of a prompt with block ids ``ids`` (``partial``: its last block is not
        full, so the next turn changes it)."""
        chain = self._chain(ids)
        session = None
        for k in range(len(ids), 1, -1):  # the longest earlier prompt this one extends
            candidate = self.whole.get(chain[k - 1])
            if candidate is not None and self.latest[candidate] == ids[:k]:
                session, kind = candidate, "continued"
                break
        if session is None:
            for k in range(len(ids), 1, -1):  # the longest shared prefix with a latest prompt
                candidate = self.by_prefix.get(chain[k - 1])
                if candidate is None:
                    continue
                before = self.latest[candidate]
                shared = common_prefix_length(before, ids)
                # All but a partial last block kept and more added: the next turn. Anything
                # else that shares a prefix may be another conversation with the same start
                # (a shared system prompt and first message): a new session, never a guessed
                # rewrite, whose release would drop what that other conversation still reads.
                grew = shared == len(before) - 1 and len(ids) >= len(before)
                if shared >= 2 and grew and self.partial[candidate]:
                    session, kind = candidate, "continued"
                    break
        if session is None:
            session, kind = f"s{next(self.counter)}", "started"
        self.inferred[kind] += 1
        before = self.latest.get(session)
        if before is not None:
            self.whole.pop(self._chain(before)[-1], None)
        self.latest[session] = ids
        self.partial[session] = partial
        self.whole[chain[-1]] = session
        for key in chain[1:]:
            self.by_prefix[key] = session
        return session


def read_mooncake(path: Path) -> Trace:
    finder = _SessionFinder()
    requests = []
    rows = sorted(_lines(path), key=lambda nr: (nr[1].get("timestamp", 0), nr[0]))
    for number, row in rows:
        where = f"{path}:{number}"
        ids = tuple(_ids(row, "hash_ids", where))
        length = _field(row, "input_length", int, where)
        requests.append(
            TraceRequest(
                session=finder.session_of(ids, length % MOONCAKE_BLOCK_TOKENS != 0),
                at=_field(row, "timestamp", (int, float), where) / 1000.0,
                blocks=ids,
                output_tokens=_field(row, "output_length", int, where),
                input_tokens=length,
            )
        )
    notes = {"sessions_inferred": finder.inferred}
    return Trace("mooncake", MOONCAKE_BLOCK_TOKENS, tuple(requests), str(path), notes)


def write_mooncake(trace: Trace, path: str | Path) -> None:
    """Mooncake's shape: sessions and parents are dropped, as in the published traces; lengths
    in Mooncake's 512-token blocks (the reader's unit), so a full last block stays full."""
    scale = MOONCAKE_BLOCK_TOKENS / trace.block_tokens
    with Path(path).open("w", encoding="utf-8") as out:
        for r in trace.requests:
            tokens = r.input_tokens or len(r.blocks) * trace.block_tokens
            length = round(tokens * scale)
            row = {
                "timestamp": round(r.at * 1000),
                "input_length": length,
                "output_length": r.output_tokens,
                "hash_ids": list(r.blocks),
            }
            out.write(json.dumps(row) + "\n")


# --- agentx ----------------------------------------------------------------------------------


def read_agentx(path: Path) -> Trace:
    requests: list[TraceRequest] = []
    block_tokens: int | None = None
    for number, row in _lines(path):
        where = f"{path}:{number}"
        name = _field(row, "id", str, where)
        size = _field(row, "block_size", int, where)
        if block_tokens not in (None, size):
            raise TraceFormatError(f"{where}: block_size {size} differs from {block_tokens}")
        block_tokens = size
        if row.get("hash_id_scope", "local") != "local":
            raise TraceFormatError(f"{where}: only hash_id_scope 'local' is supported")
        groups = row.get("requests")
        if not isinstance(groups, list) or not groups:
            raise TraceFormatError(f"{where}: 'requests' must be a non-empty list")
        flat: list[tuple[dict[str, Any], str, str | None]] = []
        for group in groups:
            if not isinstance(group, dict):
                raise TraceFormatError(f"{where}: every request must be an object")
            if group.get("type") == "subagent":
                agent = _field(group, "agent_id", str, where)
                inner = group.get("requests")
                if not isinstance(inner, list) or not inner:
                    raise TraceFormatError(f"{where}: subagent {agent!r} has no requests")
                flat += [(r, f"{name}/{agent}", name) for r in inner]
            else:
                flat.append((group, name, None))
        origin = min(_field(r, "t", (int, float), where) for r, _, _ in flat)
        offset = number << 32  # ids are local to the line
        for r, session, parent in flat:
            ids = _ids(r, "hash_ids", where)
            requests.append(
                TraceRequest(
                    session=session,
                    at=float(r["t"]) - origin,
                    blocks=tuple(offset + i for i in ids),
                    output_tokens=_field(r, "out", int, where),
                    parent=parent,
                    input_tokens=_field(r, "in", int, where),
                )
            )
    return Trace("agentx", block_tokens or 1, _in_time_order(requests), str(path))


def write_agentx(trace: Trace, path: str | Path) -> None:
    """One line per lead session, its subagents nested (sessions with a parent)."""
    leads: dict[str, list[dict[str, Any]]] = {}
    subagents: dict[str, dict[str, Any]] = {}
    for r in trace.requests:
        item = {
            "t": round(r.at, 3),
            "api_time": 0.0,
            "in": r.input_tokens or len(r.blocks) * trace.block_tokens,
            "out": r.output_tokens,
            "model": "replay",
            "hash_ids": list(r.blocks),
        }
        if r.parent is None:
            leads.setdefault(r.session, []).append(item)
            continue
        group = subagents.get(r.session)
        if group is None:
            agent = r.session.removeprefix(f"{r.parent}/")
            group = {"type": "subagent", "agent_id": agent, "requests": []}
            subagents[r.session] = group
            leads.setdefault(r.parent, []).append(group)
        group["requests"].append(item)
    with Path(path).open("w", encoding="utf-8") as out:
        for name, items in leads.items():
            row = {
                "id": name,
                "block_size": trace.block_tokens,
                "hash_id_scope": "local",
                "requests": items,
            }
            out.write(json.dumps(row) + "\n")


# --- agentinfer ------------------------------------------------------------------------------


def read_agentinfer(path: Path, block_tokens: int = AGENTINFER_BLOCK_TOKENS) -> Trace:
    rows = []
    dropped = 0
    for number, row in _lines(path):
        where = f"{path}:{number}"
        if row.get("status", "success") != "success":
            dropped += 1
            continue
        started = _field(row, "started_at", str, where)
        try:
            at = datetime.fromisoformat(started).timestamp()
        except ValueError:
            raise TraceFormatError(f"{where}: 'started_at' is not an ISO time") from None
        actor = _field(row, "actor_id", str, where)
        session = _field(row, "session_id", str, where)
        role = row.get("actor_role", "lead" if actor == "lead" else "subagent")
        tokens = _field(row, "input_tokens", int, where)
        out = row.get("output_tokens") or 0
        rows.append((at, number, session, actor, role, tokens, out))
    rows.sort()
    origin = rows[0][0] if rows else 0.0
    # The shortest first prompt of each role is its shared system prompt.
    firsts: dict[tuple[str, str], int] = {}
    for _, _, session, actor, _, tokens, _ in rows:
        firsts.setdefault((session, actor), tokens)
    roles = {(s, a): r for _, _, s, a, r, _, _ in rows}
    system_blocks = {}
    for role in set(roles.values()):
        shortest = min(t for key, t in firsts.items() if roles[key] == role)
        system_blocks[role] = max(1, shortest // block_tokens)
    fresh = itertools.count(1 << 40)
    shared = {role: tuple(next(fresh) for _ in range(n)) for role, n in system_blocks.items()}
    windows: dict[tuple[str, str], tuple[int, ...]] = {}
    requests = []
    compactions = 0
    for at, _, session, actor, role, tokens, out in rows:
        want = max(len(shared[role]), math.ceil(tokens / block_tokens))
        before = windows.get((session, actor))
        if before is None:
            blocks = shared[role]
        elif want >= len(before):
            blocks = before
        else:  # the prompt shrank: compacted
            compactions += 1
            blocks = shared[role]
        blocks = blocks + tuple(next(fresh) for _ in range(want - len(blocks)))
        windows[(session, actor)] = blocks
        name = session if actor == "lead" else f"{session}/{actor}"
        requests.append(
            TraceRequest(
                session=name,
                at=at - origin,
                blocks=blocks,
                output_tokens=out,
                parent=None if actor == "lead" else session,
                input_tokens=tokens,
                instructions=len(shared[role]),
            )
        )
    notes = {
        "dropped_failed": dropped,
        "compactions": compactions,
        "system_blocks": dict(sorted(system_blocks.items())),
    }
    return Trace("agentinfer", block_tokens, tuple(requests), str(path), notes)


def write_agentinfer(trace: Trace, path: str | Path) -> None:
    """Token counts only, as the agentinfer trace has (block ids are lost)."""
    epoch = 1_700_000_000.0
    with Path(path).open("w", encoding="utf-8") as out:
        for index, r in enumerate(trace.requests):
            lead = r.parent or r.session
            row = {
                "request_id": f"r{index}",
                "session_id": lead,
                "actor_id": "lead" if r.parent is None else r.session.removeprefix(f"{lead}/"),
                "actor_role": "lead" if r.parent is None else "subagent",
                "started_at": datetime.fromtimestamp(epoch + r.at).astimezone().isoformat(),
                "status": "success",
                "input_tokens": r.input_tokens or len(r.blocks) * trace.block_tokens,
                "output_tokens": r.output_tokens,
            }
            out.write(json.dumps(row) + "\n")


WRITERS: dict[str, Callable[[Trace, str | Path], None]] = {
    "project": write_project,
    "agentx": write_agentx,
    "mooncake": write_mooncake,
    "agentinfer": write_agentinfer,
}
