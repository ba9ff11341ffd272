"""The size/recency index of a directory store: per key its size, its recency stamp and its file's mtime.

Recency is a wall-clock ns stamp. ``put`` writes it to the file's mtime; a read
writes it only when the file's mtime is at least :data:`RECENCY_PERSIST_S` older
(a ``utime`` per read costs more than the rest of the store's work on it), so
another process, or a reopened store, rebuilds the same order from the
directory to within that limit, while this instance's order is exact. Each
entry also keeps the mtime its file had when last written or seen (``disk``):
the evictor's "another process used it since" test compares against that, and
a rescan keeps the in-memory stamp of a file whose mtime has not moved. The
index is one instance's view: blobs another process wrote since the last scan
are not in it. Not thread-safe by itself: the store calls it under its lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping

__all__ = ["RECENCY_PERSIST_S", "Entry", "SizeIndex"]

RECENCY_PERSIST_S = 10.0
"""A read persists its recency to the file's mtime only when that mtime is at least this many
seconds older: after a restart, or for another process sharing the directory, a blob's recency is
known to within this limit (in memory it is exact)."""


class Entry:
    """Size, recency stamp (ns) and the file's mtime last written or seen (``disk``, ns) of one blob."""

    __slots__ = ("disk", "size", "stamp")

    def __init__(self, stamp: int, size: int, disk: int | None = None) -> None:
        self.stamp = stamp
        self.size = size
        self.disk = stamp if disk is None else disk

    def __repr__(self) -> str:
        return f"Entry(stamp={self.stamp}, size={self.size}, disk={self.disk})"


class SizeIndex:
    """Key -> :class:`Entry`, least recent first, with the running total of sizes."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self.total = 0
        self.last_scan = 0.0
        """``time.monotonic()`` of the last :meth:`rebuild` (0: never)."""
        self._last_stamp = 0

    @property
    def entries(self) -> Mapping[str, Entry]:
        """The entries, least recent first (a live view: do not hold it across changes)."""
        return self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def size_of(self, key: str) -> int:
        """The indexed size of ``key`` (0 if absent)."""
        e = self._entries.get(key)
        return e.size if e is not None else 0

    def next_stamp(self) -> int:
        """A wall-clock ns stamp strictly later than every one given or seen before."""
        t = time.time_ns()
        if t <= self._last_stamp:
            t = self._last_stamp + 1
        self._last_stamp = t
        return t

    def record(self, key: str, stamp: int, size: int, disk: int | None = None) -> None:
        """Set ``key``'s entry and make it the most recent; ``disk``: its file's mtime (default ``stamp``).

        An existing entry is updated in place (a read of a known key allocates nothing)."""
        e = self._entries.get(key)
        if e is None:
            self._entries[key] = Entry(stamp, size, disk)
        else:
            self._entries.move_to_end(key)
            self.total -= e.size
            e.stamp, e.size, e.disk = stamp, size, stamp if disk is None else disk
        self.total += size

    def forget(self, key: str) -> None:
        """Drop ``key``'s entry, if any."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.total -= old.size

    def rebuild(self, found: Iterable[tuple[int, str, int]]) -> None:
        """Replace the entries with ``(mtime_ns, key, size)`` of a directory scan.

        A file whose mtime is still the one its entry saw keeps the entry's stamp (reads since then
        that were not persisted, see :data:`RECENCY_PERSIST_S`); any other is as recent as its mtime."""
        old = self._entries
        rows = []
        for mt, name, size in found:
            e = old.get(name)
            rows.append((max(e.stamp, mt) if e is not None and e.disk == mt else mt, name, size, mt))
        rows.sort()
        self._entries = OrderedDict((name, Entry(st, size, mt)) for st, name, size, mt in rows)
        self.total = sum(row[2] for row in rows)
        if rows:
            self._last_stamp = max(self._last_stamp, rows[-1][0])
        self.last_scan = time.monotonic()
