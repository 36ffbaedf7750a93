"""Claude Code and the Codex CLI, unmodified, behind the printed nginx configuration in front of
two plugin replicas: every session stays on one replica though neither agent sends
``X-Session-ID``, and a killed replica moves only its own sessions. A minutes-long run of two
replicas and the agents' own binaries: ``make test-long``."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from jiuwen_kv_protocol.headers import CLAUDE_CODE_SESSION_HEADER

from .conftest import MODEL_PATHS, AgentsFleet, ClaudeCode, CodexCli, claude_code_via, codex_via

pytestmark = pytest.mark.long


def test_agent_sessions_stay_on_one_replica_and_move_only_when_theirs_dies(
    agents_fleet: AgentsFleet, tmp_path: Path
) -> None:
    router = agents_fleet.router
    claude = [claude_code_via(router, tmp_path, f"claude-{i}") for i in range(4)]
    # Claude Code's sessions, chosen two on each replica (the Codex threads fall where they may)
    wanted = [0, 0, 1, 1]
    for agent, replica in zip(claude, wanted, strict=True):
        while not agent.session:
            candidate = str(uuid.uuid4())
            if agents_fleet.place({CLAUDE_CODE_SESSION_HEADER: candidate}) == replica:
                agent.session = candidate
    agents: list[ClaudeCode | CodexCli] = [
        *claude,
        *(codex_via(router, tmp_path, f"codex-{i}") for i in range(3)),
    ]
    for turn in range(2):
        for agent in agents:
            agent.ask(f"question {turn} about the weather")
    before = agents_fleet.served()
    assert len(before) == len(agents), before  # one key per session: each agent's own header
    assert all(len(found) == 1 for found in before.values()), before
    assert {next(iter(found)) for found in before.values()} == {0, 1}, before  # spread
    for replica in agents_fleet.replicas:  # each replica bound the sessions it served
        stats = replica.engine_stats()
        assert stats["sessions"] >= 1 and stats["released_hit"] == 0

    agents_fleet.replicas[1].stop()
    mark = len(router.routed())
    for agent in agents:
        agent.ask("one more question")  # no call fails: nginx moves on to the live replica
    after: dict[str, int] = {}
    for routed in router.routed()[mark:]:
        if routed.session and routed.uri in MODEL_PATHS:
            after[routed.session] = agents_fleet.replica_of(routed.upstream)
    assert set(after) == set(before)
    moved = {key for key in before if before[key] != {after[key]}}
    assert moved == {key for key, found in before.items() if found == {1}}
