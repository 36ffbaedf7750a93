"""Both generations of the real openJiuwen client release blocks on one plugin server.

- openJiuwen 0.1.19 (``agent_hint``): ``invoke`` binds the session, ``evict_kvc`` on a messages
  range and on the session releases exactly, and no generation runs for either;
- openJiuwen 0.1.16 (``InferenceAffinity``, ``POST /release_kv_cache``) still works.

Each client runs in its own virtualenv (``make test`` builds ``.venv-openjiuwen`` and
``.venv-openjiuwen016``), driven by ``openjiuwen_client.py``. The 0.1.16 client sends no API key,
so this module runs on the shared plugin server without one.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from vllm_affinity.core import common_prefix_length
from vllm_affinity.testing import BLOCK_SIZE, SERVED_NAME, VLLMServer, filler_text

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("openjiuwen_client.py")
VENVS = {"0.1.19": ROOT / ".venv-openjiuwen", "0.1.16": ROOT / ".venv-openjiuwen016"}


def venv_python(generation: str) -> Path:
    python = VENVS[generation] / "bin" / "python"
    if not python.exists():
        message = f"{VENVS[generation]} is missing: run `make test` (it builds it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.fixture
def server(second_plugin_server: VLLMServer) -> VLLMServer:
    return second_plugin_server


def run(generation: str, step: str, server: VLLMServer, tmp_path: Path, **request: Any) -> dict:
    path = tmp_path / f"{step}.json"
    path.write_text(json.dumps({"base_url": server.root_url, "model": SERVED_NAME, **request}))
    done = subprocess.run(
        [str(venv_python(generation)), str(DRIVER), step, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,  # openJiuwen writes its logs/ folder into the working directory
    )
    assert done.returncode == 0, f"{step} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["openjiuwen"].startswith(generation)
    return result


def grew(before: dict[str, Any], after: dict[str, Any], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def history(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    roles = ("system", "user", "assistant", "user", "assistant", "user")
    return [{"role": role, "content": filler_text(rng, 50)} for role in roles]


def stale_blocks(server: VLLMServer, window: list[dict[str, Any]], start: int) -> int:
    """Blocks of the window's prompt from the first one that differs once cut at ``start``
    (the generated tokens' blocks come on top)."""
    old = server.tokenize(window)
    first_stale = common_prefix_length(old, server.tokenize(window[:start])) // BLOCK_SIZE
    return len(old) // BLOCK_SIZE - first_stale


def test_openjiuwen_0_1_19_agent_hint(server: VLLMServer, tmp_path: Path) -> None:
    window, session = history(51), "oj19-session"
    request = {"session": session, "window": window}
    evicted = server.metric("vllm_affinity_agent_hint_requests_total", action="evict", outcome="ok")
    invoked = run("0.1.19", "invoke", server, tmp_path, **request)
    assert invoked["hint_kwargs"] == {"session_id": session, "parent_session_id": session}
    assert server.engine_stats()["sessions"] >= 1

    before, done = server.engine_stats(), server.metric("vllm:request_success_total")
    assert run("0.1.19", "evict-range", server, tmp_path, start=3, **request)["ok"] is True
    after = server.engine_stats()
    assert grew(before, after, "releases_agent_hint") == 1
    released = grew(before, after, "block_released_agent_hint")
    stale = stale_blocks(server, window, 3)
    assert stale <= released <= stale + 1  # the prompt's stale blocks, and the answer's
    assert server.metric("vllm:request_success_total") == done  # no generation ran

    before = after
    assert run("0.1.19", "evict-session", server, tmp_path, **request)["ok"] is True
    after = server.engine_stats()
    assert grew(before, after, "releases_agent_hint") == 1
    assert grew(before, after, "block_released_agent_hint") > 0  # the prefix kept by the range
    assert server.metric("vllm:request_success_total") == done
    handled = server.metric("vllm_affinity_agent_hint_requests_total", action="evict", outcome="ok")
    assert handled - evicted == 2


def test_openjiuwen_0_1_16_release_kv_cache(server: VLLMServer, tmp_path: Path) -> None:
    window, session = history(52), "oj16-session"
    request = {"session": session, "window": window}
    run("0.1.16", "old-invoke", server, tmp_path, **request)
    before = server.engine_stats()
    assert run("0.1.16", "old-release", server, tmp_path, start=3, **request)["ok"] is True
    after = server.engine_stats()
    assert grew(before, after, "releases_post") == 1
    stale = stale_blocks(server, window, 3)
    assert stale <= grew(before, after, "block_released_post") <= stale + 1
