"""The real coding agents (Claude Code, the Codex CLI, opencode: npm packages that ``make test``
installs into ``.cache/agents``) driven headless against a plugin server serving the ``long``
model."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.fleet.vllm_router import POLICIES, Router, router_binary
from vllm_affinity.core.compaction import VERDICTS
from vllm_affinity.testing import SERVED_NAME, NginxRouter, VLLMServer, free_port
from vllm_affinity.testing.pytest_plugin import shared_server
from vllm_affinity.testing.tiny_model import build

from .scripted_answers import FILE_ENV as SCRIPTED_ANSWERS_ENV
from .scripted_answers import FQCN as SCRIPTED_ANSWERS_FQCN

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".cache" / "agents" / "node_modules" / ".bin"
API_KEY = "sk-agents-test-000000"


#: The file through which a test scripts the model's answers (``scripted_answers.py``).
SCRIPTED_ANSWERS = Path(tempfile.gettempdir()) / f"jiuwen-scripted-answers-{os.getpid()}"


def _agents_server() -> VLLMServer:
    SCRIPTED_ANSWERS.unlink(missing_ok=True)
    return VLLMServer(
        model=build(size="long"),
        plugin=True,
        num_blocks=6144,  # 196k tokens: one 128k-token request fits
        max_model_len=131072,
        eager=True,
        worker_in_engine=True,
        # two API-server processes, each taking connections as they come: every agent's
        # windows are judged by the engine, which sees all of a session's requests; and a
        # model that answers what a test scripts
        extra_args=("--api-server-count", "2", "--logits-processors", SCRIPTED_ANSWERS_FQCN),
        env={
            # agents that name no session get the chains of their answers (aider, Qwen Code
            # without its request metadata); the others are not touched by it
            "VLLM_AFFINITY_IMPLICIT_SESSIONS": "answers",
            SCRIPTED_ANSWERS_ENV: str(SCRIPTED_ANSWERS),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        },
    )


#: Plugin server for the coding agents (the long model; no API key: agents send any).
agents_server = shared_server("agents_server", _agents_server)


def missing(reason: str) -> None:
    """Skip with ``reason`` on a developer's machine; fail with it in CI (``CI`` set, as
    ``.ci/run`` runs), where a run that skipped every agent must not pass."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: a missing agent fails the run)")
    pytest.skip(reason)


def installed(name: str) -> Path:
    """The agent's binary, or a skip (a failure in CI) that says why it is missing."""
    path = BIN / name
    if not path.exists():
        missing(f"{name} is not installed in .cache/agents: npm could not reach its registry")
    return path


def counters(server: VLLMServer) -> dict[str, int]:
    """The engine's counters and segments and the window verdicts of every API server, flat."""
    (engine,) = server.affinity_stats()["engines"]
    flat = {k: v for k, v in engine.items() if isinstance(v, int)}
    flat.update({f"segment.{k}": v for k, v in engine["segments"].items()})
    for verdict in VERDICTS:
        count = server.metric("vllm_affinity_agent_windows_total", verdict=verdict)
        flat[f"windows.{verdict}"] = int(count)
    for outcome in ("continued", "started", "side"):
        count = server.metric("vllm_affinity_implicit_sessions_total", outcome=outcome)
        flat[f"implicit.{outcome}"] = int(count)
    return flat


@dataclass
class Delta:
    """What one call changed in the server's counters."""

    before: dict[str, int]
    after: dict[str, int]
    answer: dict[str, Any] = field(default_factory=dict)  # the call's own result, if kept

    def __getitem__(self, name: str) -> int:
        return self.after.get(name, 0) - self.before.get(name, 0)

    def changed(self) -> dict[str, int]:
        """The counters the call changed, and by how much (for failure messages)."""
        return {k: self[k] for k in self.after.keys() | self.before.keys() if self[k]}


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
    session: str = ""  # chosen before the first call, or a new UUID
    asked: bool = False

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
        if self.asked:
            where = ["--resume", self.session]
        else:
            self.session = self.session or str(uuid.uuid4())
            where = ["--session-id", self.session]
        self.asked = True
        cmd = [str(self.binary), "-p", prompt, *where, "--output-format", "json"]
        cmd += ["--tools", "Bash,Read,Edit"]  # three tools keep its prompt (and CPU prefill) short
        result = json.loads(_run(cmd, self.env(), self.project, timeout=600))
        assert not result.get("is_error"), result
        return result


#: Claude Code's input prompt, on screen once it waits for the user.
PROMPT = "\u276f"


@dataclass
class Tmux:
    """An agent in a tmux window of its own (a tmux server of its own, killed by ``stop``),
    typed into and read from the screen as a person would. ``busy``: what the agent shows
    while it works."""

    agent: str
    busy: str
    history: int = 200  # screen lines read back
    socket: str = field(default_factory=lambda: f"agents-{uuid.uuid4().hex[:8]}")

    def run(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True)
        assert done.returncode == 0, f"tmux {args[0]}: {done.stderr}"
        return done.stdout

    def launch(self, cwd: Path, env: dict[str, str], command: list[str]) -> None:
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        self.run(
            "new-session", "-d", "-s", "agent", "-x", "160", "-y", "50", "-c", str(cwd),
            f"env -i {exports} {shlex.join(command)}",
        )  # fmt: skip

    def stop(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "agent", "-S", f"-{self.history}")

    def wait_for(self, ready: Callable[[str], bool], what: str, timeout: float = 300) -> str:
        """The screen, once ``ready`` holds for it and the agent is not working."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if ready(screen) and self.busy not in screen:
                return screen
            time.sleep(0.5)
        raise AssertionError(f"{self.agent} did not show {what} in {timeout:.0f} s:\n{screen}")

    def type(self, line: str, shown: str) -> str:
        """Types ``line`` and Enter; the screen once it shows ``shown`` once more than before."""
        count = self.screen().count(shown)
        self.run("send-keys", "-t", "agent", "-l", line)
        self.run("send-keys", "-t", "agent", "Enter")
        screen = self.wait_for(lambda now: now.count(shown) > count, repr(shown))
        assert "API Error" not in screen, screen
        return screen


@dataclass
class InteractiveClaudeCode(ClaudeCode):
    """Claude Code as a person runs it: interactive, in a tmux window of its own. Interactively
    it sends a side request (no tools) beside each turn's main one."""

    terminal: Tmux = field(default_factory=lambda: Tmux("Claude Code", "esc to interrupt"))

    def start(self) -> InteractiveClaudeCode:
        env = self.env()
        env.pop("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC")  # it turns the side requests off
        env["TERM"] = "xterm-256color"
        self.terminal.launch(self.project, env, [str(self.binary), "--tools", "Bash,Read,Edit"])
        self.terminal.wait_for(lambda screen: PROMPT in screen, "its prompt")
        return self

    def stop(self) -> None:
        self.terminal.stop()

    def type(self, line: str, shown: str) -> str:
        return self.terminal.type(line, shown)


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


@dataclass
class OpenCode:
    """opencode as its own clients drive it: ``opencode serve`` (a home, a project and a
    provider configuration of its own, on a free port), its sessions created, prompted and
    summarized over its HTTP API."""

    binary: Path
    server: VLLMServer
    home: Path
    project: Path
    context: int  # the model's context as opencode is told it: it auto-compacts near it
    process: subprocess.Popen[str] | None = None
    url: str = ""

    def start(self) -> OpenCode:
        self.project.mkdir(parents=True)
        subprocess.run(["git", "init", "-q", str(self.project)], check=True)
        model = {"limit": {"context": self.context, "output": 64}}
        config = {
            "provider": {
                "vllm": {
                    "npm": "@ai-sdk/openai-compatible",
                    "options": {"baseURL": self.server.base_url, "apiKey": API_KEY},
                    "models": {SERVED_NAME: model},
                }
            },
            "model": f"vllm/{SERVED_NAME}",
            "small_model": f"vllm/{SERVED_NAME}",
            "autoupdate": False,
            "share": "disabled",
        }
        (self.project / "opencode.json").write_text(json.dumps(config))
        port = free_port()
        env = {"PATH": os.environ["PATH"], "HOME": str(self.home)}
        env |= {f"XDG_{d}_HOME": str(self.home / d.lower()) for d in ("CONFIG", "DATA", "CACHE")}
        self.process = subprocess.Popen(
            [str(self.binary), "serve", "--port", str(port), "--hostname", "127.0.0.1"],
            env=env, cwd=self.project, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"opencode serve exited: {self.process.stderr}"
            try:
                if httpx.get(self.url + "/session", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError("opencode serve did not answer in 60 s")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        reply = httpx.post(self.url + path, json=body, timeout=600)
        assert reply.status_code == 200, f"opencode {path}: {reply.status_code} {reply.text[:500]}"
        return reply.json()

    def new_session(self) -> str:
        return str(self._post("/session", {})["id"])

    def say(self, session: str, text: str) -> dict[str, Any]:
        """One turn: the assistant message's info (its ``tokens``, ``summary``, ``error``)."""
        model = {"providerID": "vllm", "modelID": SERVED_NAME}
        reply = self._post(
            f"/session/{session}/message",
            {"parts": [{"type": "text", "text": text}], "model": model},
        )
        info: dict[str, Any] = reply["info"]
        assert not info.get("error"), info
        return info

    def summarize(self, session: str) -> None:
        """``/compact`` in its TUI: the session's summary, its window compacted."""
        assert (
            self._post(
                f"/session/{session}/summarize", {"providerID": "vllm", "modelID": SERVED_NAME}
            )
            is True
        )

    def compactions(self, session: str) -> int:
        """How many compactions the session went through (its messages with a compaction part)."""
        messages = httpx.get(f"{self.url}/session/{session}/message", timeout=30).json()
        return sum(p["type"] == "compaction" for m in messages for p in m["parts"])


@dataclass
class InteractiveQwenCode:
    """Qwen Code as a person runs it: interactive, in a tmux window of its own, with request
    metadata on (its provider entry's ``enableRequestMetadata``, and the server named its
    DashScope proxy): each request's body names its
    session and its kind. A short system prompt and three core tools keep its prompt (and CPU
    prefill) short; its memory extractor and next-prompt suggestion run as they do by default."""

    binary: Path
    server: VLLMServer
    home: Path
    project: Path
    terminal: Tmux = field(default_factory=lambda: Tmux("Qwen Code", "esc to cancel", 300))
    #: False: its default, no session on the wire (the server tells it from its answers)
    request_metadata: bool = True

    def start(self) -> InteractiveQwenCode:
        self.project.mkdir(parents=True)
        subprocess.run(["git", "init", "-q", str(self.project)], check=True)
        generation: dict[str, Any] = {"contextWindowSize": 131072}
        if self.request_metadata:
            generation["enableRequestMetadata"] = True
        provider = {
            "id": SERVED_NAME,
            "name": SERVED_NAME,
            "baseUrl": self.server.base_url,
            "envKey": "AGENTS_TEST_KEY",
            "generationConfig": generation,
        }
        settings = {
            "modelProviders": {"openai": [provider]},
            "security": {"auth": {"selectedType": "openai"}},
            "model": {"name": SERVED_NAME},
        }
        (self.home / ".qwen").mkdir(parents=True)
        (self.home / ".qwen" / "settings.json").write_text(json.dumps(settings))
        env = {"PATH": os.environ["PATH"], "HOME": str(self.home), "TERM": "xterm-256color"}
        env["AGENTS_TEST_KEY"] = API_KEY
        if self.request_metadata:  # it goes to DashScope only: the proxy makes the server one
            env["DASHSCOPE_PROXY_BASE_URL"] = self.server.base_url
        command = [str(self.binary), "--approval-mode", "yolo", "--system-prompt", "You code."]
        command += ["--core-tools", "read_file,edit,run_shell_command"]
        self.terminal.launch(self.project, env, command)
        self.terminal.wait_for(lambda screen: "Type your message" in screen, "its prompt")
        return self

    def stop(self) -> None:
        self.terminal.stop()

    def type(self, line: str, shown: str) -> str:
        return self.terminal.type(line, shown)


@pytest.fixture
def claude_code(agents_server: VLLMServer, tmp_path: Path) -> ClaudeCode:
    home = tmp_path / "home"
    home.mkdir()
    return ClaudeCode(installed("claude"), agents_server, home, tmp_path / "project").setup()


@pytest.fixture
def interactive_claude_code(
    agents_server: VLLMServer, tmp_path: Path
) -> Iterator[InteractiveClaudeCode]:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: `make debian-tools` installs it")
    home = tmp_path / "home"
    home.mkdir()
    agent = InteractiveClaudeCode(installed("claude"), agents_server, home, tmp_path / "project")
    agent.setup()
    try:
        yield agent.start()
    finally:
        agent.stop()


@pytest.fixture
def codex_cli(agents_server: VLLMServer, tmp_path: Path) -> CodexCli:
    home = tmp_path / "home"
    home.mkdir()
    return CodexCli(installed("codex"), agents_server, home, tmp_path / "project").setup()


@pytest.fixture
def opencode(agents_server: VLLMServer, tmp_path: Path) -> Iterator[OpenCode]:
    home = tmp_path / "home"
    home.mkdir()
    # its prompt (system and tools) is ~23k tokens of the test model's tokenizer: a context of
    # 26k makes it compact on its own after a few turns of ~2k tokens
    agent = OpenCode(installed("opencode"), agents_server, home, tmp_path / "project", 26000)
    try:
        yield agent.start()
    finally:
        agent.stop()


@pytest.fixture(params=[True], ids=["metadata"])
def interactive_qwen_code(
    agents_server: VLLMServer, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[InteractiveQwenCode]:
    """Qwen Code interactive; ``request.param`` (indirect parametrisation): its request
    metadata on (the default here) or off (its own default)."""
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: `make debian-tools` installs it")
    home = tmp_path / "home"
    home.mkdir()
    agent = InteractiveQwenCode(
        installed("qwen"), agents_server, home, tmp_path / "project",
        request_metadata=bool(request.param),
    )  # fmt: skip
    try:
        yield agent.start()
    finally:
        agent.stop()


def quiet(server: VLLMServer, timeout: float = 60) -> None:
    """Until the server has no request running or waiting (a side request may still be under
    way when the screen shows the answer)."""
    deadline, calm = time.monotonic() + timeout, 0
    while time.monotonic() < deadline and calm < 3:
        busy = server.metric("vllm:num_requests_running") + server.metric(
            "vllm:num_requests_waiting"
        )
        calm = 0 if busy else calm + 1
        time.sleep(0.3)


@pytest.fixture
def watch(agents_server: VLLMServer) -> Iterator[Callable[[], Delta]]:
    """``delta = watch()`` after a call: what that call changed (since the last ``watch()``).
    Whatever the test asserts, no block it saw released may be hit again (``released_hit``):
    a release never costs a real agent a prefill."""
    last = [counters(agents_server)]
    start = last[0]

    def step() -> Delta:
        now = counters(agents_server)
        delta = Delta(last[0], now)
        last[0] = now
        return delta

    yield step
    whole = Delta(start, counters(agents_server))
    assert whole["released_hit"] == 0, f"released blocks were hit again: {whole.changed()}"


#: The paths of model calls (not the probes of ``AgentsFleet.place``).
MODEL_PATHS = ("/v1/messages", "/v1/responses", "/v1/chat/completions")


@dataclass
class AgentsFleet:
    """Two plugin replicas of the ``long`` model behind the printed nginx configuration: the
    shared ``agents_server`` and one of the fleet's own (which a test may kill)."""

    replicas: list[VLLMServer]
    router: NginxRouter

    def replica_of(self, upstream: str) -> int:
        return next(i for i, r in enumerate(self.replicas) if upstream.endswith(f":{r.port}"))

    def place(self, headers: dict[str, str]) -> int:
        """The replica nginx sends a request with these headers to (a ``/v1/models`` probe)."""
        logged = len(self.router.routed())
        httpx.get(self.router.base_url + "/models", headers=headers, timeout=30).raise_for_status()
        return self.replica_of(self.router.wait_routed(logged + 1)[logged].upstream)

    def served(self) -> dict[str, set[int]]:
        """Session (the key nginx hashed) → the replicas that served its model calls."""
        out: dict[str, set[int]] = {}
        for routed in self.router.routed():
            if routed.session and routed.uri in MODEL_PATHS:
                out.setdefault(routed.session, set()).add(self.replica_of(routed.upstream))
        return out


@pytest.fixture
def agents_fleet(agents_server: VLLMServer) -> Iterator[AgentsFleet]:
    second = VLLMServer(
        model=build(size="long"),
        plugin=True,
        num_blocks=3072,
        max_model_len=65536,
        eager=True,
        worker_in_engine=True,
    )
    with second, NginxRouter([f"127.0.0.1:{agents_server.port}", f"127.0.0.1:{second.port}"]) as r:
        yield AgentsFleet([agents_server, second], r)


class _Routed:
    """A server seen through a router: what an agent is pointed at."""

    def __init__(self, root_url: str) -> None:
        self.root_url = root_url
        self.base_url = root_url + "/v1"


def claude_code_via(router: NginxRouter, tmp_path: Path, name: str) -> ClaudeCode:
    home = tmp_path / name / "home"
    home.mkdir(parents=True)
    via: Any = _Routed(router.root_url)
    return ClaudeCode(installed("claude"), via, home, tmp_path / name / "project").setup()


def codex_via(router: NginxRouter, tmp_path: Path, name: str) -> CodexCli:
    home = tmp_path / name / "home"
    home.mkdir(parents=True)
    via: Any = _Routed(router.root_url)
    return CodexCli(installed("codex"), via, home, tmp_path / name / "project").setup()


@pytest.fixture
def claude_code_behind_vllm_router(
    agents_server: VLLMServer, tmp_path: Path
) -> Iterator[ClaudeCode]:
    """Claude Code through vLLM's own router (``vllm-router``, one replica: the agents
    server), which forwards no header on ``/v1/messages``: the plugin sees no session id."""
    binary = router_binary()
    if binary is None:
        missing("vllm-router is not installed: `make test` installs it")
    home = tmp_path / "routed" / "home"
    home.mkdir(parents=True)
    with Router(str(binary), [agents_server], POLICIES["round_robin"]) as router:
        via: Any = _Routed(router.url)
        yield ClaudeCode(installed("claude"), via, home, tmp_path / "routed" / "project").setup()
