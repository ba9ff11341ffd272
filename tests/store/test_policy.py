"""GroupLRU, the eviction policy, on its own: plain LRU without group_of, whole groups and the prefix
rules with the connector's group_of, protected keys, a member order, and a foreign group_of's cycle."""

from __future__ import annotations

from kvcodec.integrations.vllm.chunk_keys import group_of
from kvcodec.store import EvictionPolicy, GroupLRU
from kvcodec.store.eviction import own_group
from kvcodec.store.index import Entry
from tests.store.contract import chunk_blob_keys


def entries(*keys: str, size: int = 10) -> dict[str, Entry]:
    """Entries in the given order, least recent first."""
    return {k: Entry(stamp=i + 1, size=size) for i, k in enumerate(keys)}


def test_without_group_of_it_is_plain_lru() -> None:
    policy = GroupLRU()
    assert isinstance(policy, EvictionPolicy) and policy.group_of is own_group
    idx = entries("a", "b-C1-Hx-Py", "c")
    assert policy.evict(10, ("new",), idx) == [["a"]]
    assert policy.evict(25, ("new",), idx) == [["a"], ["b-C1-Hx-Py"], ["c"]]
    assert policy.evict(100, ("a",), idx) == [["b-C1-Hx-Py"], ["c"]]  # a protected key never goes
    assert policy.evict(0, ("new",), idx) == []


def test_with_group_of_whole_chunks_go_last_chunk_first() -> None:
    c0, c1 = chunk_blob_keys(2, 0), chunk_blob_keys(2, 1)
    idx = entries(*c0, *c1)
    policy = GroupLRU(group_of)
    groups = policy.evict(1, ("other",), idx)
    assert groups == [sorted(c1)]  # the leaf, although chunk 0 is older
    assert policy.evict(10_000, ("other",), idx) == [sorted(c1), sorted(c0)]
    assert policy.evict(10_000, (c1[0],), idx) == []  # its own chunk and its predecessor are protected


def test_a_broken_prefix_goes_first_and_displaces_only_its_like() -> None:
    c0, c1, c2 = (chunk_blob_keys(1, c) for c in range(3))
    idx = entries(*c0, *c2)  # chunk 1 is gone: chunk 2 cannot be hit
    policy = GroupLRU(group_of)
    assert policy.evict(1, ("other",), idx) == [sorted(c2)]
    assert policy.evict(10_000, (c2[0],), entries(*c0, *c2)) == []
    assert policy.evict(10_000, (c1[0],), idx) == [sorted(c2)]  # chunk 1's predecessor stays
    assert policy.evict(10_000, ("other",), idx) == [sorted(c2), sorted(c0)]


def test_first_orders_members() -> None:
    keys = chunk_blob_keys(2, 0)
    manifest = keys[-1]
    policy = GroupLRU(group_of, first=lambda k: k == manifest)
    (group,) = policy.evict(1, ("other",), entries(*keys))
    assert group[0] == manifest and sorted(group[1:]) == group[1:]


def test_a_cycle_in_a_foreign_group_of_ends() -> None:
    def cyclic(key: str) -> tuple[str, int, str | None]:
        return key, 1, {"a": "b", "b": "a"}.get(key)

    policy = GroupLRU(cyclic)
    assert policy.evict(100, ("z",), entries("a", "b", "c")) == [["a"], ["b"], ["c"]]  # a, b: never rooted
