"""Hybrid models end to end: random-weight gpt-oss-, Gemma-3- and Qwen3-Next-shaped models
(``python -m vllm_affinity build-model --arch ...``) on real plugin servers. Sliding-window or
linear-attention (Mamba-style) groups sit beside full attention, all in one block pool.

Each model: a session grows over four turns, then compacts (system kept, the rest replaced by a
summary), once through the hook and once through Claude Code's own session header (no hook).
The compaction releases the stale blocks of every group, its own first call and the next one
hit the kept prefix, and the engine's invariants hold; a new session's and a subagent's first
call hit the instructions an earlier one sent (the instructions' checkpoint). On the
gpt-oss-shaped model, the memory squeeze runs side by side with vanilla vLLM: an older
session's prefix (both groups) survives with the plugin and is evicted on vanilla."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

import jiuwen_hooks
from benchmarks.hybrid.hybrid_checkpoints import second_session, subagents
from benchmarks.hybrid.hybrid_models import (
    DENSE,
    Call,
    Compaction,
    call,
    groups,
    grow_then_compact,
    hybrid_vllm,
    instruction_tokens,
    released_per_group,
    rendered,
    stale_blocks,
    text,
)
from jiuwen_kv_protocol.headers import CLAUDE_CODE_SESSION_HEADER
from jiuwen_replay.cli import main as replay_main
from jiuwen_replay.formats import WRITERS
from jiuwen_replay.synthetic import SyntheticConfig, generate
from vllm_affinity.core import common_prefix_length
from vllm_affinity.testing import SERVED_NAME, VLLMServer

pytestmark = pytest.mark.e2e


def boundary_blocks(server: VLLMServer, kind: str, block_size: int) -> int:
    """The blocks of a sliding-window or Mamba group that a hit needs at a position: the
    window's (``cdiv(window - 1, block size)``, vLLM's ``_contiguous_blocks_for_hit``) or the
    one block holding the state there."""
    if kind == "mamba":
        return 1
    assert kind == "sliding_window", kind
    window = json.loads((Path(server.model) / "config.json").read_text())["sliding_window"]
    return -(-(window - 1) // block_size)


def retained_past(prompts: list[int], need: int, block_size: int, cut: int) -> int:
    """How many distinct blocks of index ``cut`` on are in the runs of ``need`` blocks a
    sparse group caches at each prompt's replay boundary: the run ending at block
    ``(prompt - 1) // block_size``, where a later request resending or extending the prompt
    resumes (vLLM's ``replay_boundaries``, aligned down to the block)."""
    blocks: set[int] = set()
    for prompt in prompts:
        end = (prompt - 1) // block_size
        blocks.update(range(max(cut, end - need), end))
    return len(blocks)


def answer_blocks(call: Any, block_size: int) -> int:
    """The blocks a call's answer filled (its last token has no KV): a sliding-window group
    caches them too, for the session's return (``checkpoints.py``)."""
    return int((call.prompt + call.completion - 1) // block_size - call.prompt // block_size)


def assert_every_group_released(server: VLLMServer, compaction: Compaction) -> None:
    """Exactly the old window's cached blocks past the cut, in every group. Full attention:
    each block of its last prompt and answer (the answer's last token has no KV). A
    sliding-window or Mamba group caches only the blocks a hit can resume from: with vLLM's
    default retention (``prefix_cache_retention_interval`` 0) those at a request's prompt end
    (its replay boundary, ``num_prompt_tokens - 1`` aligned down) and at its shared-prefix
    junction (the instructions' checkpoint, before the cut: kept). The last turn's record
    holds two such runs past the cut: the one at the previous turn's prompt end, where its
    hit resumed, and the one at its own prompt end (each turn adds ~360 tokens, 11 blocks of
    32 tokens or two of 160: the runs never overlap, 8 blocks of a 128-token window and 2
    Mamba states); on a model whose sparse groups are all sliding windows, also the blocks
    its answer filled (the plugin keeps the window at a session's answer end:
    ``checkpoints.py``). The next call hits the compacted window."""
    compacted, after = compaction.calls[4], compaction.calls[5]
    # the compaction's own first call hits the instructions it kept: the plugin kept every
    # group's state at their end since the session's first call (vanilla: 0 or 32 tokens)
    granularity = max(group["block_size"] for group in compaction.groups.values())
    assert compacted.cached == compaction.kept_tokens // granularity * granularity, (
        compaction.kept_tokens,
        compaction.calls,
    )
    for group, count in compaction.released.items():
        kind, block_size = compaction.groups[group]["kind"], compaction.groups[group]["block_size"]
        if kind in DENSE:
            expected = stale_blocks(compaction, block_size)
        else:
            prompts = [call.prompt for call in compaction.calls[2:4]]
            need = boundary_blocks(server, kind, block_size)
            expected = retained_past(
                prompts, need, block_size, compaction.kept_tokens // block_size
            )
            if all(g["kind"] in (*DENSE, "sliding_window") for g in compaction.groups.values()):
                expected += answer_blocks(compaction.calls[3], block_size)
        assert count == expected, (group, kind, compaction.released, compaction.calls)
    assert after.cached >= (compacted.prompt - 1) // 2, compaction.calls


@pytest.fixture(scope="module")
def gpt_oss_pair() -> Iterator[tuple[VLLMServer, VLLMServer]]:
    """A tight pool of the gpt-oss shape, with and without the plugin, started side by side:
    the squeeze and the replay, this module's first tests."""
    plugin = hybrid_vllm("gpt-oss", num_blocks=160, max_model_len=2816, worker_in_engine=True)
    vanilla = hybrid_vllm(
        "gpt-oss", plugin=False, num_blocks=160, max_model_len=2816, worker_in_engine=True
    )
    with ExitStack() as stack:
        for server in (plugin, vanilla):
            stack.callback(server.stop)
            server.start(wait=False)
        for server in (plugin, vanilla):
            server.wait_healthy()
        yield plugin, vanilla


@pytest.fixture(scope="module")
def later_shapes() -> Iterator[dict[str, VLLMServer]]:
    """Gemma 3's, Qwen3-Next's, the every-layer-sliding (Mistral 7B v0.1-shaped) and the
    every-layer-linear-attention plugin servers, started side by side once the tight pair is
    gone (each vLLM process tree holds a few GB; their start-ups overlap instead of
    queueing)."""
    servers = {
        arch: hybrid_vllm(arch, worker_in_engine=True)
        for arch in ("gemma3", "qwen3-next", "mistral", "linear-only")
    }
    with ExitStack() as stack:
        for server in servers.values():
            stack.callback(server.stop)
            server.start(wait=False)
        yield servers


@pytest.fixture(
    scope="module", params=["gpt-oss", "gemma3", "qwen3-next", "mistral", "linear-only"]
)
def hybrid_server(request: pytest.FixtureRequest) -> Iterator[VLLMServer]:
    """A plugin server of each hybrid shape in turn. gpt-oss's is the tight pair's plugin
    server once the pair's tests are done (one start-up less; a session's four turns fit its
    160 blocks, and what the pair's tests left is evicted first), the others a pool nothing is
    evicted from (``later_shapes``), each stopped once its tests are done."""
    if request.param == "gpt-oss":
        pair = request.getfixturevalue("gpt_oss_pair")
        pair[1].stop()  # the vanilla side is done
        yield pair[0]
        pair[0].stop()
        return
    server = request.getfixturevalue("later_shapes")[request.param]
    server.wait_healthy()
    yield server
    server.stop()


def _one_group(server: VLLMServer) -> bool:
    """Every layer of one kind: one KV-cache group (vLLM's unitary coordinator)."""
    return "mistral" in server.model or "linear-only" in server.model


@pytest.fixture
def check_after(request: pytest.FixtureRequest) -> Iterator[Callable[[VLLMServer], None]]:
    servers: list[VLLMServer] = []
    yield servers.append
    for server in servers:
        for engine in server.idle_check()["engines"]:
            assert engine["idle"] and not engine["problems"], engine["problems"]
            assert not engine["engine_errors"], engine["engine_errors"]  # no path failed


def turn(server: VLLMServer, session: str, messages: list[dict[str, Any]]) -> Call:
    """One call of a coding agent that names its session in its own header."""
    return call(server, messages, {CLAUDE_CODE_SESSION_HEADER: session})


def words_for(blocks: int, tokens_per_pair: float) -> int:
    return int(blocks * 32 / tokens_per_pair)


def test_an_older_sessions_prefix_survives_a_squeeze_side_by_side(
    gpt_oss_pair: tuple[VLLMServer, VLLMServer], check_after: Callable[[VLLMServer], None]
) -> None:
    """gpt-oss-shaped, a small pool: B (oldest) and D wait; A compacts (Claude Code's header, no
    hook); C's prompt needs more blocks than are free. With the plugin C takes A's dead blocks
    (both groups'); vanilla's LRU evicts B's prefix."""
    plugin, vanilla = gpt_oss_pair
    check_after(plugin)
    b_window = [{"role": "system", "content": "You are B. " + text(10, 120)}]
    probe = turn(plugin, "probe", [{"role": "user", "content": text(11, 400)}])
    per_pair = probe.prompt / 400
    results: dict[str, dict[str, int]] = {}
    c_words = 0
    for server in (plugin, vanilla):
        tag = "plugin" if server.plugin else "vanilla"
        b_first = turn(server, f"B-{tag}", b_window)
        turn(server, f"D-{tag}", [{"role": "user", "content": text(15, words_for(28, per_pair))}])
        system = {"role": "system", "content": f"You are A. {text(19, 20)}"}
        a_window = [system, {"role": "user", "content": text(20, words_for(48, per_pair))}]
        a_first = turn(server, f"A-{tag}", a_window)
        a_read = [*a_window, {"role": "assistant", "content": "Read."}]
        a_last = turn(server, f"A-{tag}", a_read)
        summary = [system, {"role": "user", "content": "Summary: done."}]
        before = groups(server)
        turn(server, f"A-{tag}", summary)
        if server.plugin:
            stats = server.engine_stats()
            released = released_per_group(before, groups(server))
            # A's last call's blocks past what the summary keeps (its instructions), in each
            # group: every cached one in full attention, and in the sliding window the runs
            # at the two calls' prompt ends (the second resumed from the first's) and the
            # blocks the last answer filled, as in a compaction of four turns
            # (``assert_every_group_released``)
            cut = common_prefix_length(rendered(server, a_read), rendered(server, summary)) // 32
            expected = {}
            for group, stats_of in groups(server).items():
                if stats_of["kind"] in DENSE:
                    expected[group] = (a_last.prompt + a_last.completion - 1) // 32 - cut
                else:
                    need = boundary_blocks(server, stats_of["kind"], 32)
                    expected[group] = retained_past(
                        [a_first.prompt, a_last.prompt], need, 32, cut
                    ) + answer_blocks(a_last, 32)
            assert released == expected, (released, a_first, a_last, cut)
            assert stats["releases_compaction"] == 1
            assert stats["block_released_compaction"] == sum(expected.values()), stats
            # C needs every free block, then 20 more: A's dead ones here, LRU's oldest there.
            # Its prompt is one prefill chunk: every group holds a block per 32 tokens of it
            c_words = words_for((stats["segments"]["free"] + 20) // len(stats["groups"]), per_pair)
        c = turn(server, f"C-{tag}", [{"role": "user", "content": text(30, c_words)}])
        b_again = turn(server, f"B-{tag}", b_window)
        results[tag] = {"b_prompt": b_first.prompt, "b_hit": b_again.cached, "c_prompt": c.prompt}
    assert results["plugin"]["b_hit"] == (results["plugin"]["b_prompt"] - 1) // 32 * 32, results
    # vanilla keeps only what every session shares: gpt-oss's harmony header (two blocks)
    assert results["vanilla"]["b_hit"] <= 2 * 32, results
    assert plugin.engine_stats()["released_reused"] > 0


def test_a_trace_replay_at_a_tight_pool_computes_no_more_than_vanilla(
    gpt_oss_pair: tuple[VLLMServer, VLLMServer],
    tmp_path: Path,
    check_after: Callable[[VLLMServer], None],
) -> None:
    """The synthetic agent trace (compactions, tool loops, several sessions; each actor's
    instructions a system prompt) through the hook on the gpt-oss-shaped model's tight pool,
    against vanilla with the same pool: releases and the instructions' checkpoints together
    compute no more than vanilla."""
    plugin, vanilla = gpt_oss_pair
    check_after(plugin)
    trace = tmp_path / "synthetic.project.jsonl"
    WRITERS["project"](
        generate(SyntheticConfig(sessions=6, calls_per_session=12, compact_after=8)), trace
    )
    args = [
        "replay", "--trace", str(trace), "--format", "project", "--speed", "0",
        "--base-url", plugin.base_url,
        "--baseline-url", vanilla.base_url,
        "--model", SERVED_NAME, "--scale", "0.5", "--copies", "3", "--max-output-tokens", "4",
        "--system-prompts",
        "--no-plot", "--quiet", "--out", str(tmp_path), "--name", "hybrid",
    ]  # fmt: skip
    assert replay_main(args) == 0
    result = json.loads((tmp_path / "hybrid.json").read_text())
    baseline, hooked = result["runs"]
    for run in (baseline, hooked):
        assert run["errors"] == 0 and run["calls"] == result["trace"]["requests"], run
    # one in-request release per compaction in the trace (a window the trace itself marks a
    # rewrite of its session's last one; 54 of its 270 calls here), each applied, none by the
    # protocol's POST
    rewrites = result["trace"]["transitions"]["rewrite"]
    assert rewrites > 0, result["trace"]
    assert hooked["releases"] == {
        "in_request": rewrites, "post": 0, "not_applied": 0, "total": rewrites
    }, (hooked["releases"], result["trace"])  # fmt: skip
    assert hooked["computed_tokens"] <= baseline["computed_tokens"], (hooked, baseline)
    # each actor's instructions went out as a system prompt: their checkpoints were kept
    assert plugin.engine_stats()["checkpoints_marked"] > 0


def test_a_compaction_through_the_hook_releases_every_group(
    hybrid_server: VLLMServer,
    jiuwen_hook_factory: Callable[..., jiuwen_hooks.Hook],
    check_after: Callable[[VLLMServer], None],
) -> None:
    server = hybrid_server
    check_after(server)
    hook = jiuwen_hook_factory(in_request=True)
    with jiuwen_hooks.session(f"hybrid-hook-{server.port}"):
        compaction = grow_then_compact(server, seed=1, flush=hook.flush)
    assert len(compaction.groups) >= (1 if _one_group(server) else 2), compaction.groups
    assert_every_group_released(server, compaction)


def test_a_compaction_told_from_claude_codes_header_releases_every_group(
    hybrid_server: VLLMServer, check_after: Callable[[VLLMServer], None]
) -> None:
    server = hybrid_server
    check_after(server)
    headers = {CLAUDE_CODE_SESSION_HEADER: f"hybrid-cc-{server.port}"}
    assert_every_group_released(server, grow_then_compact(server, seed=2, headers=headers))


def hit_between(hit: int, instructions: int, shared: int, granularity: int) -> bool:
    """A later first call's hit reaches the instructions' end aligned down (their checkpoint),
    and no further than the tokens the two windows share aligned down. The two differ by a
    block for about one server port in ten (the windows share a few tokens of the next
    message too); the hit then reaches the higher one only where the first call's prompt-end
    state covers the gap (a short task after the instructions: CI saw both, 480 of 512 and
    544 of 544 with instructions of 541)."""
    return instructions // granularity * granularity <= hit <= shared // granularity * granularity


@pytest.mark.parametrize("through", ["hook", "headers"])
def test_first_calls_hit_the_instructions_an_earlier_one_sent(
    hybrid_server: VLLMServer,
    through: str,
    jiuwen_hook_factory: Callable[..., jiuwen_hooks.Hook],
    check_after: Callable[[VLLMServer], None],
) -> None:
    """Two new sessions with the same instructions, then (Claude Code's headers) two subagents
    of one lead with the same instructions of their own: the second one's first call hits what
    it shares with the first, down to the model's hit granularity. Vanilla vLLM keeps a
    sliding window's or Mamba state there only from a prefix's second appearance on, so its
    second call hits none of it (0 to 64 tokens: a chat template's opening)."""
    server = hybrid_server
    check_after(server)
    granularity = max(g["block_size"] for g in server.engine_stats()["groups"])
    if through == "hook":
        jiuwen_hook_factory(in_request=True)
        firsts = [second_session(server, 2 * server.port, [None, None], pairs=150)]
    else:
        names = [{CLAUDE_CODE_SESSION_HEADER: f"new-{n}-{server.port}"} for n in (1, 2)]
        firsts = [second_session(server, 2 * server.port + 1, names, pairs=150)]
        lead = f"lead-{server.port}"
        call(server, [{"role": "user", "content": text(3, 20)}], {CLAUDE_CODE_SESSION_HEADER: lead})
        firsts.append(subagents(server, lead, server.port, pairs=150))
    for first in firsts:
        assert first.shared >= first.instructions > 2 * granularity, first
        assert hit_between(first.hit, first.instructions, first.shared, granularity), first
    assert server.engine_stats()["checkpoints_marked"] >= 1


def test_the_messages_api_keeps_the_instructions_checkpoint_too(
    hybrid_server: VLLMServer, check_after: Callable[[VLLMServer], None]
) -> None:
    """Claude Code's own calls: ``/v1/messages`` with a ``system`` prompt and its session
    header. A second session's first call hits the instructions the first one sent."""
    import anthropic

    server = hybrid_server
    check_after(server)
    granularity = max(g["block_size"] for g in server.engine_stats()["groups"])
    system = "You are a coding agent. " + text(2 * server.port + 7, 150)
    tasks = [f"Task {n}: " + text(n, 30) for n in (1, 2)]
    hits = []
    with anthropic.Anthropic(
        base_url=server.root_url, api_key=server.api_key or "none", max_retries=0
    ) as client:
        for n, task in enumerate(tasks, 1):
            reply = client.messages.create(
                model=SERVED_NAME,
                system=system,
                messages=[{"role": "user", "content": task}],
                max_tokens=8,
                extra_headers={CLAUDE_CODE_SESSION_HEADER: f"messages-{n}-{server.port}"},
            )
            hits.append(reply.usage.cache_read_input_tokens or 0)
    windows = [
        [{"role": "system", "content": system}, {"role": "user", "content": t}] for t in tasks
    ]
    shared = common_prefix_length(*(rendered(server, w) for w in windows))
    instructions = instruction_tokens(server, windows[0][0])
    assert hits[0] <= 2 * 32, hits  # the first: a chat template's opening at most
    assert shared >= instructions > 2 * granularity, (shared, instructions)
    assert hit_between(hits[1], instructions, shared, granularity), (hits, instructions, shared)
