"""Every committed benchmark result says what produced it: ``meta`` holds the command, the git
commit, the library versions and the CPU (``jiuwen_replay.output.run_metadata``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
REQUIRED = {"command", "date", "git_sha", "python", "vllm", "openai", "cpu_model", "cpu_count"}


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_result_carries_its_run_metadata(path: Path) -> None:
    meta = json.loads(path.read_text()).get("meta")
    assert isinstance(meta, dict), f"{path.name} has no meta: re-run its benchmark"
    missing = REQUIRED - meta.keys()
    assert not missing, f"{path.name}: meta lacks {sorted(missing)}"
    assert meta["git_sha"] and meta["command"].split()[0].endswith(".py")


def test_there_are_results() -> None:
    assert len(list(RESULTS.glob("*.json"))) >= 10


def test_benchmarks_run_as_modules_from_the_repository_root() -> None:
    """``python -m benchmarks.<name>`` from a clone, with no ``PYTHONPATH``."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.agents.agent_bench", "--help"],
        cwd=RESULTS.parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--pools" in done.stdout
