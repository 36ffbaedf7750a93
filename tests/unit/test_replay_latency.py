"""Where a replayed call's TTFT goes (``jiuwen_replay/latency.py``): vLLM's latency histograms
read from a page prometheus_client writes under vLLM's names, and the client loop's lag."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from jiuwen_replay.latency import LoopLag, histograms, server_latency

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
