"""CI's short run of the agent benchmark: the whole pipeline works (not the figures)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.agents import agent_bench

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


def test_quick_benchmark_pipeline(tmp_path: Path) -> None:
    assert agent_bench.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "agent_benchmark_quick.json").read_text())
    (run,) = result["runs"]
    for side in ("vanilla", "plugin"):
        assert 0 < run[side]["hit_rate"] < 1
        assert run[side]["ttft_ms_p50"] > 0
        assert run[side]["prompt_tokens"] > run[side]["computed_tokens"] > 0
    assert run["vanilla"]["prompt_tokens"] == run["plugin"]["prompt_tokens"]  # same trace
    # every compaction is released on the chat request itself; none needs a POST
    assert run["plugin"]["releases_in_request"] == sum(result["trace"]["compactions"].values())
    assert run["plugin"]["releases_post"] == 0
    assert run["plugin"]["block_released"] > 0
    assert set(run["ttft_ratio"]) == {"p50", "p90"}
    paired = run["ttft_paired"]
    assert 0 < paired["p10"] <= paired["median"] <= paired["p90"]
    assert 0 <= paired["faster_share"] <= 1
    assert set(run["simulated"]) == {"infinite", "lru", "lru_release", "belady"}
    assert abs(run["sim_vs_real_lru"]) < 0.05  # the simulator models vanilla vLLM closely
    assert "| pool |" in (tmp_path / "agent_benchmark_quick.md").read_text()
    assert (tmp_path / "agent_benchmark_quick.png").read_bytes()[:4] == b"\x89PNG"
