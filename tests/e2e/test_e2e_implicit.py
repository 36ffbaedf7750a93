"""Implicit sessions on a real plugin server (``VLLM_AFFINITY_IMPLICIT_SESSIONS=answers``, the
default): a client that names no session (the plain openai client, no session header, no salt)
streams its answers, and the server links its windows by the answers they carry back
(``vllm_affinity/api_server/implicit_sessions.py``, ``core/answer_chains.py``).

The shared plugin server runs one API server (vLLM's default ``--api-server-count 1``): the
chain table lives in that process (``LocalChains``), where every request is seen and every
streamed answer is recorded at its stream's end. The table kept in the engine core for
several API servers (``EngineChains``) is the coding agents' server's
(``tests/coding_agents``)."""

from __future__ import annotations

import random
from typing import Any

import openai
import pytest

from vllm_affinity.core import common_prefix_length
from vllm_affinity.testing import BLOCK_SIZE, SERVED_NAME, VLLMServer, filler_text

pytestmark = pytest.mark.e2e

OUTCOMES = ("started", "continued", "side")
VERDICTS = ("first", "append", "rewrite", "retry", "side")


def counts(server: VLLMServer) -> dict[str, int]:
    """The implicit sessions' outcomes and the window verdicts on ``/metrics``, and the engine's
    compaction releases."""
    flat = {
        f"implicit.{o}": int(server.metric("vllm_affinity_implicit_sessions_total", outcome=o))
        for o in OUTCOMES
    }
    for verdict in VERDICTS:
        count = server.metric("vllm_affinity_agent_windows_total", verdict=verdict)
        flat[f"windows.{verdict}"] = int(count)
    stats = server.engine_stats()
    for key in ("releases_compaction", "block_released_compaction", "released_hit"):
        flat[key] = int(stats.get(key, 0))
    return flat


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What changed, the unchanged left out (so a failure message shows what happened)."""
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def streamed(client: openai.OpenAI, messages: list[dict[str, Any]]) -> tuple[str, int, int]:
    """One streamed call: the answer's text as its chunks carried it, its prompt and completion
    tokens (the stream's last chunk, ``include_usage``)."""
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=48,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},  # a long answer: stretches to find in the summary
    )
    parts, usage = [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
        usage = chunk.usage or usage
    assert usage is not None
    return "".join(parts), usage.prompt_tokens, usage.completion_tokens


def test_streamed_answers_link_an_id_less_conversation_and_its_compaction_on_one_api_server(
    vllm_affinity_server: VLLMServer,
) -> None:
    """Three streamed turns of a client that names no session are one conversation (each window
    carries the last streamed answer back); a compaction (the instructions kept, a summary
    quoting the second streamed answer, re-wrapped, for the rest) continues it and releases
    exactly the old window's blocks past the instructions; the next turn appends to it. The
    server runs one API server: the chain table that links them is ``LocalChains``."""
    server = vllm_affinity_server
    # one API server (vLLM's default): the process started serves the API itself, and the
    # chain table is that process's (with several, they are its children and the engine's)
    assert "--api-server-count" not in server.command()
    assert server.affinity_stats()["api_server"]["pid"] == server._process_tree()[0].pid
    rng = random.Random(2024)
    system = {"role": "system", "content": "You answer an id-less chat. " + filler_text(rng, 40)}
    window: list[dict[str, Any]] = [system]
    answers, steps, last = [], [], (0, 0)
    with openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0) as client:
        before = counts(server)
        for turn in range(3):
            window.append({"role": "user", "content": f"Turn {turn}: " + filler_text(rng, 30)})
            answer, prompt, completion = streamed(client, window)
            window.append({"role": "assistant", "content": answer})
            answers.append(answer)
            last = (prompt, completion)
            now = counts(server)
            steps.append(delta(before, now))
            before = now
        # the summary quotes the second answer, its lines re-wrapped as an agent's summary
        # would (whitespace runs collapse on both sides: what survives trimming)
        quoted = "\n".join(answers[1].split())
        summary = f"Summary of the conversation so far:\n{quoted}\nThe user asked on."
        compacted = [system, {"role": "user", "content": summary}]
        answer, _, _ = streamed(client, compacted)
        now = counts(server)
        steps.append(delta(before, now))
        before = now
        streamed(client, [*compacted, {"role": "assistant", "content": answer}, {
            "role": "user", "content": "Go on."
        }])  # fmt: skip
        steps.append(delta(before, counts(server)))
    assert all(len(a) >= 128 for a in answers), answers  # two stretches of 64 characters each
    first, *turns, compaction, after = steps
    assert first.get("implicit.started") == 1 and first.get("windows.first") == 1, steps
    # the streamed answer, as recorded at the stream's end, links the next window
    for step in turns:
        assert step.get("implicit.continued") == 1 and step.get("windows.append") == 1, steps
        assert "implicit.started" not in step, steps
    # no known answer in it: linked by the summary's stretches of the second answer
    assert compaction.get("implicit.continued") == 1 and "implicit.started" not in compaction
    assert compaction.get("windows.rewrite") == 1 and compaction.get("releases_compaction") == 1
    # exactly the last window's cached blocks past what the compacted window keeps: the last
    # turn's prompt and answer (the answer's last token has no KV), from the first block the
    # compacted window's tokens cannot hit (the one straddling the divergence included)
    kept = common_prefix_length(server.tokenize(window[:-1]), server.tokenize(compacted))
    prompt, completion = last
    stale = (prompt + completion - 1) // BLOCK_SIZE - kept // BLOCK_SIZE
    assert stale >= 3 and compaction.get("block_released_compaction") == stale, (kept, steps)
    assert after.get("implicit.continued") == 1 and after.get("windows.append") == 1, steps
    assert sum(s.get("released_hit", 0) for s in steps) == 0, steps
