"""The installed distribution's version (advertised by ``GET /affinity/capabilities``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def plugin_version() -> str:
    try:
        return version("jiuwen-kv-affinity")
    except PackageNotFoundError:
        return "unknown"
