"""``docs/contract.md`` names every field of the request models the server validates with, and
only fields they have (a renamed or added field fails here until the document follows)."""

from __future__ import annotations

import re
from pathlib import Path

CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "contract.md"


def documented() -> str:
    return CONTRACT.read_text()


def field_names(model: type) -> set[str]:
    return set(model.model_fields)  # type: ignore[attr-defined]


def test_release_request_fields_are_all_documented() -> None:
    from jiuwen_kv_protocol.models import ReleaseRequest

    table = re.findall(r"^\| `(\w+)` \|", documented(), flags=re.MULTILINE)
    assert set(table) == field_names(ReleaseRequest)


def test_answer_fields_are_all_documented() -> None:
    """Every figure of an engine's release is in the documented 200 answer."""
    from jiuwen_kv_protocol.models import EngineRelease, ReleaseReceipt

    answer = re.search(r"\*\*Answer 200\*\*.*?```(.*?)```", documented(), flags=re.DOTALL)
    assert answer is not None
    for name in field_names(EngineRelease) | field_names(ReleaseReceipt):
        assert f'"{name}"' in answer.group(1), f"{name} is not in the documented answer"


def test_prefetch_figures_are_documented() -> None:
    from jiuwen_kv_protocol.models import EngineRestore

    for name in field_names(EngineRestore):
        assert f'"{name}"' in documented(), f"EngineRestore.{name} is not in docs/contract.md"


def test_agent_hint_fields_are_all_documented() -> None:
    from vllm_affinity.core.agent_hint import AgentHint, ContextManagement, Edit

    text = documented()
    for model in (AgentHint, ContextManagement, Edit):
        for name in field_names(model):
            assert f"`{name}`" in text, f"{model.__name__}.{name} is not in docs/contract.md"


def test_in_request_hint_keys_are_documented() -> None:
    from jiuwen_kv_protocol.hint import _KEYS

    for key in _KEYS:
        assert f"`{key}`" in documented()


def test_stats_fields_are_all_documented() -> None:
    from jiuwen_kv_protocol.models import EngineStats, Segments

    stats = re.search(r"## Stats.*?```(.*?)```", documented(), flags=re.DOTALL)
    assert stats is not None
    for name in field_names(EngineStats) | field_names(Segments):
        assert f'"{name}"' in stats.group(1), f"{name} is not in the documented stats"


def test_the_readme_summary_names_every_request_field() -> None:
    """The README's contract block (its first code block) is the short form of the same."""
    from jiuwen_kv_protocol.models import ReleaseRequest

    readme = (CONTRACT.parents[1] / "README.md").read_text()
    block = re.search(r"```\n(.*?)```", readme, flags=re.DOTALL)
    assert block is not None
    for name in field_names(ReleaseRequest):
        assert f'"{name}"' in block.group(1), f"{name} is not in the README's contract block"


def test_every_server_setting_is_in_the_settings_table_and_no_other() -> None:
    """``docs/server.md``'s settings table names exactly the variables ``Settings.from_env``
    reads."""
    root = Path(__file__).resolve().parents[2]
    source = (root / "vllm_affinity" / "settings.py").read_text()
    read = set(re.findall(r'"(VLLM_AFFINITY_\w+)"', source))
    readme = (root / "docs" / "server.md").read_text()
    table = set(re.findall(r"^\| `(VLLM_AFFINITY_\w+)` \|", readme, flags=re.MULTILINE))
    assert table == read


def test_every_hook_option_is_in_the_options_table_and_no_other() -> None:
    """``docs/client.md``'s options table names exactly the fields of ``Options``."""
    import dataclasses

    from jiuwen_hooks._options import Options

    readme = (Path(__file__).resolve().parents[2] / "docs" / "client.md").read_text()
    rows = re.findall(r"^\| (`\w+`(?:, `\w+`)*) \| (?:`JIUWEN_|—)", readme, flags=re.MULTILINE)
    table = {name.strip("` ") for row in rows for name in row.split(",")}
    assert table == {f.name for f in dataclasses.fields(Options)}
