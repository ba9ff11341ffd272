"""DirectoryStore: a crash-safe, size-bounded directory of LMCKV blobs (the embedded BlobStore).

One file per key under one directory. Writes are atomic and durable (unique
temp file, fsync, ``os.replace``, fsync of the directory), so a crash never
leaves a final-named file with partial data. Reads check the file's size
against what its header declares before reading it (``reading.py``), then
``mmap`` the file copy-on-write (``get``) or read it into private memory
(``get_parsed``: one read, one parse, CRC included) and verify it with
:func:`kvcodec.format.parse` before handing it out, so damaged files are
refused (and quarantined), never returned.

It composes the package's parts: key rules (``keys.py``), POSIX file
primitives (``files.py``), the size/recency index (``index.py``), an eviction
policy (``eviction.py``), quarantine (``quarantine.py``) and crash recovery
(``recovery.py``).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

from ..errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from ..format import Hashes, ParsedBlob, as_bytes_view, parse
from .base import GroupOf, GroupRead, ReadBufferPool, StoreFullError, StoreOptions, check_max_bytes
from .counters import Counters
from .eviction import EvictionPolicy, GroupLRU
from .evictor import Evictor
from .files import create_temp, fsync_dir, lstat, open_regular, set_mtime, write_all
from .index import RECENCY_PERSIST_S, SizeIndex
from .keys import MAX_KEY_LEN, InvalidKeyError, model_key, validate_key
from .quarantine import QUARANTINE_DIRNAME, Quarantine
from .reading import load_blob
from .recovery import iter_blob_names, scan

__all__ = ["MAX_KEY_LEN", "QUARANTINE_DIRNAME", "DirectoryStore", "InvalidKeyError", "validate_key"]


class DirectoryStore:
    """Key → LMCKV blob store in one directory, with atomic writes and grouped LRU eviction.

    Layout: ``root/<key>`` holds a blob; ``root/.tmp.<pid>.<tid>.<random>`` are
    writes in progress; ``root/.quarantine/`` receives files that failed
    verification. Keys never start with a dot, so neither is ever listed. A
    store serves only regular files directly inside its root: names are opened
    with ``O_NOFOLLOW`` and checked with ``fstat``, so a symlink, FIFO, socket or
    folder under a key's name is a miss, never followed and never an ``OSError``.

    Guarantees:

    * ``put`` writes a uniquely named temp file (``O_EXCL``), fsyncs it,
      ``os.replace``-s it onto the key and fsyncs the directory (``fsync=True``).
      Readers and a crash at any point see either the old blob or the new one,
      complete; concurrent writers of a key (threads or processes) leave exactly
      one of the written blobs (last rename wins).
    * Every read first checks that the file is exactly header + payload as its
      header declares (``SIZE_MISMATCH`` when longer, the parser's truncation
      reasons when shorter) without reading the rest, so a sparse or lying file
      costs a few KiB. ``get`` maps the file with ``mmap.ACCESS_COPY`` (the view
      is writable, writes never reach the file) and, with ``verify=True``,
      checks its CRC. A damaged file raises :class:`CorruptEncodedKVError` with
      the parser's reason (``CRC_MISMATCH``, ...), naming key and file, and is
      moved to ``.quarantine/`` (deleted if ``quarantine=False``).
    * Temp files left by crashed writers are removed when the directory is
      scanned (on open, ``refresh``, ``keys``): only those whose writer no longer
      holds the file's ``flock`` and whose pid is dead or that are older than
      ``stale_temp_s``.

    Size bound and its limits: the index (size and recency per key) is rebuilt
    from the directory on open, ``refresh()`` and ``keys()``. Recency is kept in
    the file's mtime: ``put`` sets it, a read only when it is ``RECENCY_PERSIST_S``
    (10 s) old, so another process or a reopened store rebuilds the same order to
    within that (this instance's is exact). With ``max_bytes``, ``put`` asks the
    eviction policy for groups to remove until the new total fits, rescanning
    first when the index is older than ``rescan_interval_s`` (0 rescans on every
    bounded ``put``). Blobs other processes wrote since the last scan are not counted,
    so the directory can exceed ``max_bytes`` by what they wrote in between.

    Eviction: ``eviction`` (an :class:`~kvcodec.store.eviction.EvictionPolicy`),
    or :class:`~kvcodec.store.eviction.GroupLRU` over ``group_of`` (the
    connector passes its chunk grammar's; without one every key is its own
    group: plain LRU). Whole groups go, so ``partial_groups`` is False. A put
    that the policy cannot make room for raises :class:`StoreFullError`.
    Eviction removes exactly the file it examined: the victim is renamed aside
    and compared (inode, size, mtime) before it is unlinked; a blob put or read
    by another process in between is linked back under its name. Quarantined
    files are neither counted nor evicted.

    POSIX only in spirit (Windows cannot replace a mapped file). Never modify
    stored files in place: a file truncated under a live mapping raises SIGBUS
    on access. Open a new store in a forked child rather than reusing the
    parent's instance. I/O failures (disk full, permissions) propagate as ``OSError``.
    """

    partial_groups = False
    """Eviction removes whole groups: a chunk's manifest stands for all its blobs."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        verify: bool = True,
        fsync: bool = True,
        quarantine: bool = True,
        rescan_interval_s: float = 5.0,
        stale_temp_s: float = 60.0,
        group_of: GroupOf | None = None,
        eviction: EvictionPolicy | None = None,
    ) -> None:
        check_max_bytes(max_bytes)
        if eviction is not None and group_of is not None:
            raise UnsupportedConfigError(
                "pass group_of or an eviction policy, not both", reason=Reason.BAD_VALUE
            )
        self._root = os.path.abspath(os.fspath(root))
        self._prefix = os.path.join(self._root, "")
        self._persist_ns = int(RECENCY_PERSIST_S * 1e9)
        self._max_bytes = max_bytes
        self._verify = bool(verify)
        self._fsync = bool(fsync)
        self._rescan_interval_s = float(rescan_interval_s)
        self._stale_temp_s = float(stale_temp_s)
        self._policy: EvictionPolicy = eviction if eviction is not None else GroupLRU(group_of)
        self._quarantine = Quarantine(self._root, enabled=bool(quarantine), fsync=self._fsync)
        self._lock = threading.RLock()
        self._index = SizeIndex()
        self._evictor = Evictor(self._root, self._index, self._policy, self._path)
        self._counters = Counters()
        self._closed = False
        os.makedirs(self._root, exist_ok=True)
        self._quarantine.prepare()
        self.refresh()

    @classmethod
    def from_options(cls, root: str | os.PathLike[str], options: StoreOptions) -> DirectoryStore:
        """A store at ``root`` configured by :class:`~kvcodec.store.StoreOptions` (``open_store``'s way)."""
        return cls(
            root,
            max_bytes=options.max_bytes,
            verify=options.verify_blobs,
            fsync=options.fsync,
            eviction=GroupLRU(options.group_of, first=options.evict_first),
        )

    @staticmethod
    def make_key(
        hashes: Hashes | Mapping[str, str | None], layer_id: int, chunk_id: int, *, chunk_hash: str = ""
    ) -> str:
        """Stable key ``"<model16>-L<layer>-C<chunk>[-H<chunk_hash>]"`` (see :func:`~kvcodec.store.keys.model_key`)."""
        return model_key(hashes, layer_id, chunk_id, chunk_hash=chunk_hash)

    # ------------------------------------------------------------ properties

    @property
    def root(self) -> str:
        """Absolute path of the store directory."""
        return self._root

    @property
    def location(self) -> str:
        """Where the blobs live, for logs: the root path."""
        return self._root

    @property
    def quarantine_dir(self) -> str:
        """Where corrupt files are moved (``root/.quarantine``)."""
        return self._quarantine.dir

    @property
    def max_bytes(self) -> int | None:
        """Size bound in bytes, or None for unbounded."""
        return self._max_bytes

    @property
    def eviction(self) -> EvictionPolicy:
        """The policy that picks what a full store removes."""
        return self._evictor.policy

    @property
    def total_bytes(self) -> int:
        """Bytes of all blobs in this instance's index (see the class docstring's limits)."""
        with self._lock:
            return self._index.total

    # ------------------------------------------------------------ writes

    def put(self, key: str, blob: Any) -> None:
        """Store ``blob`` (any bytes-like buffer) under ``key``, atomically and durably.

        With ``verify=True`` the blob must parse as LMCKV (else
        :class:`CorruptEncodedKVError` with the parser's reason); trailing bytes
        after a v1 payload are dropped. A blob larger than ``max_bytes``, or one
        the eviction policy cannot make room for, raises :class:`StoreFullError`.
        """
        validate_key(key)
        self._check_open()
        data = self._checked_blob(key, blob)
        n = len(data)
        path = self._path(key)
        fd, tmp = create_temp(self._root)
        tmp_pending = True
        try:
            write_all(fd, data)
            if self._fsync:
                os.fsync(fd)
            with self._lock:
                self._make_room(key, n)
                stamp = self._index.next_stamp()
                set_mtime(fd, stamp)  # a filesystem refusing explicit times: recency stays in memory
                os.replace(tmp, path)
                tmp_pending = False
                self._index.record(key, stamp, n)
        finally:
            if tmp_pending:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            os.close(fd)  # releases the flock only after the rename
        if self._fsync:
            fsync_dir(self._root)
        self._counters.add(round_trips=1, bytes_written=n)

    def put_many(self, items: Sequence[tuple[str, Any]]) -> None:
        """``put`` each ``(key, blob)`` in order (every key checked first); each item atomic on its own."""
        for key, _ in items:
            validate_key(key)
        for key, blob in items:
            self.put(key, blob)

    def _checked_blob(self, key: str, blob: Any) -> memoryview:
        data = as_bytes_view(blob)
        if self._verify:
            try:
                data = parse(data).blob
            except CorruptEncodedKVError as e:
                raise type(e)(
                    f"refusing to store {key!r}: not a valid LMCKV blob: {e}", reason=e.reason
                ) from None
        if len(data) == 0:
            raise UnsupportedConfigError(
                f"refusing to store an empty blob under {key!r}", reason=Reason.BAD_VALUE
            )
        if self._max_bytes is not None and len(data) > self._max_bytes:
            raise StoreFullError(
                f"blob for {key!r} is {len(data)} bytes, larger than the store's max_bytes={self._max_bytes}",
                reason=Reason.STORE_FULL,
            )
        return data

    # ------------------------------------------------------------ reads

    def get(self, key: str, *, max_bytes: int | None = None) -> memoryview:
        """The blob under ``key``: a writable, copy-on-write memoryview over an mmap of its file.

        Raises :class:`KeyError` if no regular file holds ``key`` (a symlink or
        other special file under its name is never followed) and
        :class:`CorruptEncodedKVError` (after quarantining the file) if it is
        damaged. With ``verify=False`` only the CRC is skipped; the header and
        the file's size are still checked. ``max_bytes``: the largest blob the caller accepts (a
        longer file is damage, refused before it is read).
        """
        validate_key(key)
        self._check_open()
        return self._get(key, False, max_bytes=max_bytes).blob

    def get_parsed(
        self,
        key: str,
        into: bytearray | None = None,
        *,
        verify_crc: bool = True,
        max_bytes: int | None = None,
    ) -> ParsedBlob:
        """The blob under ``key`` read into memory and parsed once, its CRC verified (whatever ``verify``).

        For a reader that decodes the blob at once (the vLLM connector's loads):
        :func:`~kvcodec.decode` takes the :class:`~kvcodec.format.ParsedBlob` as
        it is. The file's size is checked against its header first, then it is
        read with one ``read`` into a private, writable ``bytearray``. Misses and
        damage are reported as by :meth:`get`.

        ``into``: read into this buffer when it is large enough (the blob then
        views it: the caller must not reuse it while the blob is in use),
        sparing a fresh allocation and its page faults per read.

        ``verify_crc=False``: every check but the CRC, for a caller that checks it itself in its
        own pass over the payload (the connector's C scatter) and removes the blob when it fails;
        its header is then not remembered by the parse memo.
        """
        validate_key(key)
        self._check_open()
        return self._get(key, True, into, verify_crc, max_bytes)

    def get_parsed_many(
        self,
        keys: Sequence[str],
        *,
        verify_crc: bool = True,
        max_bytes: int | None = None,
        buffers: ReadBufferPool | None = None,
    ) -> list[ParsedBlob]:
        """``get_parsed`` of each key, all or nothing: ``KeyError(key)`` if any one is missing (checked
        before any is read), a damaged one's :class:`CorruptEncodedKVError` after quarantining it
        (``verify_crc`` and ``max_bytes`` as for :meth:`get_parsed`; ``buffers`` unused: each blob is
        mapped or read on its own)."""
        keys = [validate_key(k) for k in keys]
        self._check_open()
        for k in keys:
            if not self._is_blob(k):
                self._counters.add(round_trips=1, misses=1)
                raise KeyError(k)
        return [self._get(k, True, None, verify_crc, max_bytes) for k in keys]

    def read_ahead(self, reads: Sequence[GroupRead]) -> None:
        """Ignored: a local read waits on nothing another core could do first (:meth:`~kvcodec.store.BlobStore.read_ahead`)."""

    def contains(self, key: str) -> bool:
        """Whether a regular file exists for ``key`` (not verified: ``get`` may still find it corrupt).

        Agrees with ``keys()`` and ``get``: a symlink under the key's name is not a blob.
        """
        validate_key(key)
        self._check_open()
        self._counters.add(round_trips=1)
        return self._is_blob(key)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` of each key, in order."""
        keys = [validate_key(k) for k in keys]
        self._check_open()
        self._counters.add(round_trips=len(keys))
        return [self._is_blob(k) for k in keys]

    def __contains__(self, key: object) -> bool:
        return self.contains(key)  # type: ignore[arg-type]

    # ------------------------------------------------------------ listing, removal

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if a file was removed."""
        validate_key(key)
        self._check_open()
        with self._lock:
            try:
                os.unlink(self._path(key))
                removed = True
            except FileNotFoundError:
                removed = False
            self._index.forget(key)
        if removed and self._fsync:
            fsync_dir(self._root)
        self._counters.add(round_trips=1)
        return removed

    def keys(self) -> list[str]:
        """Sorted keys present in the directory (rescans it, so other processes' writes show)."""
        self._check_open()
        with self._lock:
            self._scan_locked()
            return sorted(self._index.entries)

    def iter_keys(self) -> Iterator[str]:
        """Keys present in the directory, in directory order, listed lazily (no index rebuild)."""
        self._check_open()
        return iter_blob_names(self._root)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def refresh(self) -> None:
        """Rebuild the index (sizes, LRU order from mtimes) from the directory; drop dead temps."""
        self._check_open()
        with self._lock:
            self._scan_locked()

    def stats(self) -> dict[str, float]:
        """Cumulative counters (the keys of STORE_COUNTERS): each file operation is a round trip; hits,
        misses and bytes_read count reads; errors count damaged blobs; timeouts stay 0."""
        return self._counters.snapshot()

    def close(self) -> None:
        """Mark the store closed. Views returned by ``get`` stay valid (they own their maps)."""
        self._closed = True

    def __enter__(self) -> DirectoryStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"DirectoryStore({self._root!r}, max_bytes={self._max_bytes}, verify={self._verify}, "
            f"fsync={self._fsync}, total_bytes={self._index.total})"
        )

    # ------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise UnsupportedConfigError(f"store at {self._root} is closed", reason=Reason.BAD_VALUE)

    def _path(self, key: str) -> str:
        return self._prefix + key  # the root is absolute and normalised; keys hold no separator

    def _is_blob(self, key: str) -> bool:
        st = lstat(self._path(key))
        return st is not None and stat.S_ISREG(st.st_mode)

    def _get(
        self,
        key: str,
        whole: bool,
        into: bytearray | None = None,
        verify_crc: bool = True,
        max_bytes: Any = None,
    ) -> ParsedBlob:
        for retry in (True, True, False):  # a damaged file replaced by a writer meanwhile: read it again
            parsed = self._read(key, retry, whole, into, verify_crc, max_bytes)
            if parsed is not None:
                return parsed
        raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover

    def _read(
        self, key: str, retry: bool, whole: bool, into: bytearray | None, verify_crc: bool, max_bytes: Any
    ) -> ParsedBlob | None:
        """One read attempt; None when a damaged file was replaced meanwhile (and ``retry``)."""
        path = self._prefix + key
        opened = open_regular(path)
        if opened is None:
            with self._lock:
                self._index.forget(key)
            self._counters.add(round_trips=1, misses=1)
            raise KeyError(key)
        fd, st = opened
        try:
            try:
                parsed = load_blob(fd, st.st_size, whole, into, verify_crc, self._verify, max_bytes)
            except CorruptEncodedKVError as e:
                return self._damaged(key, path, st, e, retry=retry)
            self._used(key, fd, st)
        finally:
            os.close(fd)
        self._counters.hit(st.st_size)
        return parsed

    def _used(self, key: str, fd: int, st: os.stat_result) -> None:
        """Make ``key`` the most recent in the index; persist that to its mtime only when the file's
        mtime is :data:`~kvcodec.store.index.RECENCY_PERSIST_S` old (a ``utime`` per read is dear)."""
        with self._lock:
            stamp = self._index.next_stamp()
            disk = st.st_mtime_ns
            if stamp - disk >= self._persist_ns and set_mtime(fd, stamp):
                disk = stamp  # else: not the owner / read-only mount: recency stays in memory
            self._index.record(key, stamp, st.st_size, disk)

    def _damaged(
        self, key: str, path: str, st: os.stat_result, err: CorruptEncodedKVError, *, retry: bool
    ) -> None:
        """Quarantine a damaged file and raise its error; None when a writer replaced it (retry)."""
        try:
            where, replaced = self._quarantine.discard(path, st)
        except OSError as e:  # read-only store: report the damage, leave the file
            where, replaced = f"could not quarantine it ({e.strerror})", False
        if replaced and retry:
            return None
        if not replaced:
            with self._lock:
                self._index.forget(key)
        self._counters.add(round_trips=1, errors=1)
        raise type(err)(
            f"stored blob {key!r} at {path} is corrupt: {err}; {where}", reason=err.reason
        ) from None

    def _make_room(self, key: str, n: int) -> None:
        """Evict until ``n`` bytes under ``key`` fit under ``max_bytes`` (caller holds the lock)."""
        if self._max_bytes is None:
            return
        if time.monotonic() - self._index.last_scan >= self._rescan_interval_s:
            self._scan_locked()  # count what other processes wrote or removed meanwhile
        self._evictor.make_room(key, n, self._max_bytes)

    def _scan_locked(self) -> None:
        """Rebuild the index from the directory and remove dead temps (caller holds the lock)."""
        self._index.rebuild(scan(self._root, self._stale_temp_s))
