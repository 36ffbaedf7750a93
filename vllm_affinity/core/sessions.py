"""Pure core: which sessions use which KV blocks (no vLLM import).

``owners``: block id → sessions whose requests used the block (allocated or prefix-hit).
``latest``: session → the block ids of its latest request, in token order (prompt blocks,
generated-token blocks and the partial tail alike), with that request's prompt length.

A release by session S from block index b walks ``latest[S][b:]``: S stops owning each block;
a block nobody else owns is returned for release, one still owned by another session is kept.
A block that is reused for new content is unbound, so owners never go stale.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class SessionRecord:
    block_ids: list[int]
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class ReleaseSelection:
    """Outcome of a release request on the session table."""

    block_ids: list[int] = field(default_factory=list)  # nobody else uses them: release
    kept_shared: int = 0  # still used by another session
    status: str = "ok"  # "ok" | "unknown_session" | "record_mismatch"


class SessionBlocks:
    """Bounded session → blocks table with per-block owner sets."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        self.owners: dict[int, set[str]] = {}
        self.latest: OrderedDict[str, SessionRecord] = OrderedDict()
        self._max_sessions = max_sessions

    def record(self, session: str, block_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The session's latest request now holds exactly ``block_ids`` (token order)."""
        self.latest[session] = SessionRecord(list(block_ids), num_prompt_tokens)
        self.latest.move_to_end(session)
        while len(self.latest) > self._max_sessions:
            self.latest.popitem(last=False)

    def bind(self, session: str, block_ids: Iterable[int]) -> None:
        """The session's request started using these blocks (new or prefix hits)."""
        for block_id in block_ids:
            self.owners.setdefault(block_id, set()).add(session)

    def unbind(self, block_ids: Iterable[int]) -> None:
        """These blocks are being reused for new content: nobody owns the old content."""
        for block_id in block_ids:
            self.owners.pop(block_id, None)

    def select_release(self, session: str, first_block: int) -> ReleaseSelection:
        """Blocks to release for ``session`` from block index ``first_block`` of its latest
        request."""
        record = self.latest.get(session)
        if record is None:
            return ReleaseSelection(status="unknown_session")
        released: list[int] = []
        kept = 0
        for block_id in record.block_ids[first_block:]:
            owners = self.owners.get(block_id)
            if owners is None or session not in owners:
                continue  # already released by this session, or reused since
            owners.discard(session)
            if owners:
                kept += 1
            else:
                del self.owners[block_id]
                released.append(block_id)
        return ReleaseSelection(released, kept)
