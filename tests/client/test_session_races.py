"""Races inside one session: many threads and asyncio tasks (an agent's parallel tool loop) plus
a compressor, all on one session id. Every release the session table decides is sent exactly
once (or taken over by the next model call), none is lost or duplicated; and the table stays
bounded while many sessions churn through it."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import Counter
from typing import Any

import openai

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine

THREADS, CALLS, TASKS = 8, 25, 8


def message(i: int) -> dict[str, str]:
    return {"role": "user" if i % 2 else "assistant", "content": f"m{i}"}


WINDOWS = [[message(i) for i in range(n)] for n in (2, 3, 5, 8)] + [
    [message(0), {"role": "user", "content": "summary"}, message(2)]
]


def key(messages: Any, index: int) -> tuple[str, int]:
    return json.dumps(list(messages), sort_keys=True), index


@jiuwen_hooks.compressor(name="race_compact")
def compact(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return [messages[0], {"role": "user", "content": "summary"}, *messages[-1:]]


def record_decisions(hook: Any) -> list[tuple[str, tuple[str, int], Any]]:
    """Every plan the session table decides, in decision order (wrapping the instance only)."""
    decided: list[tuple[str, tuple[str, int], Any]] = []
    lock = threading.Lock()
    observe, rewrite = hook.table.observe, hook.table.rewrite

    def observed(*args: Any, **kwargs: Any) -> Any:
        decision = observe(*args, **kwargs)
        if decision.plan is not None:
            with lock:
                plan = decision.plan
                decided.append(
                    ("call", key(plan.old.messages, plan.release.messages_released_index), None)
                )
        return decision

    def rewritten(*args: Any, **kwargs: Any) -> Any:
        decision = rewrite(*args, **kwargs)
        if decision.plan is not None:
            with lock:
                plan = decision.plan
                idx = plan.release.messages_released_index
                decided.append(("compressor", key(plan.old.messages, idx), decision.job))
        return decision

    hook.table.observe, hook.table.rewrite = observed, rewritten
    return decided


def test_one_session_many_threads_tasks_and_a_compressor(jiuwen_engine: LocalEngine) -> None:
    hook = jiuwen_hooks.install()
    decided = record_decisions(hook)
    client = openai.OpenAI(base_url=jiuwen_engine.base_url, api_key="sk-test", max_retries=0)
    errors: list[BaseException] = []

    def agent_thread(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with jiuwen_hooks.session("shared"):
                for _ in range(CALLS):
                    window = list(rng.choice(WINDOWS))
                    client.chat.completions.create(model="m", messages=window)
                    if rng.random() < 0.2:
                        compact(window)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    async def tasks() -> None:
        aclient = openai.AsyncOpenAI(base_url=jiuwen_engine.base_url, api_key="sk", max_retries=0)

        async def one(seed: int) -> None:
            rng = random.Random(1000 + seed)
            with jiuwen_hooks.session("shared"):
                for _ in range(CALLS):
                    await aclient.chat.completions.create(model="m", messages=rng.choice(WINDOWS))

        await asyncio.gather(*(one(i) for i in range(TASKS)))
        await aclient.close()

    threads = [threading.Thread(target=agent_thread, args=(i,)) for i in range(THREADS)]
    threads.append(threading.Thread(target=lambda: asyncio.run(tasks())))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hook.flush()
    client.close()
    assert not errors
    sent = Counter(
        key(r.body["messages"], r.body["messages_released_index"]) for r in jiuwen_engine.releases
    )
    taken_over = [d for d in decided if d[0] == "compressor" and d[2].superseded]
    expected = Counter(k for kind, k, job in decided if not (job is not None and job.superseded))
    assert sent == expected  # nothing lost, nothing sent twice
    stats = jiuwen_hooks.stats()
    assert stats["releases.ok"] == sum(sent.values()) > 10
    assert stats.get("releases.superseded", 0) == len(taken_over)
    assert stats["calls.tracked"] == THREADS * CALLS + TASKS * CALLS
    assert stats["sessions.tracked"] == 1
    jiuwen_hooks.uninstall()


def test_table_stays_bounded_under_churn(jiuwen_engine: LocalEngine) -> None:
    hook = jiuwen_hooks.install(max_sessions=50)
    client = openai.OpenAI(base_url=jiuwen_engine.base_url, api_key="sk-test", max_retries=0)
    sizes: list[int] = []

    def churn(worker: int) -> None:
        for i in range(40):
            with jiuwen_hooks.session(f"w{worker}-s{i}"):
                client.chat.completions.create(model="m", messages=WINDOWS[0])
            sizes.append(len(hook.table))

    threads = [threading.Thread(target=churn, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    assert max(sizes) <= 50
    stats = jiuwen_hooks.stats()
    assert stats["sessions.tracked"] == 50 and stats["sessions.evicted"] == 8 * 40 - 50
    jiuwen_hooks.uninstall()
