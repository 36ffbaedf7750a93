"""Header, path and span names are spelled once, in ``jiuwen_kv_protocol.headers``: no module of
the two packages, the examples or the benchmarks spells one itself. (Tests spell the wire on
purpose: they check the constants against the names a peer sends.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from jiuwen_kv_protocol import headers

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("jiuwen_hooks", "vllm_affinity", "jiuwen_replay", "examples", "benchmarks")
#: Every header, path and span name (exact case; header names also lower-cased).
NAMES = {
    value
    for name, constant in vars(headers).items()
    if name.isupper()
    for value in (constant if isinstance(constant, tuple) else (constant,))
    if isinstance(value, str)
} | {headers.RELEASE_HEADER.lower(), headers.SESSION_HEADER.lower()}


def string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_module_spells_a_wire_name(folder: str) -> None:
    spelled = {
        f"{path.relative_to(ROOT)}: {value!r}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for value in string_constants(path) & NAMES
    }
    assert not spelled, "use jiuwen_kv_protocol.headers instead:\n" + "\n".join(sorted(spelled))


def test_the_names_are_found_where_they_are_spelled() -> None:
    assert {"X-Session-ID", "kv_cache.release", "/release_kv_cache"} <= string_constants(
        ROOT / "jiuwen_kv_protocol" / "headers.py"
    )
