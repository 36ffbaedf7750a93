"""``benchmarks/results/`` is a shelf of current results (``benchmarks/results/README.md``).

Every ``benchmarks/results/...`` path the README, the changelog, ``docs/``, the benchmark
scripts and the Makefile mention exists; every file on the shelf belongs to a benchmark script
(its stem starts with the script's name) or to a named run the docs quote (``NAMED_RUNS``); and
every ``.md`` result states the command that made it. Earlier runs live in git history and are
cited as ``git show <sha>:benchmarks/results/<name>.md``, which this test does not resolve.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SOURCES = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    ROOT / "Makefile",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "benchmarks").rglob("*.py")),
]
MODULES = sorted(p.stem for p in (ROOT / "benchmarks").rglob("*.py") if p.stem != "__init__")

# A path to the shelf, bare (``results/x.md`` in docs/benchmarks.md) or relative. Not one after
# ``<sha>:`` (``git show``) or inside another name (``replay-results/``). ``{a,b}`` alternatives
# are expanded; ``{name}`` and ``<name>`` are placeholders, skipped; ``*`` is a glob.
MENTION = re.compile(
    r"(?<![\w:/.-])(?:\.\./)*(?:benchmarks/)?results/((?:[\w.*<>-]|/|\{[^}\s]*\})*)"
)

# Named runs the docs quote as a current figure, whose stem is not a script's name.
NAMED_RUNS = {
    "coding_agents": "trace_replay --name coding_agents: docs/coding-agents.md's measured grid",
    "coding_agents_speed16": "trace_replay, the same on the trace's clock x16: coding-agents.md",
    "agent_headers": "trace_replay --name agent_headers: agents' own headers, coding-agents.md",
    "agent_headers_project": "trace_replay, the same on the project trace: coding-agents.md",
    "peer_agentinfer": "trace_replay --name peer_agentinfer: benchmarks.md, beside the peer",
    "load_copies8": "trace_replay --copies 8 --name load_copies8: benchmarks.md, under load",
    "never_worse_first4": "trace_replay --sessions 4: benchmarks.md, the case that was worse",
    "never_worse_first4_ends": "the same with --end-sessions: benchmarks.md's table's ends rows",
    "tight_pools": "trace_replay --name tight_pools: benchmarks.md, tight pools",
    "hybrid_replay_gpt_oss": "trace_replay --model tiny-gpt-oss, documented in its docstring",
    "hybrid_replay_qwen3_next": "the same on tiny-qwen3-next: benchmarks.md's hybrid replay",
    "idless_traffic": "idless_agents --traffic one-shot,chat --out ...: coding-agents.md",
    "idless_chat_uis": "idless_agents --traffic webui,greeting,lookalike --out ...: ditto",
    "fleet_agents": "fleet_bench --scenarios ...agent_headers...: deployment.md's fleet table",
}
COMPARE = "compare"  # benchmarks/agents/compare_all.py's own folder: compare.md and one set per run


def expand(path: str) -> list[str]:
    """``a{,_b}.{json,md}`` -> the four names; a brace without a comma is left as it is."""
    match = re.search(r"\{([^{}]*,[^{}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [name for alt in match.group(1).split(",") for name in expand(head + alt + tail)]


def missing(path: str) -> bool:
    if re.search(r"\{[^},]*\}|<[^>]*>", path):
        return False  # a placeholder: {name}, <format>
    if "*" in path:
        return not list(RESULTS.glob(path))
    target = RESULTS / path
    # A stem alone (``<out>/<name>`` defaults, ``results/belady_gap``) names its file set.
    return not (target.exists() or list(RESULTS.glob(target.name + ".*")))


def mentions(text: str) -> list[str]:
    return [m.rstrip(".,;:") for m in MENTION.findall(text)]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_mentioned_result_exists(source: Path) -> None:
    broken = sorted(
        {m for m in mentions(source.read_text()) for name in expand(m) if missing(name)}
    )
    assert not broken, (
        f"{source.relative_to(ROOT)} mentions results that are not on the shelf: {broken} "
        "(point it at the current result, or cite the earlier run as "
        "`git show <sha>:benchmarks/results/<name>.md`)"
    )


def test_mentions_are_found() -> None:
    """The scan sees the forms the docs use, and passes over ``git show`` citations."""
    text = (
        "`benchmarks/results/a.{json,md}` (results/b.md) ../benchmarks/results/c.png "
        "`git show 1234abc:benchmarks/results/old.md` replay-results/r.json "
        "benchmarks/results/never_worse_first4{,_ends}.*"
    )
    assert mentions(text) == ["a.{json,md}", "b.md", "c.png", "never_worse_first4{,_ends}.*"]
    assert expand("x{,_y}.{json,md}") == ["x.json", "x.md", "x_y.json", "x_y.md"]
    assert missing("no_such_result.md") and not missing("replay_<format>.json")


def test_every_result_belongs_to_a_benchmark() -> None:
    strays = []
    for path in sorted(RESULTS.iterdir()):
        if path.name == "README.md" or (path.is_dir() and path.name == COMPARE):
            continue
        stem = path.name.split(".", 1)[0]
        if not (path.is_file() and (stem in NAMED_RUNS or stem.startswith(tuple(MODULES)))):
            strays.append(path.name)
    compare = RESULTS / COMPARE
    strays += [f"{COMPARE}/{p.name}" for p in compare.iterdir() if not p.name.startswith(COMPARE)]
    assert not strays, (
        f"not a benchmark's current result: {strays}. One file set per benchmark, named after "
        "its script; a re-run replaces it (benchmarks/results/README.md)"
    )


def test_named_runs_are_on_the_shelf() -> None:
    gone = [stem for stem in NAMED_RUNS if not list(RESULTS.glob(stem + ".*"))]
    assert not gone, f"NAMED_RUNS lists runs no longer on the shelf: {gone}"
    assert (ROOT / "benchmarks" / "agents" / "compare_all.py").exists()


@pytest.mark.parametrize(
    "path",
    sorted(p for p in RESULTS.rglob("*.md") if p.name != "README.md"),
    ids=lambda p: p.relative_to(RESULTS).as_posix(),
)
def test_markdown_result_states_its_command(path: Path) -> None:
    head = "\n".join(path.read_text().splitlines()[:4])
    assert "python -m benchmarks." in head, f"{path.name}: no command in its first lines"
