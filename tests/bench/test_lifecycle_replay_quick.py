"""CI's short run of the lifecycle replay: real servers agree with the simulator, scenario by
scenario, and the lifecycle scenario really moves blocks to IDLE."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.lifecycle import lifecycle_replay

pytestmark = [
    pytest.mark.e2e,
    # Servers of their own (3-4 starts): behind a flag, so the suite stays within its time;
    # make test-bench runs them. The simulator-vs-real checks of every policy run in the suite
    # on the shared servers (test_trace_replay_quick.py).
    pytest.mark.skipif(
        not os.environ.get("JIUWEN_BENCH_PIPELINES"),
        reason="JIUWEN_BENCH_PIPELINES=1 (make test-bench)",
    ),
]


def test_quick_replay_agrees_with_the_simulator(tmp_path: Path) -> None:
    assert lifecycle_replay.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "lifecycle_replay_quick.json").read_text())
    (run,) = result["runs"]
    scenarios = run["scenarios"]
    assert set(scenarios) == {"vanilla", "release", "lifecycle"}
    for name, figures in scenarios.items():
        assert figures["sent_in_trace_order"], name
        assert abs(figures["sim_minus_real"]) <= 0.01, (name, figures)
    assert scenarios["release"]["block_released"] > 0
    assert scenarios["release"]["blocks_idled"] == 0  # lifecycle off on that server
    assert scenarios["lifecycle"]["blocks_idled"] > 0
    prompts = {figures["prompt_tokens"] for figures in scenarios.values()}
    assert len(prompts) == 1  # the same trace on every server
    assert "| pool |" in (tmp_path / "lifecycle_replay_quick.md").read_text()
