"""The packages meet only through each other's public names: no module of one imports a private
module (``_name``) of another, the hook never imports the plugin, and the wire package imports
neither. Inside each package imports only go down (no circle, lazy and type-checking imports
included), and the plugin's rooms keep their floors: the pure core at the bottom, the engine
core's and the API server's rooms beside each other (neither imports the other), the tools for
tests and demos above everything a production server loads."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jiuwen_hooks", "jiuwen_kv_protocol", "jiuwen_replay", "vllm_affinity")
#: Packages a package must not import at all.
FORBIDDEN = {
    "jiuwen_kv_protocol": {"jiuwen_hooks", "vllm_affinity", "jiuwen_replay"},
    "jiuwen_hooks": {"vllm_affinity", "jiuwen_replay"},
    "vllm_affinity": {"jiuwen_hooks", "jiuwen_replay"},
}
#: The plugin's floors, lowest first: a module imports only from its own floor or below, and
#: the rooms of one floor (the two processes) not from each other.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("vllm_affinity.core",),
    ("vllm_affinity._version", "vllm_affinity.compat", "vllm_affinity.settings"),
    ("vllm_affinity.engine", "vllm_affinity.api_server"),  # engine core | API server
    ("vllm_affinity.plugin", "vllm_affinity.nginx", "vllm_affinity"),  # the last: __init__
    ("vllm_affinity.testing",),  # the server harness, model builders, pytest plugin
    ("vllm_affinity.__main__",),  # the command line reaches every floor
)


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


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` → the modules of ``package`` it imports (at any depth of the
    file: inside functions and ``TYPE_CHECKING`` blocks too)."""
    paths = {module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    stem = here[: len(here) - node.level + 1]
                    base = ".".join([*stem, *([node.module] if node.module else [])])
                # ``from . import _state`` imports the module, not the package's __init__
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base
                    for alias in node.names
                ]
            else:
                continue
            for target in targets:
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_only_go_down(package: str) -> None:
    try:
        list(graphlib.TopologicalSorter(module_graph(package)).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"an import circle: {' -> '.join(exc.args[1])}")


def room_of(module: str) -> tuple[int, str]:
    """(floor, room) of a plugin module: the longest room name it starts with."""
    found = [
        (len(room), floor, room)
        for floor, rooms in enumerate(FLOORS)
        for room in rooms
        if module == room or (module.startswith(room + ".") and room != "vllm_affinity")
    ]
    if not found:
        raise AssertionError(f"{module} is on no floor: add its room to FLOORS")
    _, floor, room = max(found)
    return floor, room


def test_the_plugin_rooms_keep_their_floors() -> None:
    upward = [
        f"{module} -> {target}"
        for module, targets in module_graph("vllm_affinity").items()
        for target in targets
        if (room_of(target)[0], room_of(target)[1] != room_of(module)[1])
        > (room_of(module)[0], False)
    ]
    assert not upward, upward


def test_a_circle_and_an_upward_import_are_found(tmp_path: Path) -> None:
    graph = module_graph("vllm_affinity")
    graph["vllm_affinity.core.queue"].add("vllm_affinity.engine.pool_affinity")
    with pytest.raises(graphlib.CycleError):
        list(graphlib.TopologicalSorter(graph).static_order())
    assert room_of("vllm_affinity.engine.pool_affinity") == (2, "vllm_affinity.engine")
    assert room_of("vllm_affinity.api_server.route") == (2, "vllm_affinity.api_server")


#: The engine room's parts, lowest first: each imports only parts below it (the door,
#: ``pool_affinity``, every part; no part the door). Modules of the room not listed here (the
#: patches, the checkpoints, the fail-open counters) are outside the pool's parts.
ENGINE_PARTS: tuple[str, ...] = (
    "vllm_affinity.engine.pool_context",
    "vllm_affinity.engine.bindings",
    "vllm_affinity.engine.releases",
    "vllm_affinity.engine.families",
    "vllm_affinity.engine.picker",
    "vllm_affinity.engine.pool_reports",
    "vllm_affinity.engine.pool_affinity",
)
#: Parts beside each other (neither may import the other).
BESIDE = {
    frozenset({"vllm_affinity.engine.picker", "vllm_affinity.engine.pool_reports"}),
    frozenset({"vllm_affinity.engine.families", "vllm_affinity.engine.picker"}),
    frozenset({"vllm_affinity.engine.families", "vllm_affinity.engine.pool_reports"}),
}


def engine_parts_upward(graph: dict[str, set[str]]) -> list[str]:
    """``part -> target`` for each import of a part at or above the importer's place (or
    beside it)."""
    place = {part: n for n, part in enumerate(ENGINE_PARTS)}
    return [
        f"{part} -> {target}"
        for part in ENGINE_PARTS
        for target in graph.get(part, ())
        if target in place and (place[target] >= place[part] or frozenset({part, target}) in BESIDE)
    ]


def test_the_engine_rooms_parts_import_only_down() -> None:
    graph = module_graph("vllm_affinity")
    assert set(ENGINE_PARTS) <= set(graph), set(ENGINE_PARTS) - set(graph)
    assert not engine_parts_upward(graph)
    # the door imports every part, and nothing outside the room imports a part but the door
    assert set(ENGINE_PARTS[:-1]) <= graph["vllm_affinity.engine.pool_affinity"]
    outside = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets & set(ENGINE_PARTS[:-1])
        if not module.startswith("vllm_affinity.engine.")
    ]
    assert not outside, outside


def test_a_planted_upward_import_of_an_engine_part_is_found() -> None:
    graph = module_graph("vllm_affinity")
    graph["vllm_affinity.engine.bindings"].add("vllm_affinity.engine.releases")
    graph["vllm_affinity.engine.picker"].add("vllm_affinity.engine.families")
    assert engine_parts_upward(graph) == [
        "vllm_affinity.engine.bindings -> vllm_affinity.engine.releases",
        "vllm_affinity.engine.picker -> vllm_affinity.engine.families",
    ]


#: The pure core's split tables: each door (what the rest imports) over the part it is built on,
#: which imports neither its door nor anything above it, and which nothing outside the core
#: imports but its door.
CORE_DOORS: dict[str, str] = {
    "vllm_affinity.core.queue": "vllm_affinity.core.queue_links",
    "vllm_affinity.core.sessions": "vllm_affinity.core.record_holds",
}


def core_parts_crossed(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> part`` for each import of a core part by anything but its door or the
    core's own package, and ``part -> door`` for a part that imports its door."""
    found = []
    for door, part in CORE_DOORS.items():
        found += [f"{part} -> {door}" for target in graph.get(part, ()) if target == door]
        found += [
            f"{module} -> {part}"
            for module, targets in graph.items()
            if part in targets
            and module not in (door, "vllm_affinity.core", part)
            and not module.startswith(part.rpartition(".")[0] + ".")  # core beside it: fine
        ]
    return found


def test_the_cores_split_tables_keep_their_doors() -> None:
    graph = module_graph("vllm_affinity")
    for door, part in CORE_DOORS.items():
        assert part in graph[door], f"{door} no longer builds on {part}"
    assert not core_parts_crossed(graph)


def test_a_planted_import_past_a_core_door_is_found() -> None:
    graph = module_graph("vllm_affinity")
    graph["vllm_affinity.engine.bindings"].add("vllm_affinity.core.record_holds")
    graph["vllm_affinity.core.queue_links"].add("vllm_affinity.core.queue")
    assert sorted(core_parts_crossed(graph)) == [
        "vllm_affinity.core.queue_links -> vllm_affinity.core.queue",
        "vllm_affinity.engine.bindings -> vllm_affinity.core.record_holds",
    ]


#: A module a reader takes in at one sitting: the plugin's modules stay under this many lines.
MOST_LINES = 500


def test_every_plugin_module_reads_in_one_sitting() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in sorted((ROOT / "vllm_affinity").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MOST_LINES
    }
    assert not long, f"over {MOST_LINES} lines: split them by responsibility: {long}"
