"""Principals and scoped session names (pure core)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vllm_affinity.core import SessionBlocks
from vllm_affinity.core.tenants import (
    ANONYMOUS,
    UNSCOPED,
    key_principal,
    scoped,
    tenant_principal,
)

principals = st.one_of(
    st.just(ANONYMOUS),
    st.text(min_size=1, max_size=8).map(key_principal),
    st.text(min_size=1, max_size=8).map(tenant_principal),
)
names = st.text(min_size=1, max_size=40)


@given(principals, names, principals, names)
def test_scoped_names_never_collide_across_principals(p1: str, s1: str, p2: str, s2: str) -> None:
    assert (scoped(p1, s1) == scoped(p2, s2)) == ((p1, s1) == (p2, s2))


def test_a_single_tenant_server_keeps_names_as_they_are() -> None:
    assert scoped(UNSCOPED, "session-1") == "session-1"


def test_keys_and_tenants_are_digests_not_secrets() -> None:
    principal = key_principal("sk-secret")
    assert "sk-secret" not in principal and len(principal) == 24
    assert key_principal("x") != tenant_principal("x")


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.sampled_from("st"), st.integers(0, 3)),
        max_size=30,
    )
)
def test_one_principals_releases_never_touch_the_others_holds(
    operations: list[tuple[str, str, int]],
) -> None:
    """Two principals using the same session names on disjoint blocks: whatever one records
    or releases, the other's holds stay as they were."""
    table = SessionBlocks()
    principal = {"a": key_principal("A"), "b": key_principal("B")}
    base = {"a": 0, "b": 100}
    for who, session, first in operations:
        other = "b" if who == "a" else "a"
        held_before = {b: table.holders(b) for b in range(base[other], base[other] + 10)}
        name = scoped(principal[who], session)
        if first == 0:
            table.record(name, [base[who] + i for i in range(4)], 128, f"{who}{session}")
            table.request_finished(name, f"{who}{session}")
        else:
            table.select_release(name, first)
        assert {b: table.holders(b) for b in held_before} == held_before
