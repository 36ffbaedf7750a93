"""The full-size harness (``benchmarks/engine/trace_engine.py``) on a small trace: vLLM's real
``Scheduler`` on both sides, the plugin's releases made by the engine's own divergence rule, a
CPU tier (the ``OffloadingConnector``) on both sides; run as a user runs it (its own process:
the release rule is read from the environment when the plugin loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jiuwen_replay.formats import write_project
from jiuwen_replay.synthetic import SyntheticConfig, generate

ROOT = Path(__file__).resolve().parents[2]


def harness(tmp_path: Path, *args: str) -> list[dict]:
    trace = tmp_path / "trace.jsonl"
    write_project(generate(SyntheticConfig(sessions=6, calls_per_session=10, compact_after=10,
                                           block_tokens=64)), trace)  # fmt: skip
    out = tmp_path / "result"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_AFFINITY_")}
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine.trace_engine", "--trace", str(trace),
         "--format", "project", "--in-flight", "4", "--out", str(out), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows: list[dict] = json.loads(out.with_suffix(".json").read_text())["rows"]
    return rows


def test_a_tight_pool_computes_less_with_the_plugin_and_a_loose_one_the_same(
    tmp_path: Path,
) -> None:
    tight, loose = harness(tmp_path, "--pools", "200,400")
    for row in (tight, loose):
        vanilla, plugin = row["vanilla"], row["plugin"]
        assert plugin["sent"] == vanilla["sent"] > 0
        assert plugin["released"] > 0 and plugin["released_hit"] == 0
        assert plugin["computed"] <= vanilla["computed"]
        assert plugin["own_ms_per_step"] > 0
    assert tight["plugin"]["computed"] < tight["vanilla"]["computed"]
    assert tight["vanilla"]["computed"] > loose["vanilla"]["computed"]
    # the bound: Belady on the same prompts and answers computes least, and the share of
    # vanilla's gap to it the plugin closes is a share
    assert tight["bound"]["belady"] <= tight["bound"]["lru"]
    assert tight["bound"]["belady"] <= tight["plugin"]["computed"]
    assert 0 < tight["gap_closed"] <= 1


def test_a_hybrid_pool_runs_vanillas_retention_interval_beside_vanilla(tmp_path: Path) -> None:
    (row,) = harness(tmp_path, "--pools", "hybrid:400", "--no-bound")
    interval = row["vanilla+interval"]
    assert interval["sent"] == row["vanilla"]["sent"] == row["plugin"]["sent"]
    assert "bound" not in row and "released" not in interval
    assert row["plugin"]["released_hit"] == 0


def test_with_a_cpu_tier_on_both_sides_the_plugin_loads_less(tmp_path: Path) -> None:
    (row,) = harness(tmp_path, "--pools", "200", "--cpu-tier", "1000")
    vanilla, plugin = row["vanilla"], row["plugin"]
    assert vanilla["loaded"] > 0  # the tier served what the GPU lost
    assert plugin["computed"] <= vanilla["computed"]
    assert plugin["loaded"] < vanilla["loaded"]
    assert plugin["released_hit"] == 0


def test_a_bad_pool_or_a_missing_trace_is_refused_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.engine.trace_engine import main

    trace = tmp_path / "trace.jsonl"
    write_project(generate(SyntheticConfig(sessions=1, calls_per_session=2)), trace)
    for args, said in (
        (["--trace", str(trace), "--pools", "h100-ish"], "unknown pool 'h100-ish'"),
        (["--trace", str(tmp_path / "missing.jsonl"), "--pools", "200"], "no such file"),
    ):
        assert main(["--format", "project", "--out", str(tmp_path / "never"), *args]) == 2
        assert said in capsys.readouterr().err
        assert not (tmp_path / "never.json").exists()
