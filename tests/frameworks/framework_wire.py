"""What a framework put on the wire, read from the ``LocalEngine``'s records, independently of the
hook's own diff."""

from __future__ import annotations

import itertools
from typing import Any

from jiuwen_hooks.testing import LocalEngine, RecordedRequest


def window_of(request: RecordedRequest) -> list[Any]:
    """The window a request sent, as the wire shows it: chat ``messages``, Responses
    ``instructions`` (as item 0) and ``input``, or Anthropic ``system`` (item 0) and
    ``messages``."""
    body = request.body
    if request.path.startswith("/v1/messages"):  # Anthropic: system is item 0
        return ([{"system": body["system"]}] if body.get("system") else []) + body["messages"]
    if "messages" in body:
        return list(body["messages"])
    items = body["input"]
    items = [{"role": "user", "content": items}] if isinstance(items, str) else list(items)
    return ([{"instructions": body["instructions"]}] if body.get("instructions") else []) + items


def expected_releases(engine: LocalEngine, session: str) -> list[int]:
    """For each pair of consecutive model requests of ``session``: the first window index whose
    item changed, when one did (a pure append releases nothing)."""
    sent = [c for c in engine.chats if c.headers.get("x-session-id") == session]
    out = []
    for old, new in itertools.pairwise(sent):
        a, b = window_of(old), window_of(new)
        changed = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if changed is None and len(b) < len(a):
            changed = len(b)
        if changed is not None:
            out.append(changed)
    return out


def released(engine: LocalEngine, session: str) -> list[int]:
    return [
        r.body["messages_released_index"]
        for r in engine.releases
        if r.headers.get("x-session-id") == session
    ]


def assert_releases(engine: LocalEngine, session: str, count: int) -> None:
    """The hook released exactly where the framework's windows changed, ``count`` times."""
    expected = expected_releases(engine, session)
    assert len(expected) == count, expected  # the framework really rewrote its window
    assert released(engine, session) == expected
