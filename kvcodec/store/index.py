"""The size/recency index of a directory store: per key its size and its recency stamp.

Recency is the file's mtime in ns (``put`` and reads set it), so another
process, or a reopened store, rebuilds the same order from the directory. The
index is one instance's view: blobs another process wrote since the last scan
are not in it. Not thread-safe by itself: the store calls it under its lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping

__all__ = ["Entry", "SizeIndex"]


class Entry:
    """Size and recency stamp (the file's mtime in ns) of one stored blob."""

    __slots__ = ("size", "stamp")

    def __init__(self, stamp: int, size: int) -> None:
        self.stamp = stamp
        self.size = size

    def __repr__(self) -> str:
        return f"Entry(stamp={self.stamp}, size={self.size})"


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

    def record(self, key: str, stamp: int, size: int) -> None:
        """Set ``key``'s entry and make it the most recent."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.total -= old.size
        self._entries[key] = Entry(stamp, size)
        self.total += size

    def forget(self, key: str) -> None:
        """Drop ``key``'s entry, if any."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.total -= old.size

    def rebuild(self, found: Iterable[tuple[int, str, int]]) -> None:
        """Replace the entries with ``(mtime_ns, key, size)`` of a directory scan."""
        ordered = sorted(found)
        self._entries = OrderedDict((name, Entry(mt, size)) for mt, name, size in ordered)
        self.total = sum(size for _, _, size in ordered)
        if ordered:
            self._last_stamp = max(self._last_stamp, ordered[-1][0])
        self.last_scan = time.monotonic()
