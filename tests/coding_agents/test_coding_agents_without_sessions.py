"""Agents that name no session, unmodified: aider 0.86 (PyPI) and Qwen Code with its request
metadata off (its default). Nothing on the wire tells their sessions apart, so the server treats
their requests as vanilla vLLM does (docs/agents/aider.md): every call succeeds, no session is
bound, no window judged, nothing released or idled, and the prefix cache serves them as it
would on vanilla."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_affinity.testing import SERVED_NAME, VLLMServer

from .conftest import API_KEY, ROOT, Delta, installed

AIDER = ROOT / ".venv-aider" / "bin" / "aider"


def nothing_bound(delta: Delta) -> None:
    judged = sum(delta[f"windows.{v}"] for v in ("first", "append", "retry", "rewrite", "side"))
    assert delta["sessions"] == 0 and judged == 0, delta.after
    assert delta["releases"] == 0 and delta["idles"] == 0, delta.after


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{Path(cmd[0]).name} exited {done.returncode}:\n{done.stderr}"
    return done.stdout


def test_aider_turns_succeed_and_are_served_as_vanilla_serves_them(
    agents_server: VLLMServer, watch: Callable[[], Delta], tmp_path: Path
) -> None:
    if not AIDER.exists():
        pytest.skip("aider is not installed in .venv-aider: `make test` installs it")
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    home.mkdir()
    (project / "math.py").write_text("def add(a, b):\n    return a + b\n")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "OPENAI_API_KEY": API_KEY,
        "OPENAI_API_BASE": agents_server.base_url,
    }
    flags = ["--model", f"openai/{SERVED_NAME}", "--no-git", "--yes-always", "--no-stream"]
    flags += [
        "--no-check-update",
        "--no-show-model-warnings",
        "--no-analytics",
        "--map-tokens",
        "0",
    ]
    watch()
    hits = agents_server.metric("vllm:prefix_cache_hits_total")
    for turn, text in enumerate(("first question about the weather", "second question")):
        resume = ["--restore-chat-history"] if turn else []
        out = run([str(AIDER), *flags, *resume, "--message", text, "math.py"], env, project)
        assert "summary ok." in out, out  # the model's answer, shown
    nothing_bound(watch())
    # the second turn resent the first (its history restored): the cache served that part
    assert agents_server.metric("vllm:prefix_cache_hits_total") - hits >= 512


def test_qwen_code_without_request_metadata_is_served_as_vanilla_serves_it(
    agents_server: VLLMServer, watch: Callable[[], Delta], tmp_path: Path
) -> None:
    binary = installed("qwen")
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    (home / ".qwen").mkdir(parents=True)
    provider = {"id": SERVED_NAME, "name": SERVED_NAME, "baseUrl": agents_server.base_url,
                "envKey": "AGENTS_TEST_KEY"}  # fmt: skip
    settings = {
        "modelProviders": {"openai": [provider]},
        "security": {"auth": {"selectedType": "openai"}},
        "model": {"name": SERVED_NAME},
    }
    (home / ".qwen" / "settings.json").write_text(json.dumps(settings))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "AGENTS_TEST_KEY": API_KEY}
    cmd = [str(binary), "--approval-mode", "yolo", "--system-prompt", "You code."]
    cmd += ["--core-tools", "read_file,edit,run_shell_command", "--output-format", "json"]
    watch()
    events = json.loads(run([*cmd, "-p", "first question about the weather"], env, project))
    (result,) = [e for e in events if e.get("type") == "result"]
    assert not result.get("is_error") and result["result"] == "summary ok.", result
    nothing_bound(watch())
