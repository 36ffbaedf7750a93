"""The real coding agents (Claude Code, the Codex CLI: npm packages that ``make test`` installs
into ``.cache/agents``) driven headless against a plugin server serving the ``long`` model."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vllm_affinity.pytest_plugin import shared_server
from vllm_affinity.testing import SERVED_NAME, VLLMServer
from vllm_affinity.tiny_model import build

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".cache" / "agents" / "node_modules" / ".bin"
API_KEY = "sk-agents-test-000000"


def _agents_server() -> VLLMServer:
    return VLLMServer(
        model=build(size="long"),
        plugin=True,
        num_blocks=6144,  # 196k tokens: one 128k-token request fits
        max_model_len=131072,
        eager=True,
    )


#: Plugin server for the coding agents (the long model; no API key: agents send any).
agents_server = shared_server("agents_server", _agents_server)


def installed(name: str) -> Path:
    """The agent's binary, or a skip that says why it is missing."""
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed in .cache/agents: npm could not reach its registry")
    return path


def counters(server: VLLMServer) -> dict[str, int]:
    """The engine's counters and segments and the API server's window verdicts, flat."""
    stats = server.affinity_stats()
    (engine,) = stats["engines"]
    flat = {k: v for k, v in engine.items() if isinstance(v, int)}
    flat.update({f"segment.{k}": v for k, v in engine["segments"].items()})
    flat.update({k: v for k, v in stats["api_server"].items() if k.startswith("windows.")})
    return flat


@dataclass
class Delta:
    """What one call changed in the server's counters."""

    before: dict[str, int]
    after: dict[str, int]

    def __getitem__(self, name: str) -> int:
        return self.after.get(name, 0) - self.before.get(name, 0)


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> str:
    done = subprocess.run(
        cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{cmd[:3]} exited {done.returncode}:\n{done.stderr[-2000:]}"
    return done.stdout


@dataclass
class ClaudeCode:
    """Claude Code, headless (``-p``), in a home and a project folder of its own whose config
    answers its first-run dialogs."""

    binary: Path
    server: VLLMServer
    home: Path
    project: Path
    session: str = ""

    def env(self) -> dict[str, str]:
        return {
            "PATH": os.environ["PATH"],
            "HOME": str(self.home),
            "CLAUDE_CONFIG_DIR": str(self.home),
            "ANTHROPIC_BASE_URL": self.server.root_url,
            "ANTHROPIC_API_KEY": API_KEY,
            "ANTHROPIC_MODEL": SERVED_NAME,
            "ANTHROPIC_SMALL_FAST_MODEL": SERVED_NAME,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64",
        }

    def setup(self) -> ClaudeCode:
        self.project.mkdir(parents=True)
        subprocess.run(["git", "init", "-q", str(self.project)], check=True)
        config = {
            "hasCompletedOnboarding": True,
            "numStartups": 3,
            "customApiKeyResponses": {"approved": [API_KEY[-20:]], "rejected": []},
            "projects": {str(self.project): {"hasTrustDialogAccepted": True}},
        }
        (self.home / ".claude.json").write_text(json.dumps(config))
        return self

    def ask(self, prompt: str) -> dict[str, Any]:
        """One headless call (the session's first, or a resumed one): its JSON result."""
        if self.session:
            where = ["--resume", self.session]
        else:
            self.session = str(uuid.uuid4())
            where = ["--session-id", self.session]
        cmd = [str(self.binary), "-p", prompt, *where, "--output-format", "json"]
        cmd += ["--tools", "Bash,Read,Edit"]  # three tools keep its prompt (and CPU prefill) short
        result = json.loads(_run(cmd, self.env(), self.project, timeout=600))
        assert not result.get("is_error"), result
        return result


@dataclass
class CodexCli:
    """The Codex CLI, headless (``codex exec``), with a ``config.toml`` of its own that points
    it at the server's Responses API."""

    binary: Path
    server: VLLMServer
    home: Path
    project: Path
    thread: str = ""
    used: dict[str, int] | None = None  # the thread's usage so far (Codex reports it summed)

    def env(self) -> dict[str, str]:
        return {
            "PATH": os.environ["PATH"],
            "HOME": str(self.home),
            "CODEX_HOME": str(self.home / ".codex"),
            "AGENTS_TEST_KEY": API_KEY,
        }

    def setup(self) -> CodexCli:
        self.project.mkdir(parents=True)
        subprocess.run(["git", "init", "-q", str(self.project)], check=True)
        (self.home / ".codex").mkdir(parents=True)
        (self.home / ".codex" / "config.toml").write_text(
            f'model = "{SERVED_NAME}"\n'
            'model_provider = "local"\n'
            "model_context_window = 131072\n"
            'approval_policy = "never"\n'
            'sandbox_mode = "read-only"\n'
            "[model_providers.local]\n"
            'name = "vLLM with vllm_affinity"\n'
            f'base_url = "{self.server.base_url}"\n'
            'wire_api = "responses"\n'
            'env_key = "AGENTS_TEST_KEY"\n'
        )
        return self

    def ask(self, prompt: str, compact_at: int = 1_000_000) -> dict[str, Any]:
        """One ``exec`` turn (the thread's first, or a resumed one), compacting first when the
        context passed ``compact_at`` tokens: the turn's own usage (all its requests)."""
        cmd = [str(self.binary), "exec", "--skip-git-repo-check", "--json"]
        cmd += ["-c", f"model_auto_compact_token_limit={compact_at}"]
        cmd += ["resume", self.thread, prompt] if self.thread else [prompt]
        events = [json.loads(line) for line in _run(cmd, self.env(), self.project, 600).splitlines()
                  if line.startswith("{")]  # fmt: skip
        for event in events:
            self.thread = self.thread or event.get("thread_id", "")
        assert not [e for e in events if e.get("type") in ("error", "turn.failed")], events
        (total,) = [e["usage"] for e in events if e.get("type") == "turn.completed"]
        before, self.used = self.used or {}, total
        return {k: v - before.get(k, 0) for k, v in total.items() if isinstance(v, int)}


@pytest.fixture
def claude_code(agents_server: VLLMServer, tmp_path: Path) -> ClaudeCode:
    home = tmp_path / "home"
    home.mkdir()
    return ClaudeCode(installed("claude"), agents_server, home, tmp_path / "project").setup()


@pytest.fixture
def codex_cli(agents_server: VLLMServer, tmp_path: Path) -> CodexCli:
    home = tmp_path / "home"
    home.mkdir()
    return CodexCli(installed("codex"), agents_server, home, tmp_path / "project").setup()


@pytest.fixture
def watch(agents_server: VLLMServer) -> Callable[[], Delta]:
    """``delta = watch()`` after a call: what that call changed (since the last ``watch()``)."""
    last = [counters(agents_server)]

    def step() -> Delta:
        now = counters(agents_server)
        delta = Delta(last[0], now)
        last[0] = now
        return delta

    return step
