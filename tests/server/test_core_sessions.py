"""Session binding (pure core) and the token/block math."""

from __future__ import annotations

from vllm_affinity.core import SessionBlocks, common_prefix_length


def table_with(*sessions: tuple[str, list[int]]) -> SessionBlocks:
    table = SessionBlocks()
    for session, blocks in sessions:
        table.bind(session, blocks)
        table.record(session, blocks, num_prompt_tokens=len(blocks) * 32)
    return table


def test_release_returns_blocks_from_the_index_on() -> None:
    table = table_with(("a", [10, 11, 12, 13]))
    selection = table.select_release("a", 2)
    assert selection.block_ids == [12, 13]
    assert selection.status == "ok"


def test_shared_blocks_are_kept_until_the_last_user_releases() -> None:
    table = table_with(("a", [1, 2, 3]), ("b", [1, 2, 4]))
    first = table.select_release("a", 0)
    assert first.block_ids == [3] and first.kept_shared == 2
    second = table.select_release("b", 0)
    assert second.block_ids == [1, 2, 4]
    assert table.select_release("a", 0).block_ids == []  # a repeated release frees nothing
    assert table.select_release("b", 0).block_ids == []


def test_reused_block_is_not_released_by_its_old_session() -> None:
    table = table_with(("a", [1, 2]))
    table.unbind([2])  # block 2 reused for another request's new content
    table.bind("c", [2])
    assert table.select_release("a", 0).block_ids == [1]
    assert table.owners[2] == {"c"}


def test_unknown_session() -> None:
    table = table_with(("a", [1, 2]))
    assert table.select_release("zzz", 0).status == "unknown_session"
    assert table.select_release("a", 0).block_ids == [1, 2]


def test_session_table_is_bounded() -> None:
    table = SessionBlocks(max_sessions=2)
    for s in "abc":
        table.record(s, [1], 1)
    assert list(table.latest) == ["b", "c"]


def test_token_math() -> None:
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
