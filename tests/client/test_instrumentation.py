"""``JiuwenHooksInstrumentor``: the contrib-instrumentation shape, the same hook as ``install()``,
and zero-code install through the real ``opentelemetry-instrument`` command in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

import jiuwen_hooks
from jiuwen_hooks import _state
from jiuwen_hooks.instrumentation import JiuwenHooksInstrumentor
from jiuwen_hooks.testing import LocalEngine

AGENT = textwrap.dedent(
    """
    import json, os
    import openai
    import jiuwen_hooks

    client = openai.OpenAI(base_url=os.environ["ENGINE"], api_key="sk", max_retries=0)
    window = [{"role": "system", "content": "s"}] + [
        {"role": "user", "content": f"q{i}"} for i in range(3)
    ]
    with jiuwen_hooks.session("zero-code"):
        client.chat.completions.create(model="m", messages=window)
        client.chat.completions.create(model="m", messages=window[:2])
    print(json.dumps(jiuwen_hooks.stats()))
    """
)


@pytest.fixture(autouse=True)
def clean() -> Any:
    jiuwen_hooks.uninstall()
    yield
    JiuwenHooksInstrumentor().uninstrument()
    jiuwen_hooks.uninstall()


def test_instrument_is_install_and_uninstrument_is_uninstall(jiuwen_engine: LocalEngine) -> None:
    instrumentor = JiuwenHooksInstrumentor()
    assert isinstance(instrumentor, BaseInstrumentor)
    assert list(instrumentor.instrumentation_dependencies()) == ["openai >= 1.40"]
    instrumentor.instrument(timeout=0.5, unrelated_setting=True)
    hook = _state.installed()
    assert hook is not None and hook is instrumentor.hook
    assert hook.options.timeout == 0.5
    assert jiuwen_hooks.install() is hook  # the one-liner finds the same hook
    instrumentor.uninstrument()
    assert _state.installed() is None
    assert not instrumentor.is_instrumented_by_opentelemetry


def test_entry_point_is_registered() -> None:
    from importlib.metadata import entry_points

    (found,) = [
        e for e in entry_points(group="opentelemetry_instrumentor") if e.name == "jiuwen_hooks"
    ]
    assert found.load() is JiuwenHooksInstrumentor


def run_agent(script: Path, engine: LocalEngine, **jiuwen_env: str) -> dict[str, Any]:
    """``opentelemetry-instrument python agent.py`` in a subprocess; its ``stats()``."""
    env = {
        **os.environ,
        "ENGINE": engine.base_url,
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        **jiuwen_env,
    }
    command = Path(sys.executable).parent / "opentelemetry-instrument"
    result = subprocess.run(
        [str(command), sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_opentelemetry_instrument_installs_the_hook(
    jiuwen_engine: LocalEngine, tmp_path: Path
) -> None:
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    stats = run_agent(agent, jiuwen_engine, JIUWEN_MIN_RELEASED_MESSAGES="2")
    assert stats["releases.ok"] == 1
    (release,) = jiuwen_engine.releases
    assert release.body["messages_released_index"] == 2
    assert release.headers["x-session-id"] == "zero-code"

    # the JIUWEN_* options reached the hook: a release below the minimum gain is skipped
    jiuwen_engine.clear()
    stats = run_agent(agent, jiuwen_engine, JIUWEN_MIN_RELEASED_MESSAGES="3")
    assert stats["skipped.below_min_gain"] == 1
    assert jiuwen_engine.releases == []
