"""Soak: many concurrent agent sessions through the hook against a real plugin server whose pool
is small enough that vLLM preempts, reproducible from a seed and bounded in time.

Agents compact, truncate, change tools, share sessions (parallel calls in one session), ask for
``n=2``, and abort streams mid-generation, while a racer POSTs explicit releases. After each
phase, with the server idle, ``GET /affinity/check`` must find every invariant holding (segments
sum to the free count, free + in use = total, nothing pending or bound, holder counts equal to
the session records), every request must have completed or been cleanly aborted, and no answer
may be a 5xx. ``JIUWEN_SOAK_SECONDS`` (default 150) and ``JIUWEN_SOAK_SEED`` change the run.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

import jiuwen_hooks
from vllm_affinity.testing import SERVED_NAME, VLLMServer, filler_text

pytestmark = [pytest.mark.e2e, pytest.mark.long]

SOAK_SECONDS = float(os.environ.get("JIUWEN_SOAK_SECONDS", "150"))
SEED = int(os.environ.get("JIUWEN_SOAK_SEED", "20261130"))
API_KEY = "soak-key"
NUM_BLOCKS = 48  # 1,536 tokens: a dozen agents of ~400 tokens each do not fit
TOOLS = [
    [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}}]
    for i in range(3)
]


@dataclass
class Tally:
    """What the agents saw; shared by all workers of a phase."""

    counts: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: str, error: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if error is not None and len(self.errors) < 20:
                self.errors.append(error)


@pytest.fixture(scope="module")
def soak_server() -> Iterator[VLLMServer]:
    with VLLMServer(
        plugin=True, num_blocks=NUM_BLOCKS, api_key=API_KEY, eager=True, worker_in_engine=True
    ) as server:
        yield server


class Agent:
    """One agent loop: a growing window that it rewrites now and then."""

    def __init__(self, rng: random.Random, session: str, client: openai.OpenAI) -> None:
        self.rng, self.session, self.client = rng, session, client
        self.window: list[dict[str, Any]] = [
            {"role": "system", "content": f"You are agent {session}. " + filler_text(rng, 20)},
            {"role": "user", "content": filler_text(rng, 25)},
        ]
        self.tools = rng.choice(TOOLS)

    def rewrite(self) -> None:
        roll, w = self.rng.random(), self.window
        if roll < 0.15 and len(w) > 4:  # compaction
            self.window = [
                w[0],
                {"role": "user", "content": "summary " + filler_text(self.rng, 15)},
            ]
            self.window += w[-2:]
        elif roll < 0.25 and len(w) > 3:  # truncation
            self.window = w[:-2]
        elif roll < 0.3:  # tool change
            self.tools = self.rng.choice(TOOLS)
        if sum(len(m["content"]) for m in self.window) > 1000:  # stay within max_model_len
            self.window = [self.window[0], *self.window[-1:]]

    def step(self, tally: Tally, abort_rate: float, n2_rate: float) -> None:
        self.rewrite()
        if self.window[-1]["role"] != "user":
            self.window.append({"role": "user", "content": filler_text(self.rng, 20)})
        kwargs: dict[str, Any] = {
            "model": SERVED_NAME,
            "messages": list(self.window),
            "tools": self.tools,
            "max_tokens": self.rng.randint(8, 48),
            "extra_body": {"ignore_eos": True},
        }
        roll = self.rng.random()
        try:
            with jiuwen_hooks.session(self.session):
                if roll < abort_rate:
                    stream = self.client.chat.completions.create(stream=True, **kwargs)
                    for i, _ in enumerate(stream):
                        if i >= 2:
                            break
                    stream.close()  # the server aborts the request
                    tally.add("aborted")
                    return
                if roll < abort_rate + n2_rate:
                    kwargs["n"] = 2
                reply = self.client.chat.completions.create(**kwargs)
            tally.add("completed")
            text = reply.choices[0].message.content or ""
            self.window.append({"role": "assistant", "content": text[:200] or "ok"})
        except openai.APIStatusError as exc:
            tally.add(f"http_{exc.status_code}", f"{exc.status_code}: {exc.message[:200]}")
        except openai.APIError as exc:
            tally.add("transport_error", repr(exc)[:200])


def racer(
    server: VLLMServer, rng: random.Random, sessions: list[str], stop: float, tally: Tally
) -> None:
    """Explicit releases at random sessions and indices, racing the agents."""
    with httpx.Client(timeout=30) as http:
        while time.monotonic() < stop:
            window = [
                {"role": "system", "content": "x " + filler_text(rng, 10)},
                {"role": "user", "content": filler_text(rng, 10)},
            ]
            body = {
                "model": SERVED_NAME,
                "cache_salt": rng.choice(sessions),
                "cache_sharing": True,
                "messages": window,
                "messages_released_index": rng.randint(0, 2),
            }
            response = http.post(
                server.root_url + "/release_kv_cache", json=body, headers=server.headers()
            )
            key = "release_ok" if response.status_code == 200 else f"release_{response.status_code}"
            tally.add(key, None if response.status_code == 200 else response.text[:200])
            time.sleep(rng.uniform(0.01, 0.1))


def run_phase(
    server: VLLMServer,
    seed: int,
    *,
    seconds: float,
    agents: int,
    abort_rate: float,
    n2_rate: float,
    in_request: bool,
) -> Tally:
    jiuwen_hooks.install(in_request=in_request)
    tally = Tally()
    rng = random.Random(seed)
    sessions = [f"soak-{seed}-{i // 2}" for i in range(agents)]  # pairs share a session
    stop = time.monotonic() + seconds
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)

    def work(i: int) -> None:
        agent = Agent(random.Random(rng.random() + i), sessions[i], client)
        while time.monotonic() < stop:
            agent.step(tally, abort_rate, n2_rate)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(agents)]
    threads.append(
        threading.Thread(
            target=racer, args=(server, random.Random(seed + 1), sessions, stop, tally)
        )
    )
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    tally.counts.update({f"hook.{k}": v for k, v in jiuwen_hooks.stats().items() if k != "engines"})
    jiuwen_hooks.uninstall()
    return tally


def assert_clean(server: VLLMServer, tally: Tally) -> dict[str, Any]:
    counts = tally.counts
    assert not [k for k in counts if k.startswith(("http_5", "release_5"))], (counts, tally.errors)
    assert counts["transport_error"] == 0, tally.errors
    assert not [k for k in counts if k.startswith("http_")], (counts, tally.errors)
    assert counts["completed"] > 0
    answer = server.idle_check()
    (engine,) = answer["engines"]
    assert engine["idle"], engine
    assert answer["ok"], engine["problems"]
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:num_requests_waiting") == 0
    return engine


def test_soak(soak_server: VLLMServer) -> None:
    server, phase_seconds = soak_server, SOAK_SECONDS / 3
    report = {}
    phases = {
        "in_request": {"agents": 8, "abort_rate": 0.0, "n2_rate": 0.0, "in_request": True},
        "post_and_racing_releases": {
            "agents": 8,
            "abort_rate": 0.0,
            "n2_rate": 0.1,
            "in_request": False,
        },
        "aborts_n2_preemption": {
            "agents": 14,
            "abort_rate": 0.2,
            "n2_rate": 0.2,
            "in_request": True,
        },
    }
    for index, (name, kwargs) in enumerate(phases.items()):
        tally = run_phase(server, SEED + index, seconds=phase_seconds, **kwargs)
        engine = assert_clean(server, tally)
        report[name] = {**dict(tally.counts), "bindings": engine["bindings"]}
    preemptions = server.metric("vllm:num_preemptions_total")
    report["preemptions"] = preemptions
    print(f"soak report (seed {SEED}, {SOAK_SECONDS:.0f} s): {report}")
    assert preemptions > 0, report  # the pool really was too small
    assert report["aborts_n2_preemption"]["aborted"] > 0
    assert (
        sum(p.get("hook.releases.in_request", 0) for p in report.values() if isinstance(p, dict))
        > 0
    )
    assert report["post_and_racing_releases"].get("hook.releases.ok", 0) > 0
    assert report["post_and_racing_releases"]["release_ok"] > 0
