"""The directory store's evictor: removes what its eviction policy offers until a put fits.

The policy (``eviction.py``) picks groups from the index; the evictor removes
their files, each only if it is still the file the index describes: a group
whose file another process used or rewrote since the scan is kept (and re-stamped
as recent), and each victim is renamed aside and compared before it is unlinked.
"""

from __future__ import annotations

import stat
from collections.abc import Callable

from ..errors import Reason
from .base import StoreFullError
from .eviction import EvictionPolicy
from .files import lstat, remove_exact
from .index import SizeIndex

__all__ = ["Evictor"]


class Evictor:
    """Makes room under ``max_bytes`` in the store at ``root`` (callers hold the store's lock)."""

    def __init__(
        self, root: str, index: SizeIndex, policy: EvictionPolicy, path: Callable[[str], str]
    ) -> None:
        self.root = root
        self.index = index
        self.policy = policy
        self.path = path

    def make_room(self, key: str, n: int, max_bytes: int) -> None:
        """Evict until ``n`` bytes under ``key`` fit; :class:`StoreFullError` when the policy runs out."""
        index = self.index
        for _ in range(len(index) + 1):  # each round removes a group or re-stamps one it kept
            short = index.total - index.size_of(key) + n - max_bytes
            if short <= 0:
                return
            groups = self.policy.evict(short, (key,), index.entries)
            if not groups:
                break
            for members in groups:
                self.evict(members)
                if index.total - index.size_of(key) + n <= max_bytes:
                    return
        raise StoreFullError(
            f"no room for {key!r} ({n} bytes) under max_bytes={max_bytes}: the rest is its own chunk "
            f"prefix ({index.total} bytes); a store must hold a prompt's leading chunks before later ones",
            reason=Reason.STORE_FULL,
        )

    def evict(self, members: list[str]) -> bool:
        """Remove a group's files unless one was used since the scan; whether they were removed."""
        examined = []
        for victim in members:
            entry = self.index.get(victim)
            st = lstat(self.path(victim))
            if entry is None or st is None or not stat.S_ISREG(st.st_mode):
                self.index.forget(victim)  # gone, or no longer a blob: not ours to remove
                continue
            if st.st_mtime_ns > entry.disk:  # what we last wrote or saw there, not our in-memory recency
                # Another process used or rewrote part of the group since our scan: it is recent.
                self.restamp(members, st.st_mtime_ns)
                return False
            examined.append((victim, st))
        for victim, st in examined:
            remove_exact(self.root, self.path(victim), st)
            self.index.forget(victim)
        return True

    def restamp(self, members: list[str], used: int) -> None:
        """Make a kept group's files recent: as of ``used`` (the mtime that showed another process's
        use), their own mtime or their in-memory stamp, whichever is latest; each one's ``disk`` its mtime."""
        for k in members:
            cur = lstat(self.path(k))
            if cur is not None and stat.S_ISREG(cur.st_mode):
                old = self.index.get(k)
                stamp = max(cur.st_mtime_ns, used, old.stamp if old is not None else 0)
                self.index.record(k, stamp, cur.st_size, cur.st_mtime_ns)
