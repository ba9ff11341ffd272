"""Eviction policies of a size-capped store: which groups of keys to remove to make room.

A policy is asked ``evict(n_bytes, protected, entries)``: the groups to remove,
in order, whose sizes add up to at least ``n_bytes`` (all it can offer when that
is less), never one that holds or precedes a ``protected`` key. The store
removes them (it may find one used meanwhile and keep it) and asks again when it
is still short; when the policy offers nothing more, the put is refused.

:class:`GroupLRU` groups keys with a ``group_of`` callable (the connector passes
:func:`kvcodec.integrations.vllm.chunk_keys.group_of`: every blob of a chunk is
one group, chained to its predecessor in the prompt). Without one every key is a
group of its own and the policy is plain LRU. The store never parses keys.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .base import GroupOf
from .index import Entry

__all__ = ["EvictionPolicy", "GroupLRU", "own_group"]


def own_group(key: str) -> tuple[str, int, str | None]:
    """The default ``group_of``: every key is a group of its own, at depth 0, without predecessor."""
    return key, 0, None


@runtime_checkable
class EvictionPolicy(Protocol):
    """Chooses what a capped store removes (see the module docstring)."""

    def evict(
        self, n_bytes: int, protected: Collection[str], entries: Mapping[str, Entry]
    ) -> list[list[str]]:
        """Groups of keys to remove, in order: at least ``n_bytes`` of them, or all that may go."""
        ...


@dataclass
class _Group:
    members: list[str] = field(default_factory=list)
    stamp: int = 0
    size: int = 0
    depth: int = 0
    parent: str | None = None
    children: int = 0


class GroupLRU:
    """Whole groups, prefix-aware: broken prefixes first, then leaves least recently used first.

    First the groups whose predecessor chain is broken (a predecessor is gone:
    they can never be hit), deepest first; then leaves (no successor present),
    the least recently used first and the deepest first among equals, so a
    prefix loses its last groups before its first; a leaf's predecessor becomes
    a leaf once it is offered. A protected key's group and its predecessors are
    never offered, and when a protected key's own prefix is broken only broken
    groups are (a group that cannot be hit never displaces one that can).

    ``first(key)``: members offered before the rest of their group (the
    connector's manifests, so that no lookup sees a manifest whose blobs are
    going); the rest follow in key order.
    """

    def __init__(
        self, group_of: GroupOf | None = None, *, first: Callable[[str], bool] | None = None
    ) -> None:
        self.group_of: GroupOf = group_of if group_of is not None else own_group
        self.first = first

    def __repr__(self) -> str:
        return f"GroupLRU(group_of={getattr(self.group_of, '__qualname__', self.group_of)})"

    def evict(
        self, n_bytes: int, protected: Collection[str], entries: Mapping[str, Entry]
    ) -> list[list[str]]:
        """Groups to remove, in order, until ``n_bytes`` are offered (all that may go when fewer)."""
        out: list[list[str]] = []
        offered = 0
        for members, size in self._order(protected, entries):
            if offered >= n_bytes:
                break
            out.append(members)
            offered += size
        return out

    def _groups(self, entries: Mapping[str, Entry]) -> dict[str, _Group]:
        groups: dict[str, _Group] = {}
        for k, e in entries.items():
            gid, depth, parent = self.group_of(k)
            g = groups.setdefault(gid, _Group(depth=depth, parent=parent))
            g.members.append(k)
            g.stamp = max(g.stamp, e.stamp)
            g.size += e.size
            g.parent = g.parent or parent
        return groups

    def _protect(self, protected: Collection[str], groups: dict[str, _Group]) -> tuple[set[str], list[str]]:
        """The protected keys' groups with their predecessors; and the protected keys' parents."""
        closed: set[str] = set()
        parents: list[str] = []
        for key in protected:
            gid, _, parent = self.group_of(key)
            closed.add(gid)
            if parent is not None:
                parents.append(parent)
            while parent is not None and parent not in closed:
                closed.add(parent)
                parent = groups[parent].parent if parent in groups else None
        return closed, parents

    def _order(
        self, protected: Collection[str], entries: Mapping[str, Entry]
    ) -> Iterator[tuple[list[str], int]]:
        groups = self._groups(entries)
        closed, parents = self._protect(protected, groups)
        rooted = _Rooted(groups)
        broken_ids = {g for g in groups if not rooted(g)}
        for gid, g in groups.items():
            if g.parent in groups and gid not in broken_ids:
                groups[g.parent].children += 1
        for gid in sorted(broken_ids, key=lambda g: (-groups[g].depth, groups[g].stamp)):
            if gid not in closed:
                yield self._ordered(groups[gid].members), groups[gid].size
        if any(not rooted(p) for p in parents):
            return  # a group that cannot be hit (its predecessor is gone) never displaces one that can
        heap = [
            (g.stamp, -g.depth, gid) for gid, g in groups.items() if gid not in broken_ids and not g.children
        ]
        heapq.heapify(heap)
        while heap:
            _, _, gid = heapq.heappop(heap)
            if gid in closed:
                continue
            g = groups[gid]
            yield self._ordered(g.members), g.size
            p = groups.get(g.parent) if g.parent is not None else None
            if p is not None:
                p.children -= 1
                if p.children == 0:
                    heapq.heappush(heap, (p.stamp, -p.depth, g.parent))

    def _ordered(self, members: list[str]) -> list[str]:
        first = self.first
        if first is None:
            return sorted(members)
        return sorted(members, key=lambda k: (not first(k), k))


class _Rooted:
    """Whether every predecessor of a group is present (memoised; a cycle counts as broken)."""

    def __init__(self, groups: Mapping[str, _Group]) -> None:
        self._groups = groups
        self._memo: dict[str, bool] = {}

    def __call__(self, gid: str) -> bool:
        seen: dict[str, None] = {}
        g = gid
        while True:
            if g in self._memo:
                ok = self._memo[g]
                break
            grp = self._groups.get(g)
            if grp is None or g in seen:  # absent, or a cycle a foreign group_of made: never rooted
                ok = False
                break
            seen[g] = None
            if grp.parent is None:
                ok = True
                break
            g = grp.parent
        for x in seen:
            self._memo[x] = ok
        return ok
