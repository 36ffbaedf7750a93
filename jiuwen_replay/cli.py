"""``jiuwen-bench replay`` and ``jiuwen-bench make-trace``: measure on your own deployment.

    jiuwen-bench replay --format agentinfer --base-url http://gpu-host:8000/v1 \\
        --baseline-url http://gpu-host:8001/v1 --model Qwen/Qwen3-8B
    jiuwen-bench replay --trace mooncake.jsonl --format mooncake --limit 500 \\
        --base-url http://127.0.0.1:8000/v1 --model tiny --scale 0.0625 --max-output-tokens 4
    jiuwen-bench make-trace --out trace.jsonl [--format agentx]

Against two URLs (``--baseline-url``: vanilla vLLM) the baseline runs without the hook and
``--base-url`` with it; against one URL the same server runs without and with the hook, each
run with prompts of its own. Sides alternate round by round. Writes ``<out>/<name>.json`` (with
run metadata and every call), ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .compare import compare, say
from .formats import FORMATS, WRITERS, TraceFormatError, agentinfer_trace_path, read_trace
from .runner import ReplayOptions, Target
from .synthetic import SyntheticConfig, generate
from .trace import SIGNALS


def _positive(kind: type) -> object:
    def parse(text: str) -> object:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def replay_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jiuwen-bench replay",
        description="Replay an agent trace against an OpenAI-compatible server through "
        "jiuwen_hooks, and compare with a baseline.",
    )
    parser.add_argument("--trace", help="the trace file (agentinfer: default, the package's)")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--base-url", required=True, help="the server the hook runs against")
    parser.add_argument("--baseline-url", help="a vanilla server to compare with (no hook)")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--scale", type=_positive(float), default=1.0, help="token multiplier")
    parser.add_argument(
        "--speed", type=float, default=1.0,
        help="the trace's clock runs N times faster; 0: one call at a time in trace order",
    )  # fmt: skip
    parser.add_argument("--concurrency", type=_positive(int), default=64)
    parser.add_argument("--max-output-tokens", type=_positive(int), default=None)
    parser.add_argument("--limit", type=_positive(int), help="replay the first N calls only")
    parser.add_argument(
        "--copies", type=_positive(int), default=1,
        help="N copies of every session, each with content of its own (tenants): many sessions "
        "in flight over one pool; with --speed, calls overlap as on a busy server",
    )  # fmt: skip
    parser.add_argument(
        "--stagger", type=float, default=0.0,
        help="seconds (trace time) between the starts of successive copies",
    )  # fmt: skip
    parser.add_argument("--rounds", type=_positive(int), default=1)
    parser.add_argument(
        "--next-use", choices=SIGNALS, default="none",
        help="what the hooked side tells the plugin of each call's end (X-KV-Next-Use): "
        "gap: the trace's time to the session's next call; finish: what a real model's "
        "finish reason would say (tool call, subagents running: live; turn or task over: idle)",
    )  # fmt: skip
    parser.add_argument(
        "--end-sessions", action="store_true", help="end each session after its last call"
    )
    parser.add_argument(
        "--api", choices=("chat", "messages"), default="chat",
        help="chat: the openai SDK on /v1/chat/completions; messages: the anthropic SDK on "
        "/v1/messages (coding agents)",
    )  # fmt: skip
    parser.add_argument(
        "--no-parents", action="store_true",
        help="do not tell the plugin which session is a subagent of which",
    )  # fmt: skip
    parser.add_argument(
        "--no-ignore-eos", action="store_true",
        help="for servers that refuse vLLM's ignore_eos (outputs may then end early)",
    )  # fmt: skip
    parser.add_argument(
        "--agent-headers", action="store_true",
        help="also replay with no hook, each call carrying a coding agent's own session headers "
        "(Claude Code's with --api messages, the Codex CLI's thread on chat): the server tells "
        "compactions from the windows alone; with --next-use finish, a call the trace ends "
        "with an answer finishes 'stop', so the server reads it as an answer",
    )  # fmt: skip
    parser.add_argument("--no-simulator", action="store_true")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument(
        "--system-prompts",
        action="store_true",
        help="send each actor's instructions as a system prompt, where the trace says which "
        "blocks they are (the agentinfer trace does), as agents send them",
    )
    parser.add_argument("--out", default="replay-results")
    parser.add_argument("--name", help="file stem (default: replay_<format>)")
    return parser


def replay_main(argv: list[str]) -> int:
    args = replay_parser().parse_args(argv)
    if args.speed < 0:
        replay_parser().error("--speed must be 0 or more")
    try:
        path = args.trace or (agentinfer_trace_path() if args.format == "agentinfer" else None)
        if path is None:
            replay_parser().error(f"--trace is required for --format {args.format}")
        trace = read_trace(path, args.format)
    except TraceFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.limit:
        trace = trace.head(args.limit)
    trace = trace.copies(args.copies, args.stagger)
    options = ReplayOptions(
        model=args.model,
        api_key=args.api_key,
        scale=args.scale,
        speed=args.speed,
        concurrency=args.concurrency,
        max_output_tokens=args.max_output_tokens,
        ignore_eos=not args.no_ignore_eos,
        next_use=args.next_use,
        end_sessions=args.end_sessions,
        api=args.api,
        parents=not args.no_parents,
        system_prompts=args.system_prompts,
        progress=not args.quiet,
    )
    if args.baseline_url:
        targets = [
            Target("baseline", args.baseline_url, hooked=False),
            Target("hooked", args.base_url, hooked=True),
        ]
    else:
        targets = [
            Target("no hook", args.base_url, hooked=False),
            Target("hooked", args.base_url, hooked=True),
        ]
    if args.agent_headers:
        targets.append(Target("agent headers", args.base_url, hooked=False, agent_headers=True))
    say(f"trace: {trace.describe()}")
    result = compare(trace, targets, options, args.rounds, simulate_runs=not args.no_simulator)
    write(result, args.out, args.name or f"replay_{args.format}", plot=not args.no_plot)
    return 0


def write(result: dict, out: str, stem: str, plot: bool = True) -> None:
    from .output import write_outputs
    from .report import markdown
    from .report import plot as draw

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        plot = False
    write_outputs(out, stem, result, markdown(result), draw if plot else None)


def make_trace_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="jiuwen-bench make-trace",
        description="Write a small synthetic agent trace (leads, subagents, compactions).",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--format", choices=FORMATS, default="project")
    parser.add_argument("--sessions", type=_positive(int), default=SyntheticConfig.sessions)
    parser.add_argument("--calls", type=_positive(int), default=SyntheticConfig.calls_per_session)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    trace = generate(
        SyntheticConfig(sessions=args.sessions, calls_per_session=args.calls, seed=args.seed)
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    WRITERS[args.format](trace, args.out)
    say(f"wrote {args.out}: {trace.describe()}")
    return 0


USAGE = """usage: jiuwen-bench replay --format F --base-url URL --model NAME [...]
       jiuwen-bench make-trace --out FILE [--format F]
(--help after either for its options)"""


def main(argv: list[str]) -> int:
    if argv[:1] == ["replay"]:
        return replay_main(argv[1:])
    if argv[:1] == ["make-trace"]:
        return make_trace_main(argv[1:])
    print(USAGE, file=sys.stderr)
    return 2


def command() -> int:
    """The ``jiuwen-bench`` console script."""
    return main(sys.argv[1:])
