"""The wire contract as pydantic models: what a release request says, what one engine core
answers, and what a client may rely on in a 200 answer. No vLLM and no FastAPI import, so the
hook's classification and the test server use these too; ``docs/contract.md`` is checked
against them (``tests/unit/test_docs_contract.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: The paths a release reaches the engine by (``releases_<mode>``, ``block_released_<mode>``).
ReleaseMode = Literal["post", "in_request", "divergence", "agent_hint", "child_end", "compaction"]
#: One engine's release outcome; ``mixed``: engines of one data-parallel server disagreed.
ReleaseStatus = Literal["ok", "unknown_session", "record_mismatch", "mixed"]
#: One engine's idle-signal outcome (``running``: the session's next request came first;
#: ``returns_soon``: its last absence ended before LRU would have reused its blocks, so the
#: signal is not acted on: ``vllm_affinity/core/idle_guard.py``).
IdleStatus = Literal["ok", "unknown_session", "running", "returns_soon"]


def _counter_names() -> frozenset[str]:
    modes, releases, idles = get_args(ReleaseMode), get_args(ReleaseStatus), get_args(IdleStatus)
    return frozenset(
        {
            "releases", "blocks_moved", "blocks_pending", "restores", "blocks_restored",
            "idles", "blocks_idled", "children_ended", "protects", "blocks_protected",
            "blocks_kept_instructions", "blocks_predicted", "waits_idled", "blocks_idled_waiting",
            "checkpoints_marked", "checkpoint_blocks_refreshed", "engine_us", "engine_steps",
            "picker_reads_capped", "utility_calls", "utility_us", "utility_us_max",
            "offload_blocks_released", "offload_blocks_parked",
            "compaction_blocks_dead", "compaction_dead_released",
            *(f"{kind}_{mode}" for kind in ("releases", "block_released", "release_us")
              for mode in modes),
            *(f"releases_{status}" for status in releases),
            *(f"idles_{status}" for status in idles),
        }
    )  # fmt: skip


#: Every engine counter ``/affinity/stats`` may carry; any other name is a bug.
COUNTER_NAMES = _counter_names()


class ReleaseRequest(BaseModel):
    """The body of ``POST /release_kv_cache`` (see the README for the contract).

    The previous window is a Chat Completions window (``messages``), a Responses API window
    (``input`` items, with ``instructions``) or, with ``api: "messages"``, an Anthropic Messages
    window (``messages`` with content blocks, with ``system``); ``messages_released_index``
    indexes the window, where ``instructions`` or ``system`` count as its first item.
    """

    model_config = ConfigDict(extra="ignore")

    #: Which API the window is of; ``None``: chat, or Responses when ``input`` is given.
    api: Literal["chat", "responses", "messages"] | None = None
    model: str = Field(min_length=1)
    cache_salt: str = Field(min_length=1, max_length=512)
    cache_sharing: bool | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    input: list[dict[str, Any]] | None = None
    instructions: str | None = None
    #: The Anthropic window's system prompt: a string or text blocks.
    system: str | list[dict[str, Any]] | None = None
    messages_released_index: int = Field(ge=0)
    tools: list[dict[str, Any]] | None = None
    tools_released_index: int | None = Field(default=None, ge=0)

    @property
    def is_responses(self) -> bool:
        return self.input is not None

    @property
    def is_messages(self) -> bool:
        return self.api == "messages"

    @property
    def window_length(self) -> int:
        if self.input is not None:
            return len(self.input) + (1 if self.instructions else 0)
        return len(self.messages or ()) + (1 if self.system else 0)

    @model_validator(mode="after")
    def _indices_in_range(self) -> ReleaseRequest:
        if (self.messages is None) == (self.input is None):
            raise ValueError("give exactly one of messages (chat) or input (responses)")
        if self.instructions is not None and self.input is None:
            raise ValueError("instructions given without input")
        if self.api == "responses" and self.input is None:
            raise ValueError("api 'responses' needs input")
        if self.api in ("chat", "messages") and self.messages is None:
            raise ValueError(f"api {self.api!r} needs messages")
        if self.system is not None and not self.is_messages:
            raise ValueError("system is for api 'messages' (chat windows carry it as a message)")
        if self.window_length == 0:
            raise ValueError("the window is empty")
        if self.messages_released_index > self.window_length:
            raise ValueError(
                f"messages_released_index={self.messages_released_index} is beyond the "
                f"{self.window_length} items of the window sent"
            )
        if self.tools_released_index is not None:
            if self.tools is None:
                raise ValueError("tools_released_index given without tools")
            if self.tools_released_index > len(self.tools):
                raise ValueError(
                    f"tools_released_index={self.tools_released_index} is beyond the "
                    f"{len(self.tools)} tools sent"
                )
        return self


class ReleaseError(Exception):
    """A release request that cannot be acted on: answered with ``status`` in vLLM's error
    shape (``kind`` is its ``type``), with nothing changed."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class EngineRelease(BaseModel):
    """One engine core's result of one release (``Releases._apply``); the 200 answer of
    ``POST /release_kv_cache`` is these figures summed over the engines, plus timings."""

    model_config = ConfigDict(extra="forbid")

    status: ReleaseStatus
    #: Blocks demoted now (``moved``) or when their running request frees them (``pending``).
    block_released: int = Field(ge=0)
    moved: int = Field(ge=0)
    pending: int = Field(ge=0)
    #: Stale blocks kept because another session holds them, or has held their content.
    kept_shared: int = Field(ge=0)
    first_stale_block: int = Field(ge=0)
    #: Prompt length of the session's latest request (0 when the session is unknown).
    prompt_tokens: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _released_is_moved_plus_pending(self) -> EngineRelease:
        if self.block_released != self.moved + self.pending:
            raise ValueError("block_released must equal moved + pending")
        return self

    @classmethod
    def summed(cls, engines: Sequence[EngineRelease]) -> EngineRelease:
        """Every data-parallel engine's part of one release, as one."""
        return cls(
            status=merge_status(e.status for e in engines),
            block_released=sum(e.block_released for e in engines),
            moved=sum(e.moved for e in engines),
            pending=sum(e.pending for e in engines),
            kept_shared=sum(e.kept_shared for e in engines),
            first_stale_block=min(e.first_stale_block for e in engines),
            prompt_tokens=max(e.prompt_tokens for e in engines),
        )


class EngineIdle(BaseModel):
    """One engine core's result of marking a session idle (``PoolAffinity.idle_session``)."""

    model_config = ConfigDict(extra="forbid")

    #: ``ok``, ``unknown_session``, or ``running`` (its next request already came: nothing done).
    status: IdleStatus | ReleaseStatus
    #: Blocks moved from NORMAL to IDLE (the session's own, not in use).
    blocks_idled: int = Field(ge=0)
    #: The session's blocks left alone because another session holds them, or has held them.
    kept_shared: int = Field(ge=0)


class EngineRestore(BaseModel):
    """One engine core's result of an openJiuwen ``prefetch`` (``restore_divergent``)."""

    model_config = ConfigDict(extra="forbid")

    status: ReleaseStatus
    #: Released blocks put back at the most-recently-used end (not reused in the meantime).
    blocks_restored: int = Field(ge=0)
    first_stale_block: int = Field(ge=0)

    @classmethod
    def summed(cls, engines: Sequence[EngineRestore]) -> EngineRestore:
        return cls(
            status=merge_status(e.status for e in engines),
            blocks_restored=sum(e.blocks_restored for e in engines),
            first_stale_block=min(e.first_stale_block for e in engines),
        )


class Segments(BaseModel):
    """Free-queue blocks per segment (they sum to vLLM's free block count)."""

    model_config = ConfigDict(extra="forbid")

    free: int = Field(ge=0)
    released: int = Field(ge=0)
    #: Blocks of sessions waiting on their user (``finish_reason`` ``stop``, or ``X-KV-Next-Use``).
    idle: int = Field(ge=0)
    normal: int = Field(ge=0)
    #: Blocks of parents waiting on running subagents: reused after every other cached block.
    protected: int = Field(ge=0)


#: What each KV-cache group of an engine counts (``GroupStats``).
GROUP_COUNTERS = ("blocks_released", "blocks_idled")


class GroupStats(BaseModel):
    """One KV-cache group of an engine: hybrid models (sliding window or linear attention beside
    full attention) have several, each with its own blocks and block size."""

    model_config = ConfigDict(extra="forbid")

    group: int = Field(ge=0)
    #: From vLLM's spec class: ``full_attention``, ``sliding_window``, ``mamba``, ...
    kind: str
    block_size: int = Field(ge=1)
    #: Session-block pairs the tracked sessions' latest requests hold in this group; on a
    #: model of several groups only in ``/affinity/check`` (``None`` in the periodic stats:
    #: counting them walks every record).
    bindings: int | None = Field(default=None, ge=0)
    #: Released (moved or pending), by every path.
    blocks_released: int = Field(ge=0)
    blocks_idled: int = Field(ge=0)


class EngineStats(BaseModel):
    """One engine core's entry of ``GET /affinity/stats`` (and the source of ``/metrics``).
    Besides these, every engine counter of ``COUNTER_NAMES`` appears under its own name."""

    model_config = ConfigDict(extra="allow")

    segments: Segments
    #: Released blocks still in use: they move when freed.
    pending: int = Field(ge=0)
    released_reused: int = Field(ge=0)
    #: Released blocks a prompt hit again before they were reused: releases that were wrong.
    released_hit: int = Field(default=0, ge=0)
    #: Protected blocks handed out all the same (nothing else was free).
    protected_reused: int = Field(ge=0)
    #: Subagent sessions running (named a parent, not ended their task yet).
    children: int = Field(ge=0)
    sessions: int = Field(ge=0)
    bindings: int = Field(ge=0)
    sessions_evicted: int = Field(ge=0)
    num_blocks: int = Field(ge=0)
    #: Per KV-cache group (one for Llama-style models).
    groups: list[GroupStats] = Field(default_factory=list)
    #: The predicted-return picker reorders LRU's live victims (``VLLM_AFFINITY_PREDICT_RETURN``
    #: with the lifecycle on); a replay's simulator models what the server runs.
    predict_return: bool = False
    #: The plugin's failures inside the engine core, by path: each was caught, and vLLM went
    #: on as if the plugin were absent there (``vllm_affinity/engine/fail_open.py``).
    engine_errors: dict[str, int] = Field(default_factory=dict)
    #: Request keys the API server sets whose value had the wrong type (ignored), by key.
    malformed_args: dict[str, int] = Field(default_factory=dict)

    def counter(self, name: str) -> int:
        """A counter's value (0 until the engine counts it). An undeclared name raises: a typo
        must not export zeros."""
        if name not in COUNTER_NAMES:
            raise KeyError(f"undeclared engine counter {name!r}")
        value = (self.model_extra or {}).get(name, 0)
        return value if isinstance(value, int) else 0


class ReleaseReceipt(BaseModel):
    """What a client relies on in a 200 answer. Lenient on purpose: any server of the
    openJiuwen 0.1.16 contract answers at least ``block_released``; the plugin adds its
    ``capabilities``."""

    model_config = ConfigDict(extra="ignore")

    block_released: int = Field(ge=0, strict=True)
    capabilities: dict[str, Any] | None = None


def merge_status(statuses: Iterable[ReleaseStatus]) -> ReleaseStatus:
    """One status for a release carried out in every engine."""
    found = set(statuses)
    return "ok" if "ok" in found else (found.pop() if len(found) == 1 else "mixed")
