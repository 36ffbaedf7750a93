"""Replay a ``Trace`` against a vLLM server, with or without the hook.

Each session's calls go in order, each at its time on the trace's clock sped up ``speed`` times
(``speed`` 0: one call at a time in trace order, so a simulator sees exactly the server's order),
at most ``concurrency`` in flight. Every call is streamed, so its time to first token is measured;
prompt and cached tokens come from the answer's usage, the hit rate also from the server's own
counters where ``/metrics`` answers. A hooked run installs ``jiuwen_hooks`` for its duration, and
the session of every call (and its parent, for a subagent) rides in ``jiuwen_hooks.session``:
the hook finds out by itself whether the server runs the plugin (in-request release), takes the
POST, or neither. Calls go through the ``openai`` SDK (Chat Completions) or the ``anthropic`` SDK
(``/v1/messages``), as the agents being replayed would.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai

import jiuwen_hooks
from jiuwen_kv_protocol.headers import (
    CLAUDE_CODE_AGENT_HEADER,
    CLAUDE_CODE_SESSION_HEADER,
    CODEX_PARENT_HEADER,
    CODEX_THREAD_HEADER,
    GENERIC_SESSION_HEADERS,
    engine_root,
)
from vllm_affinity.settings import Settings

from .latency import GcPauses, LoopLag, histograms, server_latency
from .prompts import WindowBuilder
from .trace import Trace, TraceRequest, next_call_gaps, next_use_hints

#: Seconds to the next call at or above which the plugin counts a session as idle (the plugin's
#: ``VLLM_AFFINITY_IDLE_AFTER_S`` default).
IDLE_AFTER_S = Settings.idle_after

#: A replayed call is cut at its token budget (``length``), which tells the server nothing of
#: how the call ended. With no hook, a call that the trace (``next_use``) ends with an answer
#: stops at the first of these strings instead: nine in ten of a small random model's tokens
#: hold one, so it finishes ``stop``, and the server reads an answer, as from a real agent's.
ANSWER_STOPS = [" ", "e", "a", "o"]


@dataclass(frozen=True)
class Target:
    """One side of a comparison: a server, and whether the hook runs in front of it."""

    name: str
    base_url: str  # ends in /v1
    hooked: bool
    #: No hook: each call carries a coding agent's own session headers instead (Claude Code's
    #: on ``/v1/messages``, the Codex CLI's thread on chat), so the server tells compactions
    #: from the windows alone (``vllm_affinity/core/compaction.py``).
    agent_headers: bool = False

    @property
    def root_url(self) -> str:
        """The engine root, as the hook keys what it learns per engine."""
        return engine_root(self.base_url)


@dataclass(frozen=True)
class ReplayOptions:
    model: str
    api_key: str = "EMPTY"
    #: Prompt and output tokens are multiplied by this (0.25 keeps a quarter).
    scale: float = 1.0
    #: The trace's clock runs this many times faster; 0: one call at a time in trace order.
    speed: float = 1.0
    concurrency: int = 64
    #: Cap on each call's output tokens (CPU runs keep them short); None: as the trace says.
    max_output_tokens: int | None = None
    #: Send vLLM's ``ignore_eos`` so each call generates as many tokens as the trace's.
    ignore_eos: bool = True
    #: What hooked runs tell the plugin about each call's end (``X-KV-Next-Use``): one of
    #: ``trace.SIGNALS`` (``none``, ``gap``, ``finish``).
    next_use: str = "none"
    #: Hooked runs end each session after its last call (``jiuwen_hooks.end_session``).
    end_sessions: bool = False
    #: ``chat`` (the openai SDK, ``/v1/chat/completions``) or ``messages`` (the anthropic SDK,
    #: ``/v1/messages``).
    api: str = "chat"
    #: Hooked runs name each subagent's parent (``jiuwen_hooks.session(id, parent=...)``).
    parents: bool = True
    #: Send each actor's instructions, where the trace says which blocks they are, as a system
    #: prompt (as agents do; a hybrid model's server keeps their state: ``checkpoints.py``).
    system_prompts: bool = False
    timeout: float = 600.0
    progress: bool = True

    def tokens_per_block(self, trace: Trace) -> int:
        return max(1, round(trace.block_tokens * self.scale))

    def max_tokens(self, output_tokens: int) -> int:
        tokens = max(1, round(output_tokens * self.scale))
        return min(tokens, self.max_output_tokens) if self.max_output_tokens else tokens


@dataclass
class CallRecord:
    index: int
    session: str
    sent: float  # seconds since the run's start
    done: float = 0.0
    ttft: float | None = None
    #: seconds from the SDK call to its request going out (the SDK's and the hook's work)
    pre_send: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None


@dataclass
class RunResult:
    target: Target
    calls: list[CallRecord] = field(default_factory=list)
    wall_s: float = 0.0
    server_hits: float | None = None  # prefix-cache hit and query tokens from /metrics
    server_queries: float | None = None
    #: vLLM's own TTFT, queue and prefill over the run (``latency.server_latency``)
    server_latency: dict[str, Any] | None = None
    #: how late the client's event loop woke, seconds per 10 ms wake-up (``latency.LoopLag``)
    loop_lags: list[float] = field(default_factory=list)
    #: CPU seconds the replaying process used over the run (the SDK, the hook, its threads)
    client_cpu_s: float | None = None
    #: the client's garbage-collector pauses over the run (``latency.GcPauses.summary``)
    client_gc: dict[str, Any] | None = None
    hook: dict[str, Any] = field(default_factory=dict)

    def sent_order(self) -> list[int]:
        return [c.index for c in sorted(self.calls, key=lambda c: (c.sent, c.index))]


def windows(trace: Trace, options: ReplayOptions, nonce: int) -> list[list[dict[str, Any]]]:
    """Every request's chat window, built in trace order (``nonce``: content of this run only)."""
    builder = WindowBuilder(options.tokens_per_block(trace), nonce)
    if options.system_prompts:
        return [builder.window(r.blocks, r.instructions) for r in trace.requests]
    return [builder.window(r.blocks) for r in trace.requests]


def metrics_text(root_url: str, api_key: str) -> str | None:
    """The server's Prometheus ``/metrics`` page, or None where it does not answer."""
    try:
        response = httpx.get(
            root_url + "/metrics", timeout=10, headers={"Authorization": f"Bearer {api_key}"}
        )
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def prefix_counters(text: str | None) -> tuple[float, float] | None:
    """vLLM's prefix-cache hit and query token counters from a ``/metrics`` page, or None where
    there is none."""
    if text is None:
        return None
    totals = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    seen = False
    for line in text.splitlines():
        name = line.partition("{")[0].partition(" ")[0]
        if name in totals:
            totals[name] += float(line.rpartition(" ")[2])
            seen = True
    if not seen:
        return None
    return totals["vllm:prefix_cache_hits_total"], totals["vllm:prefix_cache_queries_total"]


class _Progress:
    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.done = 0
        self.started = time.monotonic()
        self._shown = 0.0

    def step(self, record: CallRecord) -> None:
        self.done += 1
        now = time.monotonic()
        if self.enabled and (now - self._shown >= 2.0 or self.done == self.total):
            self._shown = now
            end = "\n" if self.done == self.total else ""
            print(
                f"\r  {self.label}: {self.done}/{self.total} calls, {now - self.started:.0f} s",
                end=end,
                file=sys.stderr,
                flush=True,
            )


#: The call in flight in this task and when its SDK call began (for ``CallRecord.pre_send``).
_CALL: ContextVar[tuple[CallRecord, float] | None] = ContextVar("replay_call", default=None)


async def _on_request(request: httpx.Request) -> None:
    """httpx's request hook: the call's request is going out now."""
    call = _CALL.get()
    if call is not None and call[0].pre_send is None:
        call[0].pre_send = time.perf_counter() - call[1]


async def _one_message(
    client: anthropic.AsyncAnthropic,
    options: ReplayOptions,
    record: CallRecord,
    window: list[dict[str, Any]],
    output_tokens: int,
    headers: dict[str, str],
    answer: bool = False,
) -> None:
    """``_one`` on ``/v1/messages``: Anthropic's usage splits the prompt into the part read
    from the cache and the rest (vLLM's ``prompt_tokens`` is their sum)."""
    start = time.perf_counter()
    _CALL.set((record, start))
    try:
        system = window[0]["content"] if window and window[0]["role"] == "system" else None
        stream = await client.messages.create(
            model=options.model,
            system=system if system is not None else anthropic.omit,
            messages=window[1:] if system is not None else window,  # type: ignore[arg-type]
            max_tokens=options.max_tokens(output_tokens),
            stop_sequences=ANSWER_STOPS if answer else anthropic.omit,
            stream=True,
            extra_headers=headers or None,
        )
        async for event in stream:
            if record.ttft is None and event.type == "content_block_delta":
                record.ttft = time.perf_counter() - start
            usage = getattr(event, "usage", None) or getattr(
                getattr(event, "message", None), "usage", None
            )
            if usage is not None and event.type == "message_delta":
                cached = usage.cache_read_input_tokens
                created = usage.cache_creation_input_tokens or 0
                record.prompt_tokens = (usage.input_tokens or 0) + (cached or 0) + created
                record.cached_tokens = cached
    except anthropic.AnthropicError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]


async def _one(
    client: openai.AsyncOpenAI,
    options: ReplayOptions,
    record: CallRecord,
    window: list[dict[str, Any]],
    output_tokens: int,
    headers: dict[str, str],
    answer: bool = False,
) -> None:
    """One streamed chat call; ``answer``: stop at ``ANSWER_STOPS`` (finish ``stop``)."""
    start = time.perf_counter()
    _CALL.set((record, start))
    extra_body = {"ignore_eos": True} if options.ignore_eos else None
    try:
        stream = await client.chat.completions.create(
            model=options.model,
            messages=window,  # type: ignore[arg-type]
            max_tokens=options.max_tokens(output_tokens),
            stop=ANSWER_STOPS if answer else openai.omit,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra_body,
            extra_headers=headers or None,
        )
        async for chunk in stream:
            if record.ttft is None and chunk.choices:
                record.ttft = time.perf_counter() - start
            if chunk.usage is not None:
                record.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                if details is not None and details.cached_tokens is not None:
                    record.cached_tokens = details.cached_tokens
    except openai.OpenAIError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]


def agent_headers(request: TraceRequest, options: ReplayOptions) -> dict[str, str]:
    """The session headers a coding agent would send for this call: Claude Code's on
    ``/v1/messages`` (a subagent: its lead's session and its own agent id), the Codex CLI's
    thread (and parent thread) on chat."""
    parent = request.parent if options.parents and request.parent != request.session else None
    if options.api == "messages":
        if parent:
            return {CLAUDE_CODE_SESSION_HEADER: parent, CLAUDE_CODE_AGENT_HEADER: request.session}
        return {CLAUDE_CODE_SESSION_HEADER: request.session}
    headers = {CODEX_THREAD_HEADER: request.session, GENERIC_SESSION_HEADERS[0]: request.session}
    if parent:
        headers[CODEX_PARENT_HEADER] = parent
    return headers


async def _replay(
    trace: Trace,
    target: Target,
    options: ReplayOptions,
    prompts: Sequence[list[dict[str, Any]]],
    result: RunResult,
) -> None:
    requests = trace.requests
    gaps = next_call_gaps(requests)
    hints = next_use_hints(requests, options.next_use, IDLE_AFTER_S, options.speed)
    by_session: dict[str, list[int]] = {}
    for index, request in enumerate(requests):
        by_session.setdefault(request.session, []).append(index)
    limit = asyncio.Semaphore(max(1, options.concurrency))
    progress = _Progress(target.name, len(requests), options.progress)
    origin = requests[0].at
    client: Any
    if options.api == "messages":
        client = anthropic.AsyncAnthropic(
            base_url=target.root_url,
            auth_token=options.api_key,
            max_retries=0,
            timeout=options.timeout,
            http_client=anthropic.DefaultAsyncHttpxClient(event_hooks={"request": [_on_request]}),
        )
        send: Any = _one_message
    else:
        client = openai.AsyncOpenAI(
            base_url=target.base_url,
            api_key=options.api_key,
            max_retries=0,
            timeout=options.timeout,
            http_client=openai.DefaultAsyncHttpxClient(event_hooks={"request": [_on_request]}),
        )
        send = _one
    start = time.monotonic()

    async def call(index: int) -> None:
        request = requests[index]
        record = CallRecord(index, request.session, time.monotonic() - start)
        result.calls.append(record)
        with ExitStack() as stack:
            if target.hooked:
                parent = request.parent if options.parents else None
                if parent == request.session:
                    parent = None
                stack.enter_context(jiuwen_hooks.session(request.session, parent=parent))
                if hints[index] is not None:
                    stack.enter_context(jiuwen_hooks.next_use(hints[index]))
            headers = agent_headers(request, options) if target.agent_headers else {}
            answer = target.agent_headers and (hints[index] or 0.0) >= IDLE_AFTER_S
            await send(
                client, options, record, prompts[index], request.output_tokens, headers, answer
            )
        record.done = time.monotonic() - start
        if target.hooked and options.end_sessions and gaps[index] is None:
            jiuwen_hooks.end_session(request.session)
        progress.step(record)

    async def session(indices: list[int]) -> None:
        for index in indices:
            due = (requests[index].at - origin) / options.speed
            delay = start + due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            async with limit:
                await call(index)

    stats = httpx.AsyncClient(
        base_url=target.root_url,
        timeout=10,
        headers={"Authorization": f"Bearer {options.api_key}"},
    )
    lag = LoopLag()
    lag.start()
    try:
        if options.speed <= 0:
            for index in range(len(requests)):
                told = target.hooked or target.agent_headers
                idle = told and (hints[index] or 0.0) >= IDLE_AFTER_S
                before = await _idles(stats) if idle else None
                await call(index)
                if before is not None:  # one call at a time: let the idle land, as modelled
                    await _settle(stats, before)
        else:
            await asyncio.gather(*(session(ix) for ix in by_session.values()))
    finally:
        await lag.stop()
        result.loop_lags = lag.lags
        await client.close()
        await stats.aclose()
    result.wall_s = time.monotonic() - start


async def _idles(stats: httpx.AsyncClient) -> int | None:
    """Idle signals the plugin's engines applied so far; None where there is no plugin."""
    try:
        response = await stats.get("/affinity/stats")
        engines = response.json()["engines"] if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(engines, list):
        return None
    return sum(int(e.get("idles", 0)) for e in engines if isinstance(e, dict))


async def _settle(stats: httpx.AsyncClient, before: int, timeout: float = 2.0) -> None:
    """Wait (at most ``timeout``) until the plugin applied the idle signal of the call just
    answered: it goes to the engine after the answer, and the next call must find it there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = await _idles(stats)
        if now is None or now > before:
            return
        await asyncio.sleep(0.01)


def run(
    trace: Trace,
    target: Target,
    options: ReplayOptions,
    nonce: int = 0,
    on_hook: Callable[[jiuwen_hooks.Hook], None] | None = None,
) -> RunResult:
    """Replay ``trace`` against ``target`` once (content unique to ``nonce``, session names
    unique to this run: ``Trace.tagged``)."""
    prompts = windows(trace, options, nonce)
    trace = trace.tagged(secrets.token_hex(3))
    result = RunResult(target)
    page = metrics_text(target.root_url, options.api_key)
    before, latency_before = prefix_counters(page), histograms(page or "")
    hook = jiuwen_hooks.install() if target.hooked else None
    try:
        if hook is not None and on_hook is not None:
            on_hook(hook)
        if hook is not None:  # the first release takes the path the later ones take
            for _ in range(3):
                if hook.probe(target.root_url, options.api_key) != "unknown":
                    break
        cpu = time.process_time()
        with GcPauses() as pauses:
            asyncio.run(_replay(trace, target, options, prompts, result))
        result.client_cpu_s = time.process_time() - cpu
        result.client_gc = pauses.summary()
        if hook is not None:
            hook.flush()
            result.hook = {k: v for k, v in hook.stats().items() if k != "engines"}
            result.hook["engine_state"] = hook.engines().get(target.root_url, "unknown")
    finally:
        if hook is not None:
            jiuwen_hooks.uninstall()
    page = metrics_text(target.root_url, options.api_key)
    after = prefix_counters(page)
    if before is not None and after is not None:
        result.server_hits = after[0] - before[0]
        result.server_queries = after[1] - before[1]
    result.server_latency = server_latency(latency_before, histograms(page or ""))
    result.calls.sort(key=lambda c: c.index)
    return result
