"""Prometheus metrics on vLLM's ``/metrics`` (the API server's default registry).

Request outcomes are counted where they happen (the API server). Segment sizes and engine
counters live in the engine-core process; a collector serves the latest snapshot, refreshed
periodically and after every release. With several API servers vLLM's ``/metrics`` reads the
counters each process wrote to disk, and no collector of the default registry: the snapshot is
added there too (``expose_engine_snapshot``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter as PyCounter
from collections.abc import Iterator
from typing import Any, get_args

from prometheus_client import REGISTRY, CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from jiuwen_kv_protocol.models import EngineStats, ReleaseMode

RELEASE_MODES = get_args(ReleaseMode)
logger = logging.getLogger("vllm_affinity")


class _EngineCollector:
    #: The collector of this process's ``AffinityMetrics`` on the default registry (the one a
    #: multiprocess registry forwards to), once the API server made it.
    current: _EngineCollector | None = None

    def __init__(self, metrics: AffinityMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        engines = self._metrics.engine_stats()
        blocks = GaugeMetricFamily(
            "vllm_affinity_blocks", "Free-queue blocks per segment", labels=["segment", "engine"]
        )
        pending = GaugeMetricFamily(
            "vllm_affinity_pending_blocks",
            "Released blocks still in use, moved when freed",
            labels=["engine"],
        )
        reused = CounterMetricFamily(
            "vllm_affinity_released_blocks_reused",
            "Released blocks handed out again for new content",
            labels=["engine"],
        )
        hit = CounterMetricFamily(
            "vllm_affinity_released_blocks_hit",
            "Released blocks a prompt hit again before they were reused (releases that were wrong)",
            labels=["engine"],
        )
        releases = CounterMetricFamily(
            "vllm_affinity_engine_releases",
            "Releases carried out in the engine, by path: post (/release_kv_cache), in_request "
            "(X-KV-Release), divergence (VLLM_AFFINITY_RELEASE_ON_DIVERGENCE), agent_hint "
            "(openJiuwen evict/offload management requests), child_end (a subagent ended its "
            "task, VLLM_AFFINITY_CHILD_END=release)",
            labels=["mode", "engine"],
        )
        released = CounterMetricFamily(
            "vllm_affinity_engine_block_released",
            "Blocks released in the engine (moved or pending), by path",
            labels=["mode", "engine"],
        )
        restored = CounterMetricFamily(
            "vllm_affinity_engine_blocks_restored",
            "Released blocks put back to most-recently-used by openJiuwen prefetch requests",
            labels=["engine"],
        )
        idled = CounterMetricFamily(
            "vllm_affinity_engine_blocks_idled",
            "Blocks of sessions waiting on their user moved to the IDLE segment",
            labels=["engine"],
        )
        protected = CounterMetricFamily(
            "vllm_affinity_engine_blocks_protected",
            "Blocks of parents waiting on running subagents moved to the PROTECTED segment",
            labels=["engine"],
        )
        group_blocks = CounterMetricFamily(
            "vllm_affinity_engine_group_blocks",
            "Blocks released (moved or pending) or idled, per KV-cache group of the model "
            "(hybrid models have several: sliding window or linear attention beside full "
            "attention)",
            labels=["group", "kind", "action", "engine"],
        )
        checkpoints = CounterMetricFamily(
            "vllm_affinity_engine_checkpoints",
            "Hybrid models: requests whose instructions' end became their junction (marked), "
            "and checkpoint blocks a later request sharing them kept recent (blocks_refreshed)",
            labels=["action", "engine"],
        )
        offload = CounterMetricFamily(
            "vllm_affinity_engine_offload_blocks",
            "vLLM's simple CPU offloader: CPU-tier copies of released blocks put first in the "
            "tier's reuse order (released), and released or idle GPU blocks its copies held "
            "and put back in their place (parked)",
            labels=["action", "engine"],
        )
        compacted = CounterMetricFamily(
            "vllm_affinity_engine_compaction_dead_blocks",
            "Compactions told from the agents' requests: cached blocks of the old window and "
            "of its side branches (their instructions aside) that the new window cannot hit, "
            "by what the compaction did with them (released; kept: left in the cache's order)",
            labels=["outcome", "engine"],
        )
        spent = CounterMetricFamily(
            "vllm_affinity_engine_seconds",
            "Seconds the plugin spent on the engine core's scheduler path (binding blocks to "
            "sessions, the picker, lookups, frees, new requests); over "
            "vllm_affinity_engine_steps, its time per scheduler step",
            labels=["engine"],
        )
        steps = CounterMetricFamily(
            "vllm_affinity_engine_steps", "Scheduler steps the engine core ran", labels=["engine"]
        )
        children = GaugeMetricFamily(
            "vllm_affinity_running_subagents",
            "Subagent sessions that named a parent and have not ended their task",
            labels=["engine"],
        )
        sessions = GaugeMetricFamily(
            "vllm_affinity_sessions",
            "Sessions tracked (bounded by VLLM_AFFINITY_MAX_SESSIONS)",
            labels=["engine"],
        )
        bindings = GaugeMetricFamily(
            "vllm_affinity_bindings",
            "Session-block pairs held by the tracked sessions' latest requests",
            labels=["engine"],
        )
        errors = CounterMetricFamily(
            "vllm_affinity_engine_errors",
            "Failures of the plugin inside the engine core, by path (each caught: vLLM went on "
            "as if the plugin were absent for that request or step)",
            labels=["path", "engine"],
        )
        malformed = CounterMetricFamily(
            "vllm_affinity_engine_malformed_args",
            "Request keys the plugin's API server sets that reached the engine with a value of "
            "the wrong type (ignored), by key",
            labels=["key", "engine"],
        )
        for index, raw in enumerate(engines):
            engine, stats = str(index), EngineStats.model_validate(raw)
            for segment, count in stats.segments.model_dump().items():
                blocks.add_metric([segment, engine], count)
            pending.add_metric([engine], stats.pending)
            reused.add_metric([engine], stats.released_reused)
            hit.add_metric([engine], stats.released_hit)
            sessions.add_metric([engine], stats.sessions)
            bindings.add_metric([engine], stats.bindings)
            restored.add_metric([engine], stats.counter("blocks_restored"))
            idled.add_metric([engine], stats.counter("blocks_idled"))
            protected.add_metric([engine], stats.counter("blocks_protected"))
            children.add_metric([engine], stats.children)
            spent.add_metric([engine], stats.counter("engine_us") / 1e6)
            steps.add_metric([engine], stats.counter("engine_steps"))
            checkpoints.add_metric(["marked", engine], stats.counter("checkpoints_marked"))
            checkpoints.add_metric(
                ["blocks_refreshed", engine], stats.counter("checkpoint_blocks_refreshed")
            )
            dead, freed = (
                stats.counter("compaction_blocks_dead"),
                stats.counter("compaction_dead_released"),
            )
            compacted.add_metric(["released", engine], freed)
            compacted.add_metric(["kept", engine], dead - freed)
            for action in ("released", "parked"):
                offload.add_metric([action, engine], stats.counter(f"offload_blocks_{action}"))
            for path, count in stats.engine_errors.items():
                errors.add_metric([path, engine], count)
            for key, count in stats.malformed_args.items():
                malformed.add_metric([key, engine], count)
            for group in stats.groups:
                labels = [str(group.group), group.kind]
                group_blocks.add_metric([*labels, "released", engine], group.blocks_released)
                group_blocks.add_metric([*labels, "idled", engine], group.blocks_idled)
            for mode in RELEASE_MODES:
                releases.add_metric([mode, engine], stats.counter(f"releases_{mode}"))
                released.add_metric([mode, engine], stats.counter(f"block_released_{mode}"))
        yield blocks
        yield pending
        yield reused
        yield hit
        yield releases
        yield released
        yield restored
        yield idled
        yield protected
        yield group_blocks
        yield checkpoints
        yield offload
        yield compacted
        yield spent
        yield steps
        yield children
        yield sessions
        yield bindings
        yield errors
        yield malformed


class AffinityMetrics:
    """Counters of the release route plus the engine snapshot collector."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self._requests = Counter(
            "vllm_affinity_release_requests",
            "Release requests by outcome",
            ["outcome"],
            registry=registry,
        )
        self._blocks = Counter(
            "vllm_affinity_block_released",
            "KV blocks released (moved or pending)",
            registry=registry,
        )
        self._hints = Counter(
            "vllm_affinity_release_hints",
            "In-request release hints (X-KV-Release) by outcome: accepted or invalid (400)",
            ["outcome"],
            registry=registry,
        )
        self._management = Counter(
            "vllm_affinity_agent_hint_requests",
            "openJiuwen agent_hint management requests (answered without inference), by action "
            "and outcome",
            ["action", "outcome"],
            registry=registry,
        )
        self._lifecycle = Counter(
            "vllm_affinity_session_lifecycle",
            "Finished calls of sessions by what follows: idle or live, told by finish_reason or "
            "by the X-KV-Next-Use hint; invalid hints (400) and idle signals that failed",
            ["outcome"],
            registry=registry,
        )
        self._windows = Counter(
            "vllm_affinity_agent_windows",
            "Windows of coding-agent sessions by the compaction rule's verdict: first, append, "
            "retry, rewrite (the old window's dead blocks released) or side (a side branch)",
            ["verdict"],
            registry=registry,
        )
        self._chains = Counter(
            "vllm_affinity_implicit_sessions",
            "Requests that named no session, by how their session was told from the answers "
            "they carry back: continued (an earlier chain), side (a side request of one: other "
            "instructions, or a side prompt learned) or started (a new one)",
            ["outcome"],
            registry=registry,
        )
        self._engines: list[dict[str, Any]] = []
        self._counts: PyCounter[str] = PyCounter()
        self._lock = threading.Lock()
        collector = _EngineCollector(self)
        registry.register(collector)
        if registry is REGISTRY:
            _EngineCollector.current = collector

    def count_request(self, outcome: str) -> None:
        self._requests.labels(outcome=outcome).inc()
        with self._lock:
            self._counts[f"requests.{outcome}"] += 1

    def count_blocks(self, n: int) -> None:
        self._blocks.inc(n)
        with self._lock:
            self._counts["block_released"] += n

    def count_management(self, action: str, outcome: str) -> None:
        self._management.labels(action=action, outcome=outcome).inc()
        with self._lock:
            self._counts[f"agent_hint.{action}.{outcome}"] += 1

    def count_hint(self, outcome: str) -> None:
        self._hints.labels(outcome=outcome).inc()
        with self._lock:
            self._counts[f"hints.{outcome}"] += 1

    def count_lifecycle(self, outcome: str) -> None:
        self._lifecycle.labels(outcome=outcome).inc()
        with self._lock:
            self._counts[f"lifecycle.{outcome}"] += 1

    def count_window(self, verdict: str) -> None:
        self._windows.labels(verdict=verdict).inc()
        with self._lock:
            self._counts[f"windows.{verdict}"] += 1

    def count_chain(self, outcome: str) -> None:
        self._chains.labels(outcome=outcome).inc()
        with self._lock:
            self._counts[f"implicit.{outcome}"] += 1

    def update_engine_stats(self, engines: list[dict[str, Any]]) -> None:
        with self._lock:
            self._engines = engines

    def engine_stats(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._engines)

    def api_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


_exposed = False


def expose_engine_snapshot() -> None:
    """Add the engine snapshot to what vLLM's multiprocess collector answers. With several API
    servers, ``/metrics`` is a registry built per scrape around prometheus_client's
    ``MultiProcessCollector`` (which sums the counters each process wrote to disk), holding
    no collector of the default registry: it had no engine figure at all. Each API server
    adds its own refresh of the same engines. Idempotent (general plugins load more than
    once); a failure of the snapshot leaves vLLM's own figures served."""
    global _exposed
    if _exposed:
        return
    _exposed = True
    import wrapt
    from prometheus_client import multiprocess

    def with_snapshot(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> list[Metric]:
        metrics = list(wrapped(*args, **kwargs))
        collector = _EngineCollector.current
        if collector is not None:
            try:
                metrics.extend(collector.collect())
            except Exception:  # vLLM's figures stand without the plugin's
                logger.exception("vllm_affinity: the engine snapshot could not be collected")
        return metrics

    wrapt.wrap_function_wrapper(multiprocess.MultiProcessCollector, "collect", with_snapshot)
