"""Two plugin replicas (one core each) behind a real nginx routing by ``X-Session-ID``: a
session's calls and releases reach the replica that holds it, the fleet's hit rate gains from
release, and losing a replica moves only its sessions, without breaking an agent."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from benchmarks.agents.agent_trace import Call, TraceConfig, generate
from benchmarks.fleet import fleet_bench
from vllm_affinity.testing import SERVED_NAME

pytestmark = [pytest.mark.e2e, pytest.mark.long]


def test_session_routing_keeps_releases_with_their_replica(tmp_path: Path) -> None:
    assert fleet_bench.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fleet_benchmark_quick.json").read_text())
    with_release = result["scenarios"]["session+release"]
    without = result["scenarios"]["session"]
    assert with_release["prompt_tokens"] == without["prompt_tokens"]  # the same trace
    assert with_release["hit_rate"] > without["hit_rate"]
    assert with_release["computed_tokens"] < without["computed_tokens"]
    compactions = sum(result["trace"]["compactions"].values())
    assert with_release["releases_in_request"] == compactions
    replicas = with_release["replicas"].values()
    # every session was served by one replica only
    served = [s for r in replicas for s in r["sessions_routed"]]
    assert len(served) == len(set(served)) == result["trace"]["sessions"]
    for replica in replicas:
        # what the router sent a replica is exactly what its plugin acted on: no release
        # reached a replica that does not hold the session
        assert replica["releases_in_request"] == replica["releases_routed"]
        assert replica["releases_ok"] == replica["releases_routed"]
        assert replica["releases_unknown_session"] == 0
    assert sum(r["releases_routed"] for r in replicas) == compactions
    assert sum(r["block_released"] for r in replicas) > 0
    # the simulator, fed each replica's share as the router's log routed it, agrees
    for run in (with_release, without):
        assert abs(run["simulated_hit_rate"] - run["hit_rate"]) < 0.05
    assert (tmp_path / "fleet_benchmark_quick.png").read_bytes()[:4] == b"\x89PNG"


def _post_release(router_url: str, call: Call) -> httpx.Response:
    body = {"model": SERVED_NAME, "cache_salt": call.session, "messages": call.window,
            "messages_released_index": 1}  # fmt: skip
    return httpx.post(
        router_url + "/release_kv_cache",
        json=body,
        headers={"Authorization": f"Bearer {fleet_bench.API_KEY}", "X-Session-ID": call.session},
        timeout=60,
    )


def test_losing_a_replica_moves_only_its_sessions_and_breaks_nothing() -> None:
    calls = generate(TraceConfig(sessions=6, bursts_per_session=2, steps_per_burst=3, seed=3))
    killed: dict[str, object] = {}

    def kill_before_a_release(index: int, call: Call) -> None:
        """At the first compaction past the first third: kill the replica of its session, then
        ask the router to release that session, as a POST-mode hook would."""
        if killed or call.compaction is None or index < len(calls) // 3:
            return
        victim = fleet.replica(fleet.router.replica_of()[call.session])
        previous = fleet.router.replica_of()
        victim.kill()
        answer = _post_release(fleet.router.root_url, call)
        killed.update(
            index=index, victim=victim, answer=answer,
            moved={s for s, u in previous.items() if fleet.replica(u) is victim},
        )  # fmt: skip

    with fleet_bench.Fleet(2, num_blocks=96, max_model_len=3008, policy="session") as fleet:
        run = fleet_bench.replay(fleet, calls, release=True, before_call=kill_before_a_release)
        (survivor,) = fleet.alive()
        routed = [r for r in fleet.router.routed() if r.uri.endswith("/chat/completions")]
        stats = survivor.engine_stats()

    assert killed, "the trace has a compaction to kill the replica before"
    # the agents kept going: every call of the trace got an answer
    trace_calls = [r for r in routed if r.session != "warm-up"]
    assert len(trace_calls) == len(calls)
    assert all(r.status == 200 for r in trace_calls)
    # after the kill, every call went to the survivor, the moved sessions' too
    after = trace_calls[killed["index"] :]
    assert {fleet.replica(r.upstream) for r in after} == {survivor}
    assert killed["moved"] & {r.session for r in after}
    # the survivor does not hold the moved session: nothing released, nothing broken
    answer = killed["answer"]
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "unknown_session"
    assert answer.json()["block_released"] == 0
    # ... and so is the in-request release of the call that follows, on the same session
    assert stats["releases_unknown_session"] >= 2
    assert run["hit_rate"] > 0
