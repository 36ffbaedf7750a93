"""Where a replayed call's TTFT goes (``jiuwen_replay/latency.py``): vLLM's latency histograms
read from a page prometheus_client writes under vLLM's names, the client loop's lag, and the
per-call comparisons of two runs (``compare.py``)."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from jiuwen_replay.compare import by_computed, paired_ttft
from jiuwen_replay.latency import GcPauses, LoopLag, histograms, server_latency
from jiuwen_replay.runner import CallRecord

BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0)


def page(ttft: list[float], queue: list[float], prefill: list[float]) -> str:
    """A ``/metrics`` page with vLLM's three histograms, each labelled as vLLM labels them."""
    registry = CollectorRegistry()
    for name, values in (
        ("vllm:time_to_first_token_seconds", ttft),
        ("vllm:request_queue_time_seconds", queue),
        ("vllm:request_prefill_time_seconds", prefill),
    ):
        histogram = Histogram(
            name, "", ["model_name", "engine"], registry=registry, buckets=BUCKETS
        )
        for i, value in enumerate(values):  # two engines: the reader sums them
            histogram.labels("tiny", str(i % 2)).observe(value)
    return generate_latest(registry).decode()


def test_the_change_over_a_run_gives_means_and_the_share_past_each_bound() -> None:
    before = histograms(page([0.02], [0.001], [0.01]))
    after = histograms(page([0.02, 0.03, 0.2, 0.3, 0.6], [0.001, 0.002, 0.1, 0.2, 0.4],
                            [0.01, 0.02, 0.05, 0.05, 0.1]))  # fmt: skip
    out = server_latency(before, after)
    assert out is not None and out["requests"] == 4
    assert out["ttft_ms_mean"] == pytest.approx((30 + 200 + 300 + 600) / 4, abs=0.1)
    assert out["queue_ms_mean"] == pytest.approx((2 + 100 + 200 + 400) / 4, abs=0.1)
    assert out["prefill_ms_mean"] == pytest.approx((20 + 50 + 50 + 100) / 4, abs=0.1)
    assert out["ttft_over_0.1s"] == 0.75  # 0.2, 0.3 and 0.6 of the run's four
    assert out["ttft_over_0.25s"] == 0.5
    assert out["ttft_over_0.5s"] == 0.25


def test_a_run_the_server_saw_nothing_of_reports_nothing() -> None:
    same = histograms(page([0.02], [0.001], [0.01]))
    assert server_latency(same, same) is None
    assert server_latency({}, histograms("")) is None  # a server without /metrics


def test_the_loop_lag_shows_a_blocked_event_loop() -> None:
    async def blocked() -> list[float]:
        lag = LoopLag(period=0.005)
        lag.start()
        await asyncio.sleep(0.02)
        time.sleep(0.1)  # a call doing 100 ms of work on the loop's thread
        await asyncio.sleep(0.02)
        await lag.stop()
        return lag.lags

    lags = asyncio.run(blocked())
    assert max(lags) >= 0.08, lags
    assert sorted(lags)[len(lags) // 2] < 0.05, lags  # the other wake-ups were on time


def record(index: int, ttft: float, prompt: int, cached: int, error: str | None = None) -> Any:
    return CallRecord(
        index, "s", 0.0, ttft=ttft, prompt_tokens=prompt, cached_tokens=cached, error=error
    )


def test_paired_ttft_compares_only_calls_that_computed_the_same_tokens() -> None:
    base = [record(0, 0.010, 64, 32), record(1, 0.020, 64, 0), record(2, 0.030, 64, 32)]
    other = [
        record(0, 0.013, 64, 32),  # same work: +3 ms
        record(1, 0.005, 64, 64),  # the other side hit more: a policy difference, left out
        record(2, 0.031, 64, 32),  # same work: +1 ms
        record(3, 0.500, 64, 32),  # no counterpart
    ]
    out = paired_ttft(base, other)
    assert out == {"calls": 2, "median_ms": 2.0, "mean_ms": 2.0}
    assert paired_ttft(base, [record(0, 0.1, 64, 32, error="boom")]) is None


def test_ttft_by_computed_tokens_buckets_each_call_by_its_own_work() -> None:
    calls = [record(0, 0.010, 64, 64), record(1, 0.050, 600, 0), record(2, 0.020, 100, 60)]
    out = by_computed(calls)
    assert out["0-32"] == {"calls": 1, "ttft_ms_p50": 10.0, "ttft_ms_p90": 10.0}
    assert out["33-128"]["calls"] == 1 and out["513+"]["ttft_ms_p50"] == 50.0
    assert out["129-512"]["calls"] == 0 and out["computed_p90"] == 600


def test_gc_pauses_are_counted_per_generation_while_recording() -> None:
    with GcPauses() as pauses:
        gc.collect(2)
        gc.collect(0)
    gc.collect(2)  # after recording: not counted
    out = pauses.summary()
    assert pauses.counts[2] == 1 and pauses.counts[0] >= 1
    assert out["gen2_count"] == 1 and out["s"] >= out["gen2_s"] >= 0
    assert pauses._callback not in gc.callbacks
