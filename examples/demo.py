"""The main demo: real vLLM (CPU) with and without the plugin, side by side.

    make demo            (or, from the repository root: python -m examples.demo)
    make demo ARCH=gpt-oss   (the same on a gpt-oss-shaped hybrid model: python -m
                         examples.demo --arch gpt-oss; sliding-window and full-attention layers,
                         two KV-cache groups in one pool, each released)

1. The original design's scenario on the plugin server: a 3-round weather agent whose
   micro-compaction clears the two older tool results, so a release fires at the first cleared
   message; the release and the server's free-queue segments are printed.
2. A memory squeeze, on both servers (from an empty prefix cache): session B idles, A (the hot
   one) compacts, C arrives and needs more blocks than are free. With the plugin C reuses A's
   stale blocks; vanilla vLLM's LRU evicts B's prefix. B's return shows it: its cached and
   computed prompt tokens on each server.
3. A short multi-session agent run (bursts, tool results, four compaction policies) replayed on
   both servers: token hit rate and prompt tokens computed. No TTFT: the two servers share this
   machine's cores, and on the tiny model a saved prefill is worth less than what that moves
   (docs/benchmarks.md, "Multi-session agents", has paired per-call TTFT and a heavier model).
4. Traces: client and server spans are exported over OTLP to a real collector process (rotel)
   when it is installed; the demo says where they went and checks they share trace ids.

Everything it starts is stopped on exit, on failure and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack, nullcontext
from typing import Any

import httpx
import openai
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import jiuwen_hooks
from benchmarks.agents.agent_bench import replay
from benchmarks.agents.agent_trace import TraceConfig, describe, generate
from examples.compaction_agent import run_weather_agent
from examples.otel_collector import OtlpCollector
from jiuwen_kv_protocol.headers import RELEASE_SPAN, SESSION_ATTRIBUTE
from vllm_affinity.testing import BLOCK_SIZE, SERVED_NAME, VLLMServer, filler_window
from vllm_affinity.testing.hybrid_model import build_hybrid
from vllm_affinity.testing.tiny_model import build

API_KEY = "demo-key"
#: Per model: the pool's blocks and the longest prompt (a hybrid model's groups share the pool,
#: and a prompt's one prefill chunk holds a block of every group per 32 tokens).
SHAPES = {"llama": (96, None), "gpt-oss": (160, 2816)}


def say(text: str = "") -> None:
    print(text, flush=True)


def chat(server: VLLMServer, session: str, window: list[dict[str, Any]]) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of one streamed call in ``session``."""
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as client:
        prompt, cached = 0, 0
        with jiuwen_hooks.session(session) if server.plugin else nullcontext():
            stream = client.chat.completions.create(
                model=SERVED_NAME, messages=window, max_tokens=4, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                if chunk.usage:
                    prompt = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    cached = (details.cached_tokens or 0) if details else 0
        return prompt, cached


def engine_stats(server: VLLMServer) -> dict[str, Any]:
    (stats,) = server.affinity_stats()["engines"]
    return stats


def part_weather(plugin: VLLMServer, spans: InMemorySpanExporter, hook: Any) -> None:
    say("\n1) The weather agent (3 rounds, then micro-compaction) on the plugin server")
    with openai.OpenAI(base_url=plugin.base_url, api_key=API_KEY, max_retries=0) as client:
        run_weather_agent(client, SERVED_NAME, "weather-1", lambda t: say(t))
    hook.flush()  # the compressor's release is sent off the agent's path
    for span in spans.get_finished_spans():
        a = span.attributes or {}
        if span.name == RELEASE_SPAN:
            blocks = a.get("jiuwen.release.block_released")
            say(
                f"  release ({a.get('jiuwen.release.mode')}): "
                f"session={a.get(SESSION_ATTRIBUTE)} "
                f"messages_released_index={a.get('jiuwen.release.messages_released_index')} "
                f"reason={a.get('jiuwen.release.reason')}"
                + (f" block_released={blocks}" if blocks is not None else " (on the chat request)")
            )
    stats = engine_stats(plugin)
    say(f"  engine: {stats.get('releases_post', 0)} POSTed and "
        f"{stats.get('releases_in_request', 0)} in-request releases so far; "
        f"free-queue segments {stats['segments']}")  # fmt: skip
    say(f"  the hook learned: {hook.engines()}")


def part_squeeze(plugin: VLLMServer, vanilla: VLLMServer) -> None:
    say("\n2) Memory squeeze: B idles, A compacts, C needs more than the free blocks")
    for server in (vanilla, plugin):
        tag = "plugin" if server.plugin else "vanilla"
        # start from an empty prefix cache on both (dev-mode endpoint) so the sizes below squeeze
        httpx.post(server.root_url + "/reset_prefix_cache", headers=server.headers(), timeout=30)
        b_window = filler_window(10, 410)  # ~1,400 tokens: B's prefix, then B idles
        chat(server, f"B-{tag}", b_window)
        a_window = filler_window(20, 410)
        chat(server, f"A-{tag}", a_window)
        a_compacted = [a_window[0], {"role": "user", "content": "[summary of the work so far]"}]
        chat(server, f"A-{tag}", a_compacted)  # the hook releases A's stale blocks first
        chat(server, f"C-{tag}", filler_window(30, 410))
        prompt, cached = chat(server, f"B-{tag}", b_window)
        say(
            f"  {tag:>7}: B's return hit {cached:>5,} of its {prompt:,} prompt tokens in the "
            f"cache, computed {prompt - cached:>5,}"
        )
    say("  (no TTFT: one call per server is one sample, which a shared machine's noise swamps)")
    stats = engine_stats(plugin)
    say(f"  plugin server: {stats['released_reused']} released blocks reused so far, "
        f"segments {stats['segments']}")  # fmt: skip
    groups = ", ".join(
        f"group {g['group']} ({g['kind']}, {g['block_size']} tokens) {g['blocks_released']}"
        for g in stats["groups"]
    )
    say(f"  blocks released so far, per KV-cache group: {groups}")


def part_multi_session(plugin: VLLMServer, vanilla: VLLMServer, tracer_provider: Any) -> None:
    config = TraceConfig(sessions=6, bursts_per_session=2, steps_per_burst=3, seed=1)
    calls = generate(config)
    say(f"\n3) A short multi-session agent run on both servers: {json.dumps(describe(calls))}")

    def progress(i: int) -> None:
        if (i + 1) % 12 == 0 or i + 1 == len(calls):
            say(f"  {i + 1}/{len(calls)} calls replayed on both servers")

    jiuwen_hooks.uninstall()  # replay() installs its own hook, with the same tracer provider
    result = replay(calls, vanilla, plugin, progress, tracer_provider=tracer_provider)
    say("  side      token hit rate   prompt tokens computed")
    for side in ("vanilla", "plugin"):
        r = result[side]
        say(f"  {side:<8} {r['hit_rate']:>14.3f} {r['computed_tokens']:>24,}")
    vanilla_computed = result["vanilla"]["computed_tokens"]
    change = result["plugin"]["computed_tokens"] - vanilla_computed
    say(
        f"  plugin - vanilla: {change:+,} prompt tokens computed "
        f"({change / max(vanilla_computed, 1):+.1%}), hit rate "
        f"{result['plugin']['hit_rate'] - result['vanilla']['hit_rate']:+.3f}"
    )
    say("  TTFT not shown: the servers get one CPU core each of a shared machine, and the tiny")
    say("  model's saved prefill is worth less than that noise (paired TTFT: docs/benchmarks.md)")
    say(f"  the hook sent {result['plugin']['releases_in_request']} releases on the chat requests "
        f"themselves ({result['plugin']['releases_post']} as POST), freeing "
        f"{result['plugin']['block_released']} blocks")  # fmt: skip


def telemetry(stack: ExitStack) -> tuple[OtlpCollector | None, Any, TracerProvider]:
    """A real OTLP collector when rotel is installed, and the agent's tracer provider (spans
    also kept in memory, for part 1)."""
    collector = None
    if OtlpCollector.binary():
        collector = stack.enter_context(OtlpCollector())
        say(f"Started an OTLP collector (rotel) at {collector.http_endpoint}; "
            f"it prints what it receives to {collector.log_path}")  # fmt: skip
    else:
        say("No OTLP collector installed (pip install rotel): spans stay in memory")
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "demo-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    if collector is not None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=collector.http_endpoint + "/v1/traces")
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    stack.callback(provider.shutdown)
    return collector, memory, provider


def start_servers(
    stack: ExitStack, collector: OtlpCollector | None, arch: str
) -> tuple[VLLMServer, VLLMServer]:
    """vLLM with the plugin (exporting traces to the collector) and vanilla vLLM, side by side."""
    extra = ("--otlp-traces-endpoint", collector.grpc_endpoint) if collector is not None else ()
    dev = {"VLLM_SERVER_DEV_MODE": "1"}  # for /reset_prefix_cache before the squeeze
    blocks, max_len = SHAPES[arch]
    model = build() if arch == "llama" else build_hybrid(arch)
    common: dict[str, Any] = dict(
        model=model, num_blocks=blocks, max_model_len=max_len, api_key=API_KEY, env=dev
    )
    plugin = VLLMServer(plugin=True, extra_args=extra, cpu_cores="0", **common)
    vanilla = VLLMServer(plugin=False, cpu_cores="1", **common)
    say(f"Starting vLLM with the plugin ({plugin.root_url}) and vanilla vLLM "
        f"({vanilla.root_url}), {arch} model, {blocks} KV blocks of {BLOCK_SIZE} tokens each, "
        "about 40 s ...")  # fmt: skip
    for server in (plugin, vanilla):
        stack.callback(server.stop)
        server.start(wait=False)
    for server in (plugin, vanilla):
        server.wait_healthy()
    say(f"  logs: {plugin.log_path}, {vanilla.log_path}")
    return plugin, vanilla


def part_traces(collector: OtlpCollector) -> None:
    say("\n4) Traces")

    def all_arrived(spans: list[Any]) -> bool:
        kinds = [s.kind for s in spans if s.name == RELEASE_SPAN]
        return kinds.count("SPAN_KIND_SERVER") >= kinds.count("SPAN_KIND_CLIENT") > 0

    spans = collector.wait_for(all_arrived, timeout=30)  # the server batches for ~5 s
    releases = [s for s in spans if s.name == RELEASE_SPAN]
    clients = {s.trace_id for s in releases if s.kind == "SPAN_KIND_CLIENT"}
    servers = {s.trace_id for s in releases if s.kind == "SPAN_KIND_SERVER"}
    say(f"  the collector received {len(spans)} spans: {len(clients)} client "
        f"release spans, {len(servers)} server release spans, "
        f"{len(clients & servers)} traces holding both")  # fmt: skip
    say(f"  (collector output: {collector.log_path})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch", choices=sorted(SHAPES), default="llama",
        help="the model's shape: llama (one KV-cache group) or gpt-oss (sliding-window and "
        "full-attention groups)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    say("== Agent-aware KV-cache release: vLLM with vllm_affinity vs vanilla vLLM (CPU) ==")
    with ExitStack() as stack:
        try:
            say(f"Building the small local {args.arch} model (once) ...")
            collector, memory, provider = telemetry(stack)
            plugin, vanilla = start_servers(stack, collector, args.arch)
            hook = jiuwen_hooks.install(tracer_provider=provider)
            stack.callback(jiuwen_hooks.uninstall)

            part_weather(plugin, memory, hook)
            part_squeeze(plugin, vanilla)
            part_multi_session(plugin, vanilla, provider)

            provider.force_flush()
            if collector is not None:
                part_traces(collector)
            say("\nDone; stopping the servers.")
        except KeyboardInterrupt:
            say("\nInterrupted; stopping everything.")
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
