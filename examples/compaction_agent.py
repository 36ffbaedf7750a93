"""Demo: a tool-using agent whose micro-compaction triggers a KV-cache release.

The original design's scenario: three rounds of weather look-ups (Paris, Oslo, Lima); before the
final model call a compressor clears the two older tool results, so a release fires from the first
cleared message. Then a few sessions run side by side, each compacting once.

    python -m examples.compaction_agent --vllm             # starts vLLM (CPU) with the plugin
    python -m examples.compaction_agent --base-url URL     # against a server already running
    python -m examples.compaction_agent                    # against a local recording server

The agent's tool calls are scripted, so it runs on any model (including a random-weight one);
what matters here is the window the agent sends and the releases the hook sends first.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from contextlib import ExitStack
from typing import Any

import openai
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import jiuwen_hooks
from jiuwen_hooks.testing import LocalEngine
from jiuwen_kv_protocol.headers import SESSION_ATTRIBUTE

PLACEHOLDER = "[Old tool result content cleared]"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@jiuwen_hooks.compressor(name="micro_compact")
def micro_compact(messages: list[dict[str, Any]], keep_last: int = 1) -> None:
    """Clear all but the newest ``keep_last`` tool results in place (metadata kept)."""
    tool_indices = [i for i, m in enumerate(messages) if m.get("role") == "tool"]
    for i in tool_indices[: max(0, len(tool_indices) - keep_last)]:
        messages[i] = {**messages[i], "content": PLACEHOLDER}


def weather_report(city: str) -> str:
    """A long tool result, as real tools return: this is what compaction later clears."""
    hours = [f"{h:02d}:00 {city} {12 + h % 7}C wind {3 + h % 5} m/s" for h in range(6, 18)]
    return json.dumps({"city": city, "hourly": hours})


def run_weather_agent(client: openai.OpenAI, model: str, session: str, say: Any) -> None:
    window: list[Any] = [
        {"role": "system", "content": "You are a weather assistant. Use get_weather."},
        {"role": "user", "content": "Compare the weather in Paris, Oslo and Lima."},
    ]
    with jiuwen_hooks.session(session):
        for round_no, city in enumerate(("Paris", "Oslo", "Lima"), start=1):
            reply = client.chat.completions.create(
                model=model, messages=window, tools=[WEATHER_TOOL], max_tokens=8
            )
            say(f"  [{session}] round {round_no}: model call with {len(window)} messages")
            call_id = f"call_{city.lower()}"
            window.append(
                {
                    "role": "assistant",
                    "content": reply.choices[0].message.content or "",
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {
                                "name": "get_weather",
                                "arguments": json.dumps({"city": city}),
                            },
                        }
                    ],
                }
            )
            window.append(
                {"role": "tool", "tool_call_id": call_id, "content": weather_report(city)}
            )
        micro_compact(window)
        say(f"  [{session}] micro-compaction cleared the 2 older tool results")
        client.chat.completions.create(
            model=model, messages=window, tools=[WEATHER_TOOL], max_tokens=8
        )
        say(f"  [{session}] final model call with {len(window)} messages")


def describe_release(body: dict[str, Any]) -> str:
    tools = body.get("tools_released_index")
    extra = f", tools_released_index={tools}" if tools is not None else ""
    return (
        f"session={body['cache_salt']} messages_released_index={body['messages_released_index']}"
        f" of {len(body['messages'])}{extra}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", action="store_true", help="start vLLM with the plugin (CPU)")
    parser.add_argument("--base-url", help="OpenAI-compatible base URL of a running server")
    parser.add_argument("--api-key", default="demo-key", help="API key for the server")
    parser.add_argument("--model", default="tiny", help="served model name")
    parser.add_argument("--sessions", type=int, default=3, help="sessions in the multi-session run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    def say(text: str) -> None:
        print(text, flush=True)

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))

    with ExitStack() as stack:
        engine = server = None
        base_url = args.base_url
        if args.vllm:
            server = start_vllm(stack, args.api_key, say)
            base_url = server.base_url
        elif base_url is None:
            engine = stack.enter_context(LocalEngine(reply="(local server)"))
            base_url = engine.base_url
            say(f"Started a local recording server at {engine.root_url} (records releases)")
        hook = jiuwen_hooks.install(tracer_provider=tracer_provider)
        stack.callback(jiuwen_hooks.uninstall)
        client = stack.enter_context(openai.OpenAI(base_url=base_url, api_key=args.api_key))

        say("\n1) One agent, three weather look-ups, then compaction before the final call")
        run_weather_agent(client, args.model, "weather-1", say)
        if server is not None:
            say(f"  server free-queue segments now: {segments(server)}")

        say(f"\n2) {args.sessions} sessions side by side, each compacting once")
        for n in range(args.sessions):
            run_weather_agent(client, args.model, f"multi-{n}", say)
        if server is not None:
            say(f"  server free-queue segments now: {segments(server)}")

        hook.flush()  # compressor releases are sent off the agent's path
        report(exporter, engine, server, say)
    return 0


def report(exporter: InMemorySpanExporter, engine: Any, server: Any, say: Any) -> None:
    """What was released: the client's spans, what a local server received, the counters."""
    say("\nReleases sent (from the client's spans):")
    for span in exporter.get_finished_spans():
        a = span.attributes or {}
        say(
            f"  {span.name} ({a.get('jiuwen.release.mode')}) "
            f"session={a.get(SESSION_ATTRIBUTE)} "
            f"reason={a.get('jiuwen.release.reason')} "
            f"messages_released_index={a.get('jiuwen.release.messages_released_index')} "
            f"block_released={a.get('jiuwen.release.block_released')} "
            f"status={a.get('http.response.status_code')} "
            f"trace_id={span.context.trace_id:032x}"
        )
    if engine is not None:
        say("\nWhat the server got on /release_kv_cache (this local server has no KV cache;")
        say("it answers block_released = number of released messages):")
        for request in engine.releases:
            say(f"  {describe_release(request.body)}")
    say("\nHook counters: " + json.dumps(jiuwen_hooks.stats(), sort_keys=True))
    if server is not None:
        (stats,) = server.affinity_stats()["engines"]
        say("Server counters: " + json.dumps(stats, sort_keys=True))
        say("Stopping vLLM ...")
    say("Spans were kept in memory and printed above.")


def start_vllm(stack: ExitStack, api_key: str, say: Any) -> Any:
    """Build the small model if needed and start vLLM (CPU) with the plugin; stopped on exit."""
    from vllm_affinity.testing import VLLMServer
    from vllm_affinity.testing.tiny_model import build

    say("Building the small local model (once) ...")
    model = build()
    server = VLLMServer(model=model, plugin=True, num_blocks=256, api_key=api_key)
    say(f"Starting vLLM with the vllm_affinity plugin on {server.root_url} (about 30 s) ...")
    say(f"  (server log: {server.log_path})")
    stack.callback(server.stop)
    server.start()
    say(f"vLLM is up: {server.num_blocks} KV blocks of 32 tokens, model {model}")
    return server


def segments(server: Any) -> str:
    (stats,) = server.affinity_stats()["engines"]
    return ", ".join(f"{name}={count}" for name, count in stats["segments"].items())


if __name__ == "__main__":
    sys.exit(main())
