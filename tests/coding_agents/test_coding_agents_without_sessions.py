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
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from vllm_affinity.testing import SERVED_NAME, VLLMServer

from .conftest import (
    API_KEY,
    ROOT,
    SCRIPTED_ANSWERS,
    Delta,
    InteractiveQwenCode,
    installed,
    missing,
    quiet,
)
from .scripted_answers import script
from .test_coding_agents import ANSWER, blocks_of, question, released

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
        missing("aider is not installed in .venv-aider: `make test` installs it")
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


#: A summary as models write them for Qwen Code's and Claude Code's compaction prompts: an
#: analysis (Qwen Code cuts it) and the state it keeps.
SUMMARY = (
    "<analysis>\nThe user asked three questions about the weather and the plan; I answered "
    "each one briefly and no file was changed, so the state is only the conversation.\n"
    "</analysis>\n\n<state_snapshot>\n<overall_goal>Answer the user's questions about the "
    "weather and about the plan for the week.</overall_goal>\n<key_knowledge>The user "
    "prefers short answers; the forecast questions concern Oslo and Lima.</key_knowledge>\n"
    "<current_plan>1. [DONE] the weather. 2. [DONE] the plan. 3. [TODO] whatever the user "
    "asks next.</current_plan>\n</state_snapshot>"
)


@pytest.mark.parametrize("interactive_qwen_code", [False], indirect=True, ids=["no-metadata"])
def test_qwen_code_by_default_compress_releases_the_old_window_and_suggestions_are_sides(
    interactive_qwen_code: InteractiveQwenCode,
    agents_server: VLLMServer,
    watch: Callable[[], Delta],
) -> None:
    """Qwen Code as installed: no session on the wire. Its turns are one conversation (each
    carries the last answer back); its next-prompt suggestion (the conversation and a fixed
    prompt, answered and dropped) is learned as a side prompt once the next turn drops it;
    its compression request (its own system prompt, the conversation) is a side request; the
    window after ``/compress`` carries the summary cut (its analysis gone), trimmed and framed,
    and continues the conversation: a rewrite that releases the old window, none of whose
    blocks a later prompt hits."""
    agent = interactive_qwen_code
    script(SCRIPTED_ANSWERS, unique=True)  # a real model's answers differ
    try:
        watch()
        steps = {}
        for n, text in enumerate(("first question about the weather", question(1), "third")):
            agent.type(text, ANSWER)
            quiet(agents_server)
            steps[f"turn{n}"] = watch()
        script(SCRIPTED_ANSWERS, [SUMMARY])
        agent.type("/compress", "compressed")
        quiet(agents_server)
        steps["compress"] = watch()
        agent.type("fourth question after compression", ANSWER)
        quiet(agents_server)
        steps["rewrite"] = watch()
        agent.type("fifth question", ANSWER)
        quiet(agents_server)
        steps["plain"] = watch()
    finally:
        script(SCRIPTED_ANSWERS, unique=False)
    print({k: v.changed() for k, v in steps.items()})
    turns = [steps[f"turn{n}"] for n in range(3)]
    assert turns[0]["implicit.started"] == 1 and turns[0]["windows.first"] == 1, steps
    # its memory extractor (its own system prompt and tools, the conversation): a side request
    assert turns[0]["implicit.side"] >= 1, turns[0].changed()
    # nothing rewritten; the one release a turn may make settles the first suggestion's retry
    assert all(t["releases"] <= 1 and t["windows.rewrite"] == 0 for t in turns), steps
    assert all(t["implicit.continued"] >= 1 for t in turns[1:]), steps
    # a side prompt not seen yet (the first suggestion) is an append the next window settles as
    # a retry; once learned, the suggestions are side requests: no turn after the compaction
    # finds its window replaced
    assert sum(step["implicit.side"] for step in steps.values()) >= 6, steps
    assert steps["rewrite"]["windows.retry"] + steps["plain"]["windows.retry"] == 0, steps
    compress, rewrite, plain = steps["compress"], steps["rewrite"], steps["plain"]
    # its compression request carries the conversation and the main prompt: not a rewrite
    assert compress["windows.rewrite"] == 0, compress.changed()
    # the window after it carries the summary, cut and framed: the same conversation, rewritten
    assert rewrite["implicit.started"] == 0 and rewrite["windows.rewrite"] == 1, rewrite.changed()
    assert released(rewrite) >= blocks_of(agents_server, question(1)), rewrite.changed()
    assert plain["windows.append"] == 1 and plain["windows.rewrite"] == 0, plain.changed()
    assert sum(s["released_hit"] for s in steps.values()) == 0, steps


def test_a_chat_ui_regenerate_edit_and_branch_get_their_verdicts(
    agents_server: VLLMServer, watch: Callable[[], Delta]
) -> None:
    """A chat UI as Open WebUI or LibreChat talks: no id, the whole chat each time. A
    regenerated answer re-sends the same chat (a retry: the next message settles it), an edited
    last message replaces it (a retry), an edited earlier message drops what followed it (a
    rewrite that releases it). Nothing released is hit again."""
    system = {"role": "system", "content": f"You are a helpful chat assistant ({uuid.uuid4()})."}

    def send(messages: list[dict[str, str]]) -> tuple[dict[str, str], Delta]:
        body = {"model": SERVED_NAME, "messages": [system, *messages], "max_tokens": 64}
        reply = httpx.post(
            f"{agents_server.base_url}/chat/completions", json=body, timeout=120,
            headers={"Authorization": f"Bearer {API_KEY}"},
        )  # fmt: skip
        reply.raise_for_status()
        answer = reply.json()["choices"][0]["message"]["content"]
        quiet(agents_server)
        return {"role": "assistant", "content": answer}, watch()

    script(SCRIPTED_ANSWERS, unique=True)
    try:
        watch()
        hello = {"role": "user", "content": "hello"}
        first, started = send([hello])
        chat = [hello, first, {"role": "user", "content": question(2)}]
        _, asked = send(chat)
        script(SCRIPTED_ANSWERS, [question(3, words=60)])  # a long answer, then regenerated
        _, again = send(chat)
        kept, regenerate = send(chat)
        chat.append(kept)
        old, new = ({"role": "user", "content": question(n)} for n in (4, 5))
        _, after_regenerate = send([*chat, old])
        answer, edited = send([*chat, new])  # the last message edited
        _, after_edit = send([*chat, new, answer, {"role": "user", "content": "thanks"}])
        _, branched = send([hello, first, {"role": "user", "content": "plan a dinner instead"}])
    finally:
        script(SCRIPTED_ANSWERS, unique=False)
    assert started["implicit.started"] == 1 and started["windows.first"] == 1
    assert asked["implicit.continued"] == 1 and asked["windows.append"] == 1
    assert again["windows.retry"] == 1 and regenerate["windows.retry"] == 1
    # the next message settles the regenerations: the long answer's blocks are dead
    assert after_regenerate["windows.append"] == 1
    assert after_regenerate["block_released_compaction"] >= 1, after_regenerate.changed()
    assert edited["windows.retry"] == 1 and edited["releases"] == 0, edited.changed()
    # going on from the edit settles it: the replaced message's blocks are dead
    assert after_edit["windows.append"] == 1
    assert after_edit["block_released_compaction"] >= blocks_of(agents_server, question(4))
    assert branched["windows.rewrite"] == 1 and branched["block_released_compaction"] >= 1
    steps = (started, asked, again, regenerate, after_regenerate, edited, after_edit, branched)
    assert sum(s["released_hit"] for s in steps) == 0, [s.changed() for s in steps]
    assert all(s["implicit.started"] == 0 for s in steps[1:]), [s.changed() for s in steps]
