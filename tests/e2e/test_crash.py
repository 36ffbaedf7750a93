"""The system test "engine killed mid-run", automated: an agent runs through the
hook while the plugin server is SIGKILLed and restarted on the same port. The agent sees exactly
the errors it would see without the hook, none of ours; after the restart its calls and releases
resume (its sessions are unknown to the new engine: they release 0 blocks); the hook counts the
failed releases. A restart of a real server, about half a minute."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import openai
import pytest

import jiuwen_hooks
from vllm_affinity.testing import SERVED_NAME, VLLMServer, filler_text, wait_until
from vllm_affinity.testing.pytest_plugin import shared_server

pytestmark = pytest.mark.e2e

API_KEY = "crash-key"


def _crash_server() -> VLLMServer:
    return VLLMServer(
        plugin=True, num_blocks=64, api_key=API_KEY, eager=True, worker_in_engine=True
    )


#: This test's own server (it kills and restarts it), started with the other shared servers.
crash_server = shared_server("crash_server", _crash_server)


class Agent(threading.Thread):
    """Compacts its window every third turn; records what each call raised."""

    def __init__(self, client: openai.OpenAI) -> None:
        super().__init__()
        self.client, self.stop = client, threading.Event()
        self.errors: list[BaseException] = []
        self.completed: list[float] = []
        self.rng = random.Random(5)

    def run(self) -> None:
        window = [{"role": "system", "content": "You are the crash agent."}]
        turn = 0
        while not self.stop.is_set():
            turn += 1
            window.append({"role": "user", "content": filler_text(self.rng, 20)})
            if turn % 3 == 0:
                window = [window[0], {"role": "user", "content": "summary"}, window[-1]]
            try:
                with jiuwen_hooks.session(f"crash-{turn // 12}"):
                    reply = self.client.chat.completions.create(
                        model=SERVED_NAME, messages=window, max_tokens=4
                    )
                window.append({"role": "assistant", "content": reply.choices[0].message.content})
                self.completed.append(time.monotonic())
            except Exception as exc:
                self.errors.append(exc)
                time.sleep(0.2)


def call_dead_server(client: openai.OpenAI) -> BaseException:
    window = [{"role": "user", "content": "anyone there?"}]
    try:
        with jiuwen_hooks.session("probe-dead"):
            client.chat.completions.create(model=SERVED_NAME, messages=window, max_tokens=1)
    except Exception as exc:
        return exc
    raise AssertionError("a dead server answered")


def engine_stats(server: VLLMServer) -> dict[str, Any]:
    (stats,) = server.affinity_stats()["engines"]
    return stats


def test_engine_killed_mid_run(crash_server: VLLMServer) -> None:
    server = crash_server
    hook = jiuwen_hooks.install(in_request=False, timeout=1.0, failure_cooldown=0.5)
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=15)
    agent = Agent(client)
    agent.start()
    main = [
        {"role": "system", "content": "main"},
        *[{"role": "user", "content": filler_text(random.Random(i), 40)} for i in range(3)],
    ]
    with jiuwen_hooks.session("crash-main"):  # a session the restarted engine will not know
        client.chat.completions.create(model=SERVED_NAME, messages=main, max_tokens=1)
    try:
        wait_until(lambda: len(agent.completed) >= 5, 60, "the agent's first calls")
        before_kill = len(agent.completed)
        server.kill()
        killed_at = time.monotonic()
        wait_until(lambda: agent.errors, 30, "the agent to see the crash")
        wait_until(  # a compaction's release tried while the server is down
            lambda: (
                hook.stats().get("releases.connect_error", 0)
                + hook.stats().get("releases.unreachable", 0)
            ),
            30,
            "a release the hook could not send",
        )
        # the same call, with and without the hook, fails the same way
        with_hook = call_dead_server(client)
        failed_stats = hook.stats()
        jiuwen_hooks.uninstall()
        without_hook = call_dead_server(client)
        hook = jiuwen_hooks.install(in_request=False, timeout=1.0, failure_cooldown=0.5)
        with pytest.raises(openai.APIConnectionError), jiuwen_hooks.session("crash-main"):
            # the new hook sees the main window (the call fails: the server is down)
            client.chat.completions.create(model=SERVED_NAME, messages=main, max_tokens=1)
        assert type(with_hook) is type(without_hook) and str(with_hook) == str(without_hook)
        restarting_at = time.monotonic()
        server.start()  # same port
        restarted_at = time.monotonic()
        served = len(agent.completed)
        wait_until(lambda: len(agent.completed) >= served + 6, 60, "the agent's calls to resume")
        wait_until(  # the new hook knows the server again (its probe runs in the background)
            lambda: hook.stats().get("releases.ok", 0) >= 1, 60, "the hook's releases to resume"
        )
        with jiuwen_hooks.session("crash-main"):  # its release reaches an engine that never saw it
            client.chat.completions.create(model=SERVED_NAME, messages=main[:2], max_tokens=1)
        hook.flush()  # its POST runs in the background: on a busy machine it may not have yet
        stats = jiuwen_hooks.stats()
    finally:
        agent.stop.set()
        agent.join(timeout=60)
        client.close()
    jiuwen_hooks.uninstall()
    assert before_kill > 0
    assert agent.errors, "the crash was not seen"
    assert all(isinstance(e, openai.APIConnectionError) for e in agent.errors), agent.errors
    assert not any("jiuwen" in repr(e) for e in agent.errors)
    assert any(t > restarted_at for t in agent.completed)  # calls resume after the restart
    assert not any(killed_at + 0.5 < t < restarting_at for t in agent.completed)
    try:  # sessions from before: 0 blocks
        wait_until(
            lambda: engine_stats(server).get("releases_unknown_session", 0) >= 1,
            30,
            "the release of a session from before the restart to reach the new engine",
        )
    except TimeoutError as exc:
        releases = {k: v for k, v in engine_stats(server).items() if k.startswith("releases")}
        raise AssertionError(f"{exc}; the hook: {stats}; the engine: {releases}") from None
    assert stats.get("releases.ok", 0) >= 1  # releases resumed
    failed = failed_stats.get("releases.connect_error", 0) + failed_stats.get(
        "releases.unreachable", 0
    )
    assert failed >= 1, failed_stats  # the hook counted the releases it could not send
    assert stats.get("internal_errors", 0) == failed_stats.get("internal_errors", 0) == 0
