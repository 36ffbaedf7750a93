"""``benchmarks/engine/engine_scale.py`` on a small cell: both drivers run vLLM's real classes,
vanilla with every plugin wrapper set aside, and report what they measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import wrapt
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler

from benchmarks.engine import engine_scale
from vllm_affinity.engine import affinity_of, apply_engine_patches

apply_engine_patches()


def test_vanilla_runs_vllm_as_installed() -> None:
    assert isinstance(vars(Scheduler)["schedule"], wrapt.FunctionWrapper)
    with engine_scale.unpatched():
        assert not isinstance(vars(Scheduler)["schedule"], wrapt.FunctionWrapper)
        assert not isinstance(vars(KVCacheManager)["free"], wrapt.FunctionWrapper)
        vanilla = engine_scale.build(engine_scale.Cell(2000, 2048, 4), "scheduler", plugin=False)
    assert isinstance(vars(KVCacheManager)["free"], wrapt.FunctionWrapper)
    assert affinity_of(vanilla.engine.kv_cache_manager.block_pool) is None


@pytest.mark.parametrize("driver", ["scheduler", "manager"])
def test_a_small_cell_reports_both_sides(driver: str, tmp_path: Path) -> None:
    argv = ["--cells", "1500:2048:6", "--rounds", "2", "--driver", driver, "--out", str(tmp_path)]
    assert engine_scale.main(argv) == 0
    (row,) = json.loads((tmp_path / "engine_scale.json").read_text())["rows"]
    assert row["driver"] == driver and row["vanilla_ms"] > 0 and row["plugin_ms"] > 0
    # the same traffic on both sides: the sessions' shared system prompt is hit on both
    assert min(row["hit_tokens"].values()) >= engine_scale.SYSTEM
    assert row["plugin_own_ms"] > 0  # the plugin timed its own work on the scheduler's path
    text = (tmp_path / "engine_scale.md").read_text()
    assert text.startswith(f"Command: `python -m benchmarks.engine.engine_scale {' '.join(argv)}`")


def test_control_runs_vanilla_against_itself(tmp_path: Path) -> None:
    """``--control`` adds, per cell, the ratio of vLLM against itself (both sides vanilla): the
    spread a reader weighs the plugin's ratio against."""
    argv = ["--cells", "1500:2048:6", "--rounds", "4", "--control", "--out", str(tmp_path)]
    assert engine_scale.main(argv) == 0
    (row,) = json.loads((tmp_path / "engine_scale.json").read_text())["rows"]
    control = row["control"]
    assert len(control["round_ratios"]) == 4 and control["ratio"] > 0
    steady = sorted(control["round_ratios"][2:])
    assert control["ratio"] == (steady[0] + steady[1]) / 2  # the steady rounds' median
    header, rule, line = (tmp_path / "engine_scale.md").read_text().splitlines()[4:7]
    assert header.endswith("vanilla against itself |") and rule.endswith("---:|")
    assert line.endswith(f"x{control['ratio']:.2f} |")


def test_runs_report_the_median_run_with_every_runs_ratio(tmp_path: Path) -> None:
    """``--runs 3`` runs the cell three times over: the row is the run with the median ratio,
    every run's ratio is kept in run order and listed in the table; an even count is
    refused (no median run)."""
    argv = ["--cells", "1500:2048:6", "--rounds", "2", "--runs", "3", "--out", str(tmp_path)]
    assert engine_scale.main(argv) == 0
    (row,) = json.loads((tmp_path / "engine_scale.json").read_text())["rows"]
    ratios = row["run_ratios"]
    assert row["runs"] == len(ratios) == 3 and row["ratio"] == sorted(ratios)[1]
    header, rule, line = (tmp_path / "engine_scale.md").read_text().splitlines()[4:7]
    assert header.endswith("every run's ratio |") and rule.endswith("---|")
    assert line.endswith(" " + ", ".join(f"x{r:.3f}" for r in ratios) + " |")
    with pytest.raises(SystemExit):
        engine_scale.main(["--runs", "2", "--out", str(tmp_path)])
