"""Shared by the benchmark scripts: where and how results are written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, result: dict[str, Any], echo: bool = True) -> None:
    """Print ``result`` (when ``echo``) and write it to ``path``, creating the folder."""
    text = json.dumps(result, indent=2) + "\n"
    if echo:
        print(text, end="")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
