"""``docs/contract.md`` names every field of the request models the server validates with, and
only fields they have (a renamed or added field fails here until the document follows)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CONTRACT = Path(__file__).resolve().parents[1] / "docs" / "contract.md"


def documented() -> str:
    return CONTRACT.read_text()


def field_names(model: type) -> set[str]:
    return set(model.model_fields)  # type: ignore[attr-defined]


def test_release_request_fields_are_all_documented() -> None:
    pytest.importorskip("fastapi")
    from vllm_affinity.route import ReleaseRequest

    table = re.findall(r"^\| `(\w+)` \|", documented(), flags=re.MULTILINE)
    assert set(table) == field_names(ReleaseRequest)


def test_agent_hint_fields_are_all_documented() -> None:
    from vllm_affinity.core.agent_hint import AgentHint, ContextManagement, Edit

    text = documented()
    for model in (AgentHint, ContextManagement, Edit):
        for name in field_names(model):
            assert f"`{name}`" in text, f"{model.__name__}.{name} is not in docs/contract.md"


def test_in_request_hint_keys_are_documented() -> None:
    from vllm_affinity.core.hint import _KEYS

    for key in _KEYS:
        assert f"`{key}`" in documented()
