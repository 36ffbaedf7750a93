"""Pure core: openJiuwen's ``agent_hint`` body field (openJiuwen >= 0.1.19), validated.

Every chat request of an openJiuwen agent in ``kv_cache.mode = "affinity"`` carries

    "agent_hint": {"session_id": "s", "parent_session_id": "p"}

and a KV-cache action is a chat request of its own over the *old* window, marked
``manage_request``, whose edits name half-open ranges of that window:

    "agent_hint": {"session_id": "s", "parent_session_id": "p",
                   "context_management": {"manage_request": true, "edits": [
                       {"type": "evict", "target": "messages", "start": 4, "end": 9},
                       {"type": "evict", "target": "tools", "start": 1, "end": 2}]}}

In a prefix cache every token after the first changed one is stale, so an edit's ``end`` does
not matter here: an action maps to "the session's cache from message ``start`` (and tool
``start``) on", which is exactly what ``/release_kv_cache`` says with its two indices.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Action = Literal["evict", "offload", "prefetch"]


class AgentHintError(ValueError):
    """A malformed ``agent_hint``; the message says what is wrong."""


class Edit(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Action
    target: Literal["messages", "tools", "session"]
    start: int | None = Field(default=None, ge=0)
    end: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _range_fits_target(self) -> Edit:
        if self.target == "session":
            if self.start is not None or self.end is not None:
                raise ValueError("a session edit takes no start/end")
        elif self.start is None or self.end is None or self.start >= self.end:
            raise ValueError(f"a {self.target} edit needs a half-open range start < end")
        return self


class ContextManagement(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    manage_request: bool
    edits: list[Edit] = Field(min_length=1, max_length=2)

    @model_validator(mode="after")
    def _one_action(self) -> ContextManagement:
        if len({edit.type for edit in self.edits}) > 1:
            raise ValueError("all edits of one request must be the same action")
        targets = [edit.target for edit in self.edits]
        if len(set(targets)) != len(targets):
            raise ValueError("at most one edit per target")
        if "session" in targets and len(targets) > 1:
            raise ValueError("a session edit stands alone")
        return self


class AgentHint(BaseModel):
    """``agent_hint``. Unknown keys are ignored (newer SDKs may add some)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    session_id: str = Field(min_length=1, max_length=512)
    parent_session_id: str | None = Field(default=None, min_length=1, max_length=512)
    context_management: ContextManagement | None = None

    @property
    def manage_request(self) -> bool:
        return self.context_management is not None and self.context_management.manage_request

    @property
    def action(self) -> Action | None:
        cm = self.context_management
        return cm.edits[0].type if cm is not None else None

    def start_of(self, target: Literal["messages", "tools", "session"]) -> int | None:
        """The first stale index of ``target`` (``None`` when no edit names it)."""
        cm = self.context_management
        for edit in cm.edits if cm is not None else ():
            if edit.target == target:
                return edit.start if edit.start is not None else 0
        return None

    @classmethod
    def parse(cls, value: object) -> AgentHint:
        if not isinstance(value, dict):
            raise AgentHintError(f"agent_hint must be an object, got {type(value).__name__}")
        try:
            hint = cls.model_validate(value)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'agent_hint'}: {e['msg']}"
                for e in exc.errors()
            )
            raise AgentHintError(f"invalid agent_hint: {problems}") from None
        cm = hint.context_management
        if cm is not None and not cm.manage_request:
            raise AgentHintError(
                "invalid agent_hint: context_management edits are only acted on with "
                "manage_request: true (a request of their own, not an inference)"
            )
        return hint
