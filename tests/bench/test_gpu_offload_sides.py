"""The GPU script (``benchmarks/gpu/offload_sides.py``): its four servers' commands, bad input
refused, and (``make test-bench``) its no-offload half run for real on the CPU build with the
small local model, as a GPU run would go (vLLM's CPU build cannot run the offload worker)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.gpu import offload_sides


def test_the_four_servers_differ_only_in_the_plugin_and_the_cpu_tier(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert offload_sides.main(["--model", "m", "--cpu-gib", "2", "--dry-run"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert list(lines) == ["vanilla", "vanilla+offload", "plugin", "plugin+offload"]
    for side, cmd in lines.items():
        assert ("--vanilla" in cmd) == side.startswith("vanilla")
        assert ("OffloadingConnector" in cmd) == side.endswith("+offload")
    assert str(2 << 30) in lines["plugin+offload"]  # the tier's bytes


def test_an_unknown_side_or_a_missing_trace_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "never")
    assert offload_sides.main(["--model", "m", "--sides", "plugin,gpu", "--out", out]) == 2
    assert "unknown sides ['gpu']" in capsys.readouterr().err
    missing = str(tmp_path / "missing.jsonl")
    assert offload_sides.main(["--model", "m", "--trace", missing, "--out", out]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.e2e
@pytest.mark.skipif(
    not os.environ.get("JIUWEN_BENCH_PIPELINES"),
    reason="JIUWEN_BENCH_PIPELINES=1 (make test-bench)",
)
def test_the_no_offload_half_runs_on_this_machine(tmp_path: Path) -> None:
    from jiuwen_replay.formats import write_agentinfer
    from jiuwen_replay.synthetic import SyntheticConfig, generate
    from vllm_affinity.testing.tiny_model import build

    trace = tmp_path / "trace.jsonl"  # the agentinfer format, as the Claude Code trace's
    write_agentinfer(generate(SyntheticConfig(sessions=3, calls_per_session=8)), trace)
    out = tmp_path / "gpu"
    argv = [
        "--model", str(build()), "--trace", str(trace), "--sides", "vanilla,plugin",
        "--scale", "0.25", "--max-model-len", "2048", "--max-output-tokens", "4",
        "--gpu-memory-utilization", "0.3",  # on the CPU build: a share of the RAM
        "--vllm-args", "--dtype bfloat16 --num-gpu-blocks-override 128 --block-size 32",
        "--quiet", "--out", str(out),
    ]  # fmt: skip
    assert offload_sides.main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    vanilla, plugin = rows
    assert vanilla["sources"]["local_compute"] > 0
    assert sum(vanilla["sources"].values()) == sum(plugin["sources"].values()) > 0
    assert plugin["released_hit"] == 0
