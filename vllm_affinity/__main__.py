"""Command line: ``python -m vllm_affinity serve MODEL [vLLM arguments...]``.

Starts vLLM's OpenAI-compatible server with both plugin halves enabled (``VLLM_PLUGINS`` gets
``vllm_affinity`` added; the ``vllm`` console script does not work with the CPU build).
``--vanilla`` starts the same server with the plugin excluded, for side-by-side comparisons.

    python -m vllm_affinity serve .cache/tiny-llama --block-size 32 --port 8000
    python -m vllm_affinity build-model            # the small local model (prints its folder)
"""

from __future__ import annotations

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
    from vllm.entrypoints.launchers.api_server.entry import main

    sys.argv = ["vllm_affinity serve", "--model", argv[0], *argv[1:]]
    main()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    if argv[:1] == ["build-model"]:
        from .tiny_model import main as build_main

        return build_main(argv[1:])
    print(USAGE)
    return 2


if __name__ == "__main__":
    sys.exit(main())
