"""``MemoryStore``: encoded blobs in host RAM, bounded in bytes, evicted a whole chunk at a time.

The fastest tier of a :class:`~kvcodec.store.tiers.TieredStore`: a host that just wrote or loaded a
chunk finds it here next time without a disk or network read, and keeps finding it while a remote
store is down. It holds blobs as they are stored (0.75x of the raw KV), so a given amount of RAM holds
a third more tokens than a cache of raw KV. One process's memory: nothing survives it.

Eviction is :class:`~kvcodec.store.GroupLRU` over the caller's ``group_of`` (whole chunks, broken
prefixes first, manifests before their blobs), as in the directory store.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from ..format import MAX_PAYLOAD_LEN, ParsedBlob, as_bytes_view, parse
from .base import GroupRead, ReadBufferPool, StoreFullError, StoreOptions, check_max_bytes
from .counters import Counters
from .eviction import GroupLRU
from .index import SizeIndex
from .keys import validate_key
from .reading import check_max_blob

__all__ = ["MemoryStore"]


class MemoryStore:
    """A :class:`~kvcodec.store.BlobStore` in this process's memory, at most ``max_bytes`` of blobs."""

    partial_groups = False  # eviction removes whole groups

    def __init__(self, max_bytes: int, options: StoreOptions | None = None) -> None:
        check_max_bytes(max_bytes)
        if max_bytes is None:
            raise UnsupportedConfigError("a memory store needs max_bytes", reason=Reason.BAD_VALUE)
        opts = options if options is not None else StoreOptions()
        self.max_bytes = max_bytes
        self.location = f"memory ({max_bytes} bytes)"
        self._policy = GroupLRU(opts.group_of, first=opts.evict_first)
        self._blobs: dict[str, bytes] = {}
        self._index = SizeIndex()
        self._lock = threading.Lock()
        self._counters = Counters()
        self._closed = False

    # ------------------------------------------------------------ writes

    def put(self, key: str, blob: Any) -> None:
        """Store a copy of ``blob`` (it must parse as LMCKV); evicts whole groups to make room."""
        self.put_many([(key, blob)])

    def put_many(self, items: Sequence[tuple[str, Any]]) -> None:
        """``put`` each item in order; every key is checked before any is stored."""
        for key, _ in items:
            validate_key(key)
        self._check_open()
        for key, blob in items:
            data = self._checked_blob(key, blob)
            with self._lock:
                self._make_room(key, len(data))
                self._blobs[key] = data
                self._index.record(key, self._index.next_stamp(), len(data))
            self._counters.add(round_trips=1, bytes_written=len(data))

    def _checked_blob(self, key: str, blob: Any) -> bytes:
        try:
            data = bytes(parse(as_bytes_view(blob)).blob)
        except CorruptEncodedKVError as e:
            raise type(e)(
                f"refusing to store {key!r}: not a valid LMCKV blob: {e}", reason=e.reason
            ) from None
        if len(data) > self.max_bytes:
            raise StoreFullError(
                f"blob for {key!r} is {len(data)} bytes, larger than the memory tier's {self.max_bytes}",
                reason=Reason.STORE_FULL,
            )
        return data

    def _make_room(self, key: str, n: int) -> None:
        """Evict groups until ``n`` bytes under ``key`` fit (caller holds the lock)."""
        index = self._index
        while (short := index.total - index.size_of(key) + n - self.max_bytes) > 0:
            groups = self._policy.evict(short, (key,), index.entries)
            if not groups:
                raise StoreFullError(
                    f"no room for {key!r} ({n} bytes) in the memory tier: the rest is its own chunk prefix",
                    reason=Reason.STORE_FULL,
                )
            for members in groups:
                for victim in members:
                    self._drop(victim)

    def _drop(self, key: str) -> bool:
        self._index.forget(key)
        return self._blobs.pop(key, None) is not None

    # ------------------------------------------------------------ reads

    def get(self, key: str, *, max_bytes: int | None = None) -> memoryview:
        """The verified blob under ``key`` (a read-only view of the stored bytes)."""
        return self._read(validate_key(key), True, max_bytes).buffer

    def get_parsed(
        self,
        key: str,
        into: bytearray | None = None,
        *,
        verify_crc: bool = True,
        max_bytes: int | None = None,
    ) -> ParsedBlob:
        """The blob under ``key``, parsed once (its CRC checked unless ``verify_crc`` is False), as a
        read-only view of the stored bytes: no copy (``into`` unused). Stored blobs are immutable
        ``bytes``, so the view stays whole after the key is evicted or replaced."""
        return self._read(validate_key(key), verify_crc, max_bytes)

    def get_parsed_many(
        self,
        keys: Sequence[str],
        *,
        verify_crc: bool = True,
        max_bytes: int | None = None,
        buffers: ReadBufferPool | None = None,
    ) -> list[ParsedBlob]:
        """``get_parsed`` of each key, all or nothing: ``KeyError(key)`` for the first one missing
        (``buffers`` unused: the blobs are views of what is held)."""
        keys = [validate_key(k) for k in keys]
        self._check_open()
        with self._lock:
            missing = next((k for k in keys if k not in self._blobs), None)
        if missing is not None:
            self._counters.add(round_trips=1, misses=1)
            raise KeyError(missing)
        return [self.get_parsed(k, verify_crc=verify_crc, max_bytes=max_bytes) for k in keys]

    def _read(self, key: str, verify_crc: bool, max_bytes: Any) -> ParsedBlob:
        self._check_open()
        with self._lock:
            data = self._blobs.get(key)
            if data is not None:
                self._index.record(key, self._index.next_stamp(), len(data))
        if data is None:
            self._counters.add(round_trips=1, misses=1)
            raise KeyError(key)
        try:
            check_max_blob(max_bytes, len(data), MAX_PAYLOAD_LEN)
            parsed = parse(memoryview(data), verify_crc=verify_crc, remember=False)
        except CorruptEncodedKVError:
            self.delete(key)
            self._counters.add(round_trips=1, errors=1)
            raise
        self._counters.hit(len(data))
        return parsed

    # ------------------------------------------------------------ the rest

    def read_ahead(self, reads: Sequence[GroupRead]) -> None:
        """Ignored: its reads wait on nothing (:meth:`~kvcodec.store.BlobStore.read_ahead`)."""

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        keys = [validate_key(k) for k in keys]
        self._check_open()
        with self._lock:
            return [k in self._blobs for k in keys]

    def delete(self, key: str) -> bool:
        validate_key(key)
        self._check_open()
        with self._lock:
            return self._drop(key)

    def keys(self) -> list[str]:
        self._check_open()
        with self._lock:
            return sorted(self._blobs)

    def iter_keys(self) -> Iterator[str]:
        yield from self.keys()

    @property
    def total_bytes(self) -> int:
        """Bytes of blobs held now (at most ``max_bytes``)."""
        return self._index.total

    def stats(self) -> dict[str, float]:
        return self._counters.snapshot()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._blobs.clear()
            self._index = SizeIndex()

    def _check_open(self) -> None:
        if self._closed:
            raise UnsupportedConfigError("the memory store is closed", reason=Reason.UNSUPPORTED)
