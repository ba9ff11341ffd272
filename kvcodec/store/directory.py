"""DirectoryStore: a crash-safe, size-bounded directory of LMCKV blobs.

It is the embedded default place where a vLLM/LMCache connector keeps KV
blobs: one file per key under one directory. Writes are atomic and durable
(unique temp file, fsync, ``os.replace``, fsync of the directory), so a crash
never leaves a final-named file with partial data. Reads ``mmap`` the file
copy-on-write (``get``) or read it into private memory (``get_parsed``, for a
reader that decodes at once: one parse, CRC included) and verify it with
:func:`kvcodec.format.parse` before handing it out, so damaged files are
refused (and quarantined), never returned.

A store serves only regular files directly inside its root: names are opened
with ``O_NOFOLLOW`` and checked with ``fstat``, so a symlink, FIFO, socket or
folder under a key's name is a miss (``KeyError`` from ``get``, False from
``contains``, absent from ``keys``), never followed and never an ``OSError``.
The store writes the blobs it is given as they are (it never encodes); blobs
from :func:`kvcodec.encode` are version 2 (sealed) unless asked otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import heapq
import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ..errors import CorruptEncodedKVError, UnsupportedConfigError
from ..format import HASH_KEYS, Hashes, ParsedBlob, as_bytes_view, parse
from .base import StoreFullError, StoreOptions

try:  # POSIX: flock tells a live writer's temp file from a dead one's.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "MAX_KEY_LEN",
    "QUARANTINE_DIRNAME",
    "DirectoryStore",
    "InvalidKeyError",
    "StoreFullError",
    "chunk_group",
    "validate_key",
]

QUARANTINE_DIRNAME = ".quarantine"
"""Subdirectory of the store root that receives corrupt files."""

MAX_KEY_LEN = 200
"""Longest key, so that key-derived file names stay under NAME_MAX (255)."""

_KEY_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_TMP_PREFIX = ".tmp."
_KEY_DOMAIN = b"kvcodec.store.key.v1\x00"
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_MISS_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EMLINK, errno.ENXIO})
"""open() errors that mean "no regular file here": absent, a symlink (ELOOP; EMLINK on BSDs), a socket."""


class InvalidKeyError(UnsupportedConfigError, ValueError):
    """A key that cannot name a store file (empty, too long, unsafe characters, leading dot)."""


_GROUP_RE = re.compile(r"-C(\d+)-H([A-Za-z0-9]+)(?:-P([A-Za-z0-9]+))?\Z")


def chunk_group(key: str) -> tuple[str, int, str | None]:
    """``(group id, depth, parent group id)`` of a key, as eviction sees it.

    A key ending ``-C<chunk>-H<hash>[-P<parent hash>]`` belongs to chunk group
    ``C<chunk>-H<hash>`` at depth ``chunk``, whose predecessor is
    ``C<chunk-1>-H<parent hash>`` (none without ``-P``). Any other key is a
    group of its own at depth 0.
    """
    m = _GROUP_RE.search(key)
    if m is None:
        return key, 0, None
    chunk = int(m.group(1))
    parent = None if m.group(3) is None or chunk == 0 else f"C{chunk - 1}-H{m.group(3)}"
    return f"C{chunk}-H{m.group(2)}", chunk, parent


def validate_key(key: Any) -> str:
    """Return ``key`` if it is a safe store key, else raise :class:`InvalidKeyError`.

    Keys become file names, so they are 1..200 characters of ``[A-Za-z0-9._-]``
    and may not start with a dot (dot names are the store's own: temp files and
    the quarantine directory).
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"store key must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidKeyError("store key is empty")
    if len(key) > MAX_KEY_LEN:
        raise InvalidKeyError(f"store key is {len(key)} characters; at most {MAX_KEY_LEN}")
    if not _KEY_RE.fullmatch(key):
        raise InvalidKeyError(f"store key {key!r} must use only [A-Za-z0-9._-] and must not start with '.'")
    return key


def _open_regular(path: str) -> tuple[int, os.stat_result] | None:
    """``(fd, stat)`` of the regular file at ``path``, without following a symlink; None if there is none.

    ``O_NONBLOCK`` keeps a FIFO from hanging the open; ``fstat`` refuses
    whatever is not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno in _MISS_ERRNOS:
            return None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st


def _read_file(fd: int, size: int, into: bytearray | None = None) -> bytearray | memoryview:
    """The first ``size`` bytes of ``fd`` (fewer if the file is shorter: parse then finds it
    truncated): in ``into``'s leading bytes when it is large enough (a view of them), else in a new
    bytearray."""
    reuse = into is not None and len(into) >= size
    buf = into if reuse else bytearray(size)
    got = 0
    with memoryview(buf) as whole, whole[:size] as view:
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
        if reuse:
            return view[:got]  # its own view of ``into``: it outlives these two
    if got < size:
        del buf[got:]
    return buf


def _lstat(path: str) -> os.stat_result | None:
    """``path``'s own stat (a symlink is not followed), or None if absent."""
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (pid namespace)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:  # pragma: no cover - e.g. platforms without signals
        return True
    return True


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return os.path.samestat(a, b) and a.st_size == b.st_size and a.st_mtime_ns == b.st_mtime_ns


@dataclass
class _Group:
    members: list[str] = field(default_factory=list)
    stamp: int = 0
    depth: int = 0
    parent: str | None = None
    children: int = 0


def _eviction_order(index: Mapping[str, _Entry], key: str) -> Iterator[list[str]]:
    """Chunk groups to evict, in order, each as its keys (markers, ``-M-`` keys, first).

    First groups whose prefix is broken (a predecessor is gone), deepest first;
    then leaves (no successor present): the least recently used first, the
    deepest first among equals; a leaf's predecessor becomes a leaf once it is
    evicted. ``key``'s own group and its predecessors are never offered, and when
    ``key``'s own prefix is broken only broken groups are.
    """
    groups: dict[str, _Group] = {}
    for k, e in index.items():
        gid, depth, parent = chunk_group(k)
        g = groups.setdefault(gid, _Group(depth=depth, parent=parent))
        g.members.append(k)
        g.stamp = max(g.stamp, e.stamp)
        g.parent = g.parent or parent
    protected = set()
    gid, _, parent = chunk_group(key)
    parent_of_key = parent
    protected.add(gid)
    while parent is not None and parent not in protected:
        protected.add(parent)
        parent = groups[parent].parent if parent in groups else None
    memo: dict[str, bool] = {}

    def rooted(gid: str) -> bool:
        """Whether every predecessor of the group is present (depths fall, so the walk ends)."""
        seen, g = [], gid
        while True:
            if g in memo:
                ok = memo[g]
                break
            grp = groups.get(g)
            if grp is None:
                ok = False
                break
            seen.append(g)
            if grp.parent is None:
                ok = True
                break
            g = grp.parent
        for x in seen:
            memo[x] = ok
        return ok

    broken_ids = {g for g in groups if not rooted(g)}
    broken = sorted(broken_ids, key=lambda g: (-groups[g].depth, groups[g].stamp))
    for gid, g in groups.items():
        if g.parent in groups and gid not in broken_ids:
            groups[g.parent].children += 1
    for gid in broken:
        if gid not in protected:
            yield _ordered(groups[gid].members)
    if parent_of_key is not None and not rooted(parent_of_key):
        return  # a chunk that cannot be hit (its predecessor is gone) never displaces one that can
    heap = [(g.stamp, -g.depth, gid) for gid, g in groups.items() if gid not in broken_ids and not g.children]
    heapq.heapify(heap)
    while heap:
        _, _, gid = heapq.heappop(heap)
        if gid in protected:
            continue
        g = groups[gid]
        yield _ordered(g.members)
        p = groups.get(g.parent) if g.parent is not None else None
        if p is not None:
            p.children -= 1
            if p.children == 0:
                heapq.heappush(heap, (p.stamp, -p.depth, g.parent))


def _ordered(members: list[str]) -> list[str]:
    return sorted(members, key=lambda k: ("-M-" not in k, k))


class _Entry:
    """Size and recency stamp (the file's mtime in ns) of one stored blob."""

    __slots__ = ("size", "stamp")

    def __init__(self, stamp: int, size: int) -> None:
        self.stamp = stamp
        self.size = size


class DirectoryStore:
    """Key → LMCKV blob store in one directory, with atomic writes and LRU eviction.

    Layout: ``root/<key>`` holds a blob; ``root/.tmp.<pid>.<tid>.<random>`` are
    writes in progress; ``root/.quarantine/`` receives files that failed
    verification. Keys never start with a dot, so neither is ever listed.

    Guarantees:

    * ``put`` writes a uniquely named temp file (``O_EXCL``), fsyncs it,
      ``os.replace``-s it onto the key and fsyncs the directory (``fsync=True``).
      Readers and a crash at any point see either the old blob or the new one,
      complete; concurrent writers of a key (threads or processes) leave exactly
      one of the written blobs (last rename wins).
    * ``get`` maps the file with ``mmap.ACCESS_COPY`` (no up-front copy; the
      view is writable, writes never reach the file) and, with ``verify=True``,
      checks it with :func:`~kvcodec.format.parse` including the CRC. A damaged,
      truncated or empty file raises :class:`CorruptEncodedKVError` naming key
      and file and is moved to ``.quarantine/`` (deleted if ``quarantine=False``).
    * Temp files left by crashed writers are removed when the directory is
      scanned (on open, ``refresh``, ``keys``): only those whose writer no longer
      holds the file's ``flock`` and whose pid is dead or that are older than
      ``stale_temp_s``.

    Size bound and its limits: each instance keeps an index (size and recency
    per key) rebuilt from the directory on open, ``refresh()`` and ``keys()``.
    Recency is the file's mtime: ``put`` and ``get`` set it (``os.utime``), so
    another process or a reopened store rebuilds the same LRU order. With
    ``max_bytes``, ``put`` evicts least-recently-used blobs until the new total
    fits, rescanning first when the index is older than ``rescan_interval_s``
    (an O(number of files) ``scandir``; 0 rescans on every bounded ``put``).
    Blobs that other processes wrote since the last scan are not counted, so the
    directory can exceed ``max_bytes`` by what they wrote in between; the temp
    file being written is also not counted. ``total_bytes`` is this instance's
    view. Filesystems with coarse timestamps make LRU order approximate.

    Eviction is by chunk group (:func:`chunk_group`): keys ending
    ``-C<chunk>-H<hash>[-P<parent hash>]`` (every layer's and rank's blob of a
    connector chunk, and its ``-M-`` marker) are evicted together, markers first.
    Groups whose predecessor chain is broken go first (deepest first); then
    leaves, least recently used first and deepest first among equals, so a
    prefix loses its last chunks before its first. A ``put`` never evicts its
    own group or its predecessors, and a chunk whose predecessor is missing
    evicts only other such chunks: when nothing else can go it raises
    :class:`StoreFullError`, so a store capped below one prompt keeps serving
    that prompt's leading chunks. Other keys are groups of their own (plain
    LRU). Eviction removes exactly the file it examined: the victim is renamed
    aside and compared (inode, size, mtime) before it is unlinked; a blob put
    or read by another process in between is linked back under its name.
    Quarantined files are neither counted nor evicted; empty ``.quarantine/``
    yourself. Durability across power loss needs ``fsync=True``; without it a
    crash of the machine (not the process) may lose recent puts.

    POSIX only in spirit (Windows cannot replace a mapped file). Never modify
    stored files in place: a file truncated under a live mapping raises SIGBUS
    on access. Open a new store in a forked child rather than reusing the
    parent's instance. Case-insensitive filesystems fold keys that differ only
    in case. I/O failures (disk full, permissions) propagate as ``OSError``.
    """

    _WRITE_CHUNK = 8 << 20
    """Most bytes per ``os.write`` call."""

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
    ) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)):
            raise UnsupportedConfigError(f"max_bytes must be an int or None, got {max_bytes!r}")
        if max_bytes is not None and max_bytes <= 0:
            raise UnsupportedConfigError(f"max_bytes must be positive, got {max_bytes}")
        self._root = os.path.abspath(os.fspath(root))
        self._max_bytes = max_bytes
        self._verify = bool(verify)
        self._fsync = bool(fsync)
        self._quarantine = bool(quarantine)
        self._rescan_interval_s = float(rescan_interval_s)
        self._stale_temp_s = float(stale_temp_s)
        self._lock = threading.RLock()
        self._index: OrderedDict[str, _Entry] = OrderedDict()
        self._total = 0
        self._last_scan = 0.0
        self._last_stamp = 0
        self._closed = False
        os.makedirs(self._root, exist_ok=True)
        if self._quarantine:
            try:
                os.makedirs(self.quarantine_dir, exist_ok=True)
            except OSError:  # a read-only store can still be read; quarantine is tried when needed
                pass
        self.refresh()

    @classmethod
    def from_options(cls, root: str | os.PathLike[str], options: StoreOptions) -> DirectoryStore:
        """A store at ``root`` configured by :class:`~kvcodec.store.StoreOptions` (what ``open_store`` calls)."""
        return cls(root, max_bytes=options.max_bytes, verify=options.verify_blobs, fsync=options.fsync)

    # ------------------------------------------------------------------ keys

    @staticmethod
    def make_key(
        hashes: Hashes | Mapping[str, str | None],
        layer_id: int,
        chunk_id: int,
        *,
        chunk_hash: str = "",
    ) -> str:
        """Stable key ``"<model16>-L<layer>-C<chunk>[-H<chunk_hash>]"``.

        ``model16`` is the first 16 hex digits of SHA-256 over a domain tag and
        the six identity strings (in :data:`~kvcodec.format.HASH_KEYS` order,
        each UTF-8 with a 4-byte big-endian length prefix), so blobs of
        different models, tokenizers or layouts never share a key.
        """
        h = Hashes.coerce(hashes)
        for name, val in (("layer_id", layer_id), ("chunk_id", chunk_id)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise UnsupportedConfigError(f"{name} must be an int >= 0, got {val!r}")
        md = hashlib.sha256(_KEY_DOMAIN)
        for k in HASH_KEYS:
            raw = getattr(h, k).encode("utf-8")
            md.update(len(raw).to_bytes(4, "big"))
            md.update(raw)
        key = f"{md.hexdigest()[:16]}-L{layer_id}-C{chunk_id}"
        if chunk_hash != "":
            key += f"-H{chunk_hash}"
        return validate_key(key)

    # ------------------------------------------------------------ properties

    @property
    def root(self) -> str:
        """Absolute path of the store directory."""
        return self._root

    @property
    def quarantine_dir(self) -> str:
        """Where corrupt files are moved (``root/.quarantine``)."""
        return os.path.join(self._root, QUARANTINE_DIRNAME)

    @property
    def max_bytes(self) -> int | None:
        """Size bound in bytes, or None for unbounded."""
        return self._max_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of all blobs in this instance's index (see the class docstring's limits)."""
        with self._lock:
            return self._total

    # ------------------------------------------------------------ public API

    def put(self, key: str, blob: Any) -> None:
        """Store ``blob`` (any bytes-like buffer) under ``key``, atomically and durably.

        With ``verify=True`` the blob must parse as LMCKV (else
        :class:`CorruptEncodedKVError`); trailing bytes after a v1 payload are
        dropped. A blob larger than ``max_bytes`` raises
        :class:`UnsupportedConfigError`. May evict least-recently-used blobs.
        """
        validate_key(key)
        self._check_open()
        data = as_bytes_view(blob)
        if self._verify:
            try:
                data = parse(data).blob
            except CorruptEncodedKVError as e:
                raise CorruptEncodedKVError(
                    f"refusing to store {key!r}: not a valid LMCKV blob: {e}"
                ) from None
        n = len(data)
        if n == 0:
            raise UnsupportedConfigError(f"refusing to store an empty blob under {key!r}")
        if self._max_bytes is not None and n > self._max_bytes:
            raise UnsupportedConfigError(
                f"blob for {key!r} is {n} bytes, larger than the store's max_bytes={self._max_bytes}"
            )
        path = self._path(key)
        fd, tmp = self._create_temp()
        tmp_pending = True
        try:
            self._write_all(fd, data)
            if self._fsync:
                os.fsync(fd)
            with self._lock:
                self._make_room(key, n)
                stamp = self._next_stamp()
                try:
                    os.utime(fd, ns=(stamp, stamp))
                except OSError:  # pragma: no cover - filesystems refusing explicit times
                    pass
                os.replace(tmp, path)
                tmp_pending = False
                self._record(key, stamp, n)
        finally:
            if tmp_pending:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            os.close(fd)  # releases the flock only after the rename
        if self._fsync:
            self._fsync_dir(self._root)

    def get(self, key: str) -> memoryview:
        """The blob under ``key``: a writable, copy-on-write memoryview over an mmap of its file.

        Raises :class:`KeyError` if no regular file holds ``key`` (a symlink or
        other special file under its name is never followed) and
        :class:`CorruptEncodedKVError` (after quarantining the file) if it is damaged. With ``verify=False``
        only the CRC is skipped; the header is still bounds-checked.
        """
        validate_key(key)
        self._check_open()
        return self._get(key, whole=False).blob

    def get_parsed(self, key: str, into: bytearray | None = None) -> ParsedBlob:
        """The blob under ``key`` read into memory and parsed once, its CRC verified (whatever ``verify``).

        For a reader that decodes the blob at once (the vLLM connector's loads):
        :func:`~kvcodec.decode` takes the :class:`~kvcodec.format.ParsedBlob` as
        it is, so the blob is parsed once instead of twice and read with one
        ``read`` into a private, writable ``bytearray`` (K can be viewed in
        place) instead of faulting in an mmap page by page. Misses and damage
        are reported as by :meth:`get`: ``KeyError``, or
        :class:`CorruptEncodedKVError` after the file is quarantined (a CRC
        mismatch included).

        ``into``: read into this buffer when it is large enough (the blob then
        views it: the caller must not reuse it while the blob is in use),
        sparing a fresh allocation and its page faults per read.
        """
        validate_key(key)
        self._check_open()
        return self._get(key, whole=True, into=into)

    def _get(self, key: str, *, whole: bool, into: bytearray | None = None) -> ParsedBlob:
        for attempt in range(3):
            parsed = self._read(key, retry=attempt < 2, whole=whole, into=into)
            if parsed is not None:
                return parsed
        raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover

    def _read(
        self, key: str, *, retry: bool, whole: bool, into: bytearray | None = None
    ) -> ParsedBlob | None:
        """One read attempt; None when a damaged file was replaced meanwhile (and ``retry``).

        ``whole``: read the file into a bytearray and verify the CRC (:meth:`get_parsed`); else map it
        copy-on-write and verify the CRC only with ``verify`` (:meth:`get`)."""
        path = self._path(key)
        opened = _open_regular(path)
        if opened is None:
            self._forget(key)
            raise KeyError(key)
        fd, st = opened
        try:
            reason = None
            if st.st_size == 0:
                reason = "file is empty"
            else:
                mm = (
                    _read_file(fd, st.st_size, into)
                    if whole
                    else mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)
                )
                try:
                    parsed = parse(mm, verify_crc=whole or self._verify)
                except CorruptEncodedKVError as e:
                    reason = str(e)
                if reason is not None and not whole:  # outside the handler, so parse's views are released
                    try:
                        mm.close()
                    except BufferError:  # pragma: no cover - a view still alive; GC frees it
                        pass
            if reason is not None:
                try:
                    where, replaced = self._discard(path, st)
                except OSError as e:  # read-only store: report the damage, leave the file
                    where, replaced = f"could not quarantine it ({e.strerror})", False
                if replaced and retry:
                    return None
                if not replaced:
                    self._forget(key)
                raise CorruptEncodedKVError(f"stored blob {key!r} at {path} is corrupt: {reason}; {where}")
            with self._lock:
                stamp = self._next_stamp()
                try:
                    os.utime(fd, ns=(stamp, stamp))
                except OSError:  # not the owner / read-only mount: recency stays in memory
                    pass
                self._record(key, stamp, st.st_size)
        finally:
            os.close(fd)
        return parsed

    def contains(self, key: str) -> bool:
        """Whether a regular file exists for ``key`` (not verified: ``get`` may still find it corrupt).

        Agrees with ``keys()`` and ``get``: a symlink under the key's name is not a blob.
        """
        validate_key(key)
        self._check_open()
        st = _lstat(self._path(key))
        return st is not None and stat.S_ISREG(st.st_mode)

    def __contains__(self, key: object) -> bool:
        return self.contains(key)  # type: ignore[arg-type]

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
            self._forget(key)
        if removed and self._fsync:
            self._fsync_dir(self._root)
        return removed

    def keys(self) -> list[str]:
        """Sorted keys present in the directory (rescans it, so other processes' writes show)."""
        self._check_open()
        with self._lock:
            self._scan_locked()
            return sorted(self._index)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def refresh(self) -> None:
        """Rebuild the index (sizes, LRU order from mtimes) from the directory; drop dead temps."""
        self._check_open()
        with self._lock:
            self._scan_locked()

    def close(self) -> None:
        """Mark the store closed. Views returned by ``get`` stay valid (they own their maps)."""
        self._closed = True

    def __enter__(self) -> DirectoryStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"DirectoryStore({self._root!r}, max_bytes={self._max_bytes}, verify={self._verify}, "
            f"fsync={self._fsync}, total_bytes={self._total})"
        )

    # ------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise UnsupportedConfigError(f"store at {self._root} is closed")

    def _path(self, key: str) -> str:
        return os.path.join(self._root, key)

    def _next_stamp(self) -> int:
        """Strictly increasing wall-clock ns (caller holds the lock)."""
        t = time.time_ns()
        if t <= self._last_stamp:
            t = self._last_stamp + 1
        self._last_stamp = t
        return t

    def _create_temp(self) -> tuple[int, str]:
        """Create, open and flock a fresh temp file; return (fd, path)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        for _ in range(100):
            name = f"{_TMP_PREFIX}{os.getpid()}.{threading.get_native_id()}.{secrets.token_hex(8)}"
            path = os.path.join(self._root, name)
            try:
                fd = os.open(path, flags, 0o644)
            except FileExistsError:  # pragma: no cover - 64 random bits collided
                continue
            if fcntl is None:  # pragma: no cover - Windows
                return fd, path
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A scanner may have removed the file between O_EXCL and flock
            # (only possible when it thinks our pid is dead): check it is still ours.
            try:
                same = os.path.samestat(os.lstat(path), os.fstat(fd))
            except FileNotFoundError:
                same = False
            if same:
                return fd, path
            os.close(fd)  # pragma: no cover - lost the race with a scanner; retry
        raise OSError(errno.EEXIST, "could not create a unique temp file", self._root)  # pragma: no cover

    def _write_all(self, fd: int, data: memoryview) -> None:
        off, n, step = 0, len(data), self._WRITE_CHUNK
        while off < n:
            off += os.write(fd, data[off : off + step])

    def _fsync_dir(self, path: str) -> None:
        try:
            dfd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:  # pragma: no cover - platforms that cannot open directories
            return
        try:
            os.fsync(dfd)
        except OSError:  # pragma: no cover - filesystems without directory fsync
            pass
        finally:
            os.close(dfd)

    def _record(self, key: str, stamp: int, size: int) -> None:
        """Set key's entry and make it most recent (caller holds the lock)."""
        old = self._index.pop(key, None)
        if old is not None:
            self._total -= old.size
        self._index[key] = _Entry(stamp, size)
        self._total += size

    def _forget(self, key: str) -> None:
        with self._lock:
            old = self._index.pop(key, None)
            if old is not None:
                self._total -= old.size

    def _make_room(self, key: str, n: int) -> None:
        """Evict whole chunk groups (never ``key``'s own or its predecessors) until ``n`` bytes under
        ``key`` fit; raise :class:`StoreFullError` when they cannot (caller holds the lock)."""
        if self._max_bytes is None:
            return
        limit = self._max_bytes

        def need() -> bool:
            cur = self._index.get(key)
            return self._total - (cur.size if cur else 0) + n > limit

        if time.monotonic() - self._last_scan >= self._rescan_interval_s:
            self._scan_locked()  # count what other processes wrote or removed meanwhile
        if not need():
            return
        for members in _eviction_order(self._index, key):
            self._evict(members)
            if not need():
                return
        raise StoreFullError(
            f"no room for {key!r} ({n} bytes) under max_bytes={limit}: the rest is its own chunk prefix "
            f"({self._total} bytes); a store must hold a prompt's leading chunks before later ones"
        )

    def _evict(self, members: list[str]) -> None:
        """Remove a chunk group's files unless one was used since the scan (caller holds the lock)."""
        examined = []
        for victim in members:
            entry = self._index.get(victim)
            st = _lstat(self._path(victim))
            if entry is None or st is None or not stat.S_ISREG(st.st_mode):
                self._forget(victim)  # gone, or no longer a blob: not ours to remove
                continue
            if st.st_mtime_ns > entry.stamp:
                # Another process used or rewrote part of the group since our scan: it is recent.
                for k in members:
                    cur = _lstat(self._path(k))
                    if cur is not None and stat.S_ISREG(cur.st_mode):
                        self._record(k, max(cur.st_mtime_ns, st.st_mtime_ns), cur.st_size)
                return
            examined.append((victim, st))
        for victim, st in examined:
            self._remove_exact(self._path(victim), st)
            self._forget(victim)

    def _remove_exact(self, path: str, st: os.stat_result) -> bool:
        """Unlink ``path`` only if it is still the file examined as ``st`` (inode, size, mtime).

        It is renamed aside first and compared there: a blob that another process
        put (or read, which refreshes its mtime) after the examination is linked
        back under its name (never over a newer one) instead of being deleted.
        """
        aside = os.path.join(
            self._root, f"{_TMP_PREFIX}{os.getpid()}.{threading.get_native_id()}.{secrets.token_hex(8)}"
        )
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return False
        try:
            moved = os.lstat(aside)
        except FileNotFoundError:  # a scanner removed the stale, renamed file: it was the old one
            return True
        if _same_file(moved, st):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(aside)
            return True
        with contextlib.suppress(FileExistsError, FileNotFoundError):
            os.link(aside, path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)
        return False

    def _scan_locked(self) -> None:
        """Rebuild the index from the directory and remove dead temps (caller holds the lock)."""
        found: list[tuple[int, str, int]] = []
        with os.scandir(self._root) as it:
            for de in it:
                name = de.name
                if name.startswith(_TMP_PREFIX):
                    self._maybe_remove_temp(name)
                    continue
                if name.startswith(".") or len(name) > MAX_KEY_LEN or not _KEY_RE.fullmatch(name):
                    continue
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime_ns, name, st.st_size))
        found.sort()
        self._index = OrderedDict((name, _Entry(mt, size)) for mt, name, size in found)
        self._total = sum(size for _, _, size in found)
        if found:
            self._last_stamp = max(self._last_stamp, found[-1][0])
        self._last_scan = time.monotonic()

    def _maybe_remove_temp(self, name: str) -> None:
        """Unlink a temp file whose writer is gone (flock free, and pid dead or stale)."""
        path = os.path.join(self._root, name)
        parts = name[len(_TMP_PREFIX) :].split(".")
        try:
            pid = int(parts[0])
        except (ValueError, IndexError):
            pid = -1
        try:
            opened = _open_regular(path)
        except OSError:
            return
        if opened is None:  # a symlink or special file named like a temp: never ours, never followed
            return
        fd, _ = opened
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    return  # a live writer holds it
            age = time.time() - os.fstat(fd).st_mtime
            if _pid_alive(pid) and age < self._stale_temp_s:
                return
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        finally:
            os.close(fd)

    def _discard(self, path: str, st: os.stat_result) -> tuple[str, bool]:
        """Quarantine (or delete) ``path`` if it is still the inode ``st``.

        Returns what happened and whether a writer had replaced the file (so the
        caller may read the new one). A file renamed in between our check and
        our rename is put back with ``link`` (which never clobbers a newer one).
        """
        cur = _lstat(path)
        if cur is None:
            return "file already gone", False
        if not os.path.samestat(cur, st):
            return "a writer has replaced it since", True
        if self._quarantine:
            os.makedirs(self.quarantine_dir, exist_ok=True)
            dest = os.path.join(
                self.quarantine_dir, f"{os.path.basename(path)}.{time.time_ns()}.{secrets.token_hex(4)}"
            )
        else:
            dest = os.path.join(
                self._root, f"{_TMP_PREFIX}{os.getpid()}.{threading.get_native_id()}.{secrets.token_hex(8)}"
            )
        try:
            os.rename(path, dest)
        except FileNotFoundError:
            return "file already gone", False
        try:
            moved = os.lstat(dest)
        except FileNotFoundError:  # a scanner removed our .tmp-named file: same outcome
            return "deleted", False
        if not os.path.samestat(moved, st):
            try:
                os.link(dest, path)
            except FileExistsError:
                pass
            os.unlink(dest)
            return "a writer has replaced it since", True
        if not self._quarantine:
            os.unlink(dest)
            return "deleted", False
        if self._fsync:
            self._fsync_dir(self.quarantine_dir)
            self._fsync_dir(self._root)
        return f"moved to {dest}", False
