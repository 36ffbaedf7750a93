"""Agents that name no session, unmodified: aider 0.86 (PyPI) and Qwen Code with its request
metadata off (its default). Nothing on the wire names their sessions; with
``VLLM_AFFINITY_IMPLICIT_SESSIONS=answers`` (the agents' server sets it) each request is bound to
the conversation whose answers its window carries back (``core/answer_chains.py``; here in the
engine: the server runs two API servers). Every call succeeds, a turn that resends the last
answer continues its chain, only what no window hits again is released (aider's dropped
reminder), and the prefix cache serves the rest as it would on vanilla."""

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


def nothing_released(delta: Delta) -> None:
    assert delta["windows.rewrite"] == 0 and delta["releases"] == 0, delta.changed()


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{Path(cmd[0]).name} exited {done.returncode}:\n{done.stderr}"
    return done.stdout


def test_aider_turns_are_one_conversation_and_only_its_dropped_reminder_is_released(
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
    deltas = []
    for turn, text in enumerate(("first question about the weather", "second question")):
        resume = ["--restore-chat-history"] if turn else []
        out = run([str(AIDER), *flags, *resume, "--message", text, "math.py"], env, project)
        assert "summary ok." in out, out  # the model's answer, shown
        deltas.append(watch())
    first, second = deltas
    # the first turn starts a conversation
    assert first["implicit.started"] >= 1 and first["windows.first"] >= 1, first.changed()
    nothing_released(first)
    # the second (its history restored from aider's file) carries the first answer back: the
    # same conversation. aider dropped the reminder its last user message carried and went on:
    # a rewrite from there, whose blocks (the old reminder and what followed it) no window hits
    # again; nothing released was hit again
    assert second["implicit.continued"] >= 1, second.changed()
    assert second["windows.rewrite"] == 1 and second["block_released_compaction"] > 0
    assert second["released_hit"] == 0, second.changed()
    # the second turn resent the first (its history restored): the cache served that part
    assert agents_server.metric("vllm:prefix_cache_hits_total") - hits >= 512


def test_qwen_code_without_request_metadata_is_bound_and_releases_nothing(
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
    delta = watch()
    assert delta["implicit.started"] >= 1, delta.changed()  # bound to a conversation of its own
    nothing_released(delta)
