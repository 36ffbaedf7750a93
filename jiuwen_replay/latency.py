"""Where a replayed call's time to first token goes: the client, or the server.

A replay measures TTFT in the client, from the SDK call to the first streamed token. That
includes the client's own work before the request reaches the wire (the SDK, the hook when one
is installed) and any delay of an event loop that many calls share. vLLM measures its own TTFT
from the request's arrival in the API server to the first token leaving it, and splits it into
the time queued in the engine and the time of the prefill. Both sides of a comparison run the
same client, so where the hooked side's TTFT tail differs from vanilla's, these tell which of the
three (the client, the engine's queue, the prefill) it comes from (issue 36).

- ``histograms``: sums and counts of vLLM's latency histograms from a ``/metrics`` page;
  ``server_latency``: their change over a run, as means and the share of requests above a few
  TTFT bounds.
- ``LoopLag``: how late a coroutine that asks to wake every ``period`` seconds wakes, on the
  loop the calls run on (the client's CPU beside the server's shows up here).
- ``GcPauses``: the client's garbage-collector pauses over a run, which stop its event loop
  (a client holding more objects, the hook's per-session state among them, pauses longer).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Any

#: vLLM's request latency histograms, under the names this module reports them by.
SERVER_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:request_queue_time_seconds": "queue",
    "vllm:request_prefill_time_seconds": "prefill",
}
#: TTFT bounds (seconds, bucket bounds of vLLM's histogram) the share above which is reported.
TTFT_BOUNDS = ("0.1", "0.25", "0.5")


def _value(line: str) -> float:
    return float(line.rpartition(" ")[2])


def histograms(text: str) -> dict[str, float]:
    """``<short>_sum``, ``<short>_count`` and ``ttft_le_<bound>`` totals (every engine and
    model label summed) from a Prometheus page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.partition("{")[0].partition(" ")[0]
        for metric, short in SERVER_HISTOGRAMS.items():
            if name in (f"{metric}_sum", f"{metric}_count"):
                key = f"{short}_{name.rpartition('_')[2]}"
                out[key] = out.get(key, 0.0) + _value(line)
            elif name == f"{metric}_bucket" and short == "ttft":
                for bound in TTFT_BOUNDS:
                    if f'le="{bound}"' in line:
                        key = f"ttft_le_{bound}"
                        out[key] = out.get(key, 0.0) + _value(line)
    return out


def server_latency(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """Over a run: the server's mean TTFT, queue and prefill (ms) and the share of its
    requests whose TTFT passed each bound; None where the server reported no request."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    count = delta.get("ttft_count", 0.0)
    if count <= 0:
        return None
    out: dict[str, Any] = {"requests": int(count)}
    for short in SERVER_HISTOGRAMS.values():
        n = delta.get(f"{short}_count", 0.0)
        out[f"{short}_ms_mean"] = round(delta.get(f"{short}_sum", 0.0) / n * 1e3, 1) if n else None
    for bound in TTFT_BOUNDS:
        below = delta.get(f"ttft_le_{bound}")
        out[f"ttft_over_{bound}s"] = None if below is None else round(1 - below / count, 4)
    return out


@dataclass
class LoopLag:
    """How late a periodic wake-up runs on the current event loop (seconds per wake-up)."""

    period: float = 0.01
    lags: list[float] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.period)
            self.lags.append(max(0.0, time.perf_counter() - asked - self.period))


@dataclass
class GcPauses:
    """The cyclic garbage collector's pauses while recording (``gc.callbacks``): count and
    seconds per generation, and the longest pause."""

    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    longest: float = 0.0
    _started: float = 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = info["generation"]
        self.seconds[generation] += pause
        self.counts[generation] += 1
        self.longest = max(self.longest, pause)

    def summary(self) -> dict[str, Any]:
        return {
            "s": round(sum(self.seconds), 2),
            "gen2_s": round(self.seconds[2], 2),
            "gen2_count": self.counts[2],
            "longest_ms": round(self.longest * 1e3, 1),
        }
