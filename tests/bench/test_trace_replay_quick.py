"""``jiuwen-bench replay`` on real servers: the synthetic trace in all four formats,
vanilla vs plugin + hook, the simulator beside each run (about a minute on the shared servers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jiuwen_replay.cli import main
from jiuwen_replay.formats import FORMATS, WRITERS
from jiuwen_replay.synthetic import SyntheticConfig, generate
from vllm_affinity.testing import VLLMServer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("traces")
    trace = generate(SyntheticConfig(sessions=3, calls_per_session=8))
    out = {}
    for fmt in FORMATS:
        out[fmt] = folder / f"synthetic.{fmt}.jsonl"
        WRITERS[fmt](trace, out[fmt])
    return out


def replay(args: list[str], out: Path, name: str, scale: str = "0.125") -> dict:
    common = ["--model", "tiny", "--scale", scale, "--max-output-tokens", "4", "--quiet"]
    code = main(["replay", *args, *common, "--out", str(out), "--name", name, "--no-plot"])
    assert code == 0
    assert (out / f"{name}.md").read_text().count("\n| ") >= 2
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_vanilla_vs_plugin(
    fmt: str,
    traces: dict[str, Path],
    vllm_affinity_server,
    vllm_vanilla_server,
    tmp_path: Path,
) -> None:
    key = vllm_affinity_server.api_key
    result = replay(
        [
            "--trace", str(traces[fmt]), "--format", fmt, "--speed", "0", "--api-key", key,
            "--base-url", vllm_affinity_server.base_url,
            "--baseline-url", vllm_vanilla_server.base_url,
        ],
        tmp_path,
        f"replay_{fmt}",
    )  # fmt: skip
    assert result["meta"]["git_sha"] is not None and result["trace"]["format"] == fmt
    baseline, hooked = result["runs"]
    assert (baseline["side"], hooked["side"]) == ("baseline", "hooked")
    # Mooncake has no session ids, and its reader never guesses a rewrite (another conversation
    # with the same start would lose what it reads): the hook has nothing to release there
    guessed = fmt == "mooncake"
    assert guessed or result["trace"]["transitions"].get("rewrite", 0) > 0
    for run in (baseline, hooked):
        assert run["errors"] == 0 and run["calls"] == result["trace"]["requests"]
        assert 0 < run["hit_rate"] < 1 and run["hit_rate"] == pytest.approx(
            run["server_hit_rate"], abs=0.005
        )
        sim = run["simulator"]
        assert abs(sim["sim_minus_real"]) <= 0.01, sim
        assert sim["infinite"] >= sim["belady"] >= sim["hit_rate"] - 1e-9
        assert len(run["per_call"]) == run["calls"]
        # where the TTFT went: vLLM's own histograms saw exactly this run's calls, and its
        # TTFT is inside the client's (which adds the wire and the client's own work)
        server = run["server"]
        assert server["requests"] == run["calls"], (server, run["calls"])
        assert 0 < server["ttft_ms_mean"] <= run["ttft_ms_mean"], (server, run["ttft_ms_mean"])
        assert 0 <= run["pre_send_ms_p50"] < run["ttft_ms_mean"], run
    assert baseline["simulator"]["policy"] == "lru" and "releases" not in baseline
    # release, and the predicted-return picker on the call order (on as shipped)
    assert hooked["simulator"]["policy"] == "lifecycle+return-unguarded"
    assert hooked["engine_state"] == "in_request"
    releases = hooked.get("releases", {})
    assert (guessed or releases["in_request"] > 0) and releases.get("not_applied", 0) == 0
    assert hooked["computed_tokens"] <= baseline["computed_tokens"], (hooked, baseline)


def test_coding_agent_on_messages_with_subagents(
    traces: dict[str, Path], vllm_affinity_server, vllm_vanilla_server, tmp_path: Path
) -> None:
    """The anthropic SDK on ``/v1/messages``, subagents naming their lead, and the finish
    signals a real model gives: served without an error, every subagent's end seen by the
    plugin and its blocks released. (Whether it computes fewer prompt tokens than vanilla is
    the benchmark's question, on fresh servers: here both carry earlier tests' history.)"""
    server = vllm_affinity_server
    before = server.engine_stats()
    result = replay(
        [
            "--trace", str(traces["agentinfer"]), "--format", "agentinfer", "--speed", "0",
            "--api", "messages", "--next-use", "finish", "--api-key", server.api_key,
            "--base-url", server.base_url, "--baseline-url", vllm_vanilla_server.base_url,
        ],
        tmp_path,
        "replay_messages",
    )  # fmt: skip
    baseline, hooked = result["runs"]
    for run in (baseline, hooked):
        assert run["errors"] == 0 and run["calls"] == result["trace"]["requests"]
        assert run["hit_rate"] == pytest.approx(run["server_hit_rate"], abs=0.005)
    assert hooked["engine_state"] == "in_request" and hooked["releases"]["in_request"] > 0
    after = server.engine_stats()
    ended = after.get("children_ended", 0) - before.get("children_ended", 0)
    assert ended == result["trace"]["subagents"]
    # each end acted on the subagent's blocks: released them, or kept its instructions
    acted = {
        key: after.get(key, 0) - before.get(key, 0)
        for key in ("block_released_child_end", "blocks_kept_instructions")
    }
    assert sum(acted.values()) > 0, acted


def test_one_url_alternates_with_and_without_the_hook(
    traces: dict[str, Path],
    vllm_vanilla_server,
    tmp_path: Path,
) -> None:
    """Against vanilla vLLM alone the hook changes nothing (and sends no release)."""
    result = replay(
        [
            "--trace", str(traces["project"]), "--format", "project", "--speed", "50",
            "--api-key", vllm_vanilla_server.api_key, "--rounds", "2",
            "--base-url", vllm_vanilla_server.base_url,
        ],
        tmp_path,
        "one_url",
    )  # fmt: skip
    sides = [(r["round"], r["side"]) for r in result["runs"]]
    assert sides == [(1, "no hook"), (1, "hooked"), (2, "hooked"), (2, "no hook")]
    hooked = [r for r in result["runs"] if r["hooked"]]
    assert all(r["engine_state"] == "unsupported" for r in hooked)
    # at most the first release POSTs before the 404 is learnt; nothing is ever applied
    assert all(r["releases"]["in_request"] == r["releases"]["post"] == 0 for r in hooked)
    assert all(r["releases"]["not_applied"] <= 1 for r in hooked)
    rates = {r["hit_rate"] for r in result["runs"]}
    assert max(rates) - min(rates) <= 0.02, rates  # concurrent calls: a little order noise


def test_lifecycle_signals_agree_with_the_simulator(
    traces: dict[str, Path],
    empty_plugin_server: VLLMServer,
    vllm_vanilla_server: VLLMServer,
    tmp_path: Path,
) -> None:
    """The plugin's session lifecycle acting on ``--next-use finish`` under pool pressure:
    idle sessions' blocks go first, as the simulator's ``lifecycle`` policy says."""
    server = empty_plugin_server
    result = replay(
        [
            "--trace", str(traces["agentx"]), "--format", "agentx", "--speed", "0",
            "--api-key", server.api_key, "--next-use", "finish", "--base-url", server.base_url,
            "--baseline-url", vllm_vanilla_server.base_url,
        ],
        tmp_path,
        "lifecycle",
        scale="0.5",  # prompts of up to ~1,100 tokens: more than the 96-block pool holds
    )  # fmt: skip
    hooked = next(r for r in result["runs"] if r["hooked"])
    assert hooked["simulator"]["infinite"] > hooked["simulator"]["belady"]  # under pressure
    assert hooked["simulator"]["policy"] == "lifecycle+return-unguarded"  # the picker too
    # This small trace under heavy pressure leaves the real server 0.015 below the simulator
    # (deterministic here; the benchmark's larger traces agree within 0.007): 0.02 bounds it.
    assert abs(hooked["simulator"]["sim_minus_real"]) <= 0.02, hooked["simulator"]
    assert result["options"]["next_use"] == "finish"


def test_bad_trace_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    command = [sys.executable, "-m", "jiuwen_replay", "replay", "--trace", str(bad)]
    command += ["--format", "mooncake", "--base-url", "http://127.0.0.1:9/v1", "--model", "m"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"{bad}:1" in done.stderr and "hash_ids" in done.stderr
    assert "Traceback" not in done.stderr


def test_agent_headers_without_a_hook_compute_no_more_than_vanilla(
    traces: dict[str, Path], empty_plugin_server: VLLMServer, tmp_path: Path
) -> None:
    """No hook: each call carries only a coding agent's own session headers, and the server
    tells the trace's rewrites from the windows (``--agent-headers``), under pool pressure.
    Vanilla's side is the same server and pool with no session named (the plugin binds
    nothing: LRU, as vanilla vLLM)."""
    server = empty_plugin_server
    before = server.affinity_stats()["api_server"]
    result = replay(
        [
            "--trace", str(traces["agentx"]), "--format", "agentx", "--speed", "0",
            "--api-key", server.api_key, "--base-url", server.base_url, "--agent-headers",
        ],
        tmp_path,
        "agent_headers",
        scale="0.5",
    )  # fmt: skip
    baseline, hooked, headers = result["runs"]
    assert baseline["side"] == "no hook" and baseline["simulator"]["policy"] == "lru"
    assert headers["side"] == "agent headers" and not headers["hooked"]
    assert headers["errors"] == 0 and headers["calls"] == result["trace"]["requests"]
    assert headers["computed_tokens"] <= baseline["computed_tokens"], (headers, baseline)
    # Near the hook's run, but not equal, and not from the headers: the three runs share one
    # server, and the headers' run comes last. The hooked run before it names its sessions and
    # never ends them (no --end-sessions), so its 63-block pool is left full of blocks of six
    # sessions that will never call again, and the picker (on as shipped) reads them as
    # overdue, "due as long again as they have been away" (docs/decisions.md, *How it became
    # the default*: its remaining weakness), later than the headers run's new sessions: it
    # spares them and evicts lead0's and lead1's first windows (calls 4 and 5 hit 0 tokens
    # where the hooked run hit 320 each) and part of lead2's (call 11: 320 against 512). The
    # no-hook run before the hooked one names no session, so its blocks go in LRU's order.
    # Measured (deterministic: the same in two cycles): 10,032 prompt tokens computed against
    # the hook's 9,200 (1.090x; vanilla 11,184). The simulator on the same tokens, started
    # after the hooked run's requests under their own names, gives exactly 10,032 and those
    # per-call misses; started empty, as the replay runs it, the hook's 9,200.
    assert headers["computed_tokens"] <= hooked["computed_tokens"] * 1.10, (headers, hooked)
    assert headers["simulator"]["policy"] == "lifecycle+return-unguarded"
    assert abs(hooked["simulator"]["sim_minus_real"]) <= 0.01, hooked["simulator"]  # 0.0
    # Hence the simulator (from an empty pool: 0.5267, the hooked run's real rate to the
    # fourth decimal) above the real 0.4840 by 0.0427, bounded so it cannot grow.
    assert abs(headers["simulator"]["sim_minus_real"]) <= 0.05, headers["simulator"]
    # every session's windows were judged from its headers (the hooked run's carry none)
    after = server.affinity_stats()["api_server"]
    judged = {v: after.get(f"windows.{v}", 0) - before.get(f"windows.{v}", 0)
              for v in ("first", "append", "retry", "rewrite")}  # fmt: skip
    assert judged["first"] == result["trace"]["sessions"], judged
    assert sum(judged.values()) == headers["calls"], judged


@pytest.mark.parametrize("fmt", ["agentinfer", "agentx"])
def test_ending_sessions_computes_no_more_than_vanilla(
    fmt: str, traces: dict[str, Path], empty_plugin_server: VLLMServer, tmp_path: Path
) -> None:
    """The quick form of "never worse": the hook ends every session after its last call and
    tells the plugin how each call ended, under pool pressure, and computes no more prompt
    tokens than the same calls with no session named on the same pool (LRU, as vanilla)."""
    server = empty_plugin_server
    result = replay(
        [
            "--trace", str(traces[fmt]), "--format", fmt, "--speed", "0",
            "--api-key", server.api_key, "--base-url", server.base_url,
            "--next-use", "finish", "--end-sessions",
        ],
        tmp_path,
        f"ends_{fmt}",
        scale="0.5",
    )  # fmt: skip
    baseline, hooked = result["runs"]
    assert baseline["side"] == "no hook" and hooked["side"] == "hooked"
    assert hooked["simulator"]["infinite"] > hooked["simulator"]["belady"]  # under pressure
    assert hooked["errors"] == baseline["errors"] == 0
    assert hooked["computed_tokens"] <= baseline["computed_tokens"], (hooked, baseline)
