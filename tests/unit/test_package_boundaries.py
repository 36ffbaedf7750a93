"""The packages meet only through each other's public names: no module of one imports a private
module (``_name``) of another, the hook never imports the plugin, and the wire package imports
neither."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jiuwen_hooks", "jiuwen_kv_protocol", "jiuwen_replay", "vllm_affinity")
#: Packages a package must not import at all.
FORBIDDEN = {
    "jiuwen_kv_protocol": {"jiuwen_hooks", "vllm_affinity", "jiuwen_replay"},
    "jiuwen_hooks": {"vllm_affinity", "jiuwen_replay"},
    "vllm_affinity": {"jiuwen_hooks"},
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def crossings(package: str) -> list[str]:
    """``path: module`` for each import of another package's private module or of a package
    this one must not import."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for module in imported_modules(path):
            top, *rest = module.split(".")
            if top == package or top not in PACKAGES:
                continue
            private = any(part.startswith("_") and part != "__version__" for part in rest)
            if private or top in FORBIDDEN.get(package, set()):
                found.append(f"{path.relative_to(ROOT)}: {module}")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_meet_only_through_public_names(package: str) -> None:
    assert not crossings(package)


def test_a_private_import_is_found(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from jiuwen_hooks._release import x\nimport vllm_affinity.core\n")
    assert imported_modules(module) >= {"jiuwen_hooks._release", "vllm_affinity.core"}
