"""The real Open WebUI (PyPI ``open-webui``, ``make open-webui``; ``make test-long``) in front of
vanilla vLLM and of the plugin as it ships, several users chatting at once through its HTTP API
with regenerations, edits, a branch and its task requests (title, tags, follow-ups: one user
message quoting the chat, no system prompt), at a tight pool and a loose one
(``benchmarks/agents/open_webui.py`` drives both sides).

No two chats are joined and no task is linked to its chat: every chat request that carries an
answer continues a chain and every other request starts one. Nothing released is hit again,
and the plugin computes no more prompt tokens than vanilla."""

from __future__ import annotations

import pytest

from benchmarks.agents.open_webui import OPEN_WEBUI, measure

from .conftest import missing

pytestmark = pytest.mark.long

USERS, TURNS = 4, 6


@pytest.mark.parametrize("per_user", [20, 48], ids=["tight", "loose"])
def test_open_webui_users_are_never_joined_and_never_worse_than_vanilla(per_user: int) -> None:
    if not OPEN_WEBUI.exists():
        missing(f"{OPEN_WEBUI} is missing: `make open-webui` installs it")
    pool = per_user * USERS
    vanilla = measure(False, pool, USERS, TURNS)
    plugin = measure(True, pool, USERS, TURNS)
    traffic, chains = plugin["traffic"], plugin["chains"]
    assert sum(traffic["tasks"].values()) == USERS * (TURNS + 2), traffic
    # each chat request carrying an answer continued its chat; a chat's first request and
    # every task started a chain of its own (a task linked to its chat would be "continued")
    assert chains["continued"] == traffic["carrying"], (chains, traffic)
    tasks = sum(traffic["tasks"].values())
    assert chains["started"] == traffic["chats"] - traffic["carrying"] + tasks, (chains, traffic)
    assert chains["side"] == 0, chains
    assert plugin["released_hit"] == 0, plugin
    # the sides' prompts differ only where a sampled answer did: what the plugin's prompts
    # held more may be computed, nothing else
    extra = max(0, plugin["prompt"] - vanilla["prompt"])
    assert plugin["computed"] <= vanilla["computed"] + extra, (plugin, vanilla)
