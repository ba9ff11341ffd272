"""Reading a stored blob bounded by what its header declares.

A blob file's size must be exactly header + payload as its header declares
them. :func:`declared_size` walks the header's length fields (bounds-checked,
from a small prefix and ``pread`` beyond it) without allocating more than a few
KiB, so a sparse 1 GiB file or a lying header costs nothing before it is
refused; only then is the file read (:func:`read_blob`) or mapped, and parsed
(CRC included) by :func:`kvcodec.format.parse`.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

from ..errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from ..format import ParsedBlob, parse
from ..format.header import (
    CRC_FIELD,
    FIXED_HEADER,
    HASH_LEN,
    HASH_PAIR_COUNT,
    IDS,
    IDS_OFFSET,
    MAGIC,
    MAX_HASH_PAIRS,
    MAX_PAYLOAD_LEN,
    MAX_SCALE_DIMS,
    PAYLOAD_LENS,
    SCALE_DIM,
)
from .files import read_into

__all__ = [
    "PREFIX_LEN",
    "check_max_blob",
    "check_size",
    "declared_size",
    "load_blob",
    "read_blob",
    "read_checked",
    "read_prefix",
]

PREFIX_LEN = 4096
"""Bytes read before anything else: a real header (a few hundred bytes) fits in them."""


def read_prefix(fd: int, size: int) -> bytes:
    """The first ``min(size, PREFIX_LEN)`` bytes of ``fd``."""
    return os.pread(fd, min(size, PREFIX_LEN), 0)


class _Fields:
    """Bounds-checked reads of a file of ``size`` bytes: from ``head`` when there, else ``pread``."""

    def __init__(self, head: Any, size: int, fd: int | None) -> None:
        self.head = head
        self.size = size
        self.fd = fd

    def unpack(self, st: struct.Struct, off: int, what: str) -> tuple[Any, ...]:
        """``st`` unpacked at ``off``, or :class:`CorruptEncodedKVError` if the file ends before."""
        n = st.size
        if n > self.size - off:
            raise CorruptEncodedKVError(
                f"truncated {what}: need {n} bytes at offset {off}, the file is {self.size} bytes",
                reason=Reason.TRUNCATED_HEADER,
            )
        if off + n <= len(self.head):
            return st.unpack_from(self.head, off)
        got = os.pread(self.fd, n, off) if self.fd is not None else b""
        if len(got) != n:  # the file shrank under us (the store never writes in place)
            raise CorruptEncodedKVError(
                f"truncated {what}: read {len(got)} of {n} bytes at offset {off}",
                reason=Reason.TRUNCATED_HEADER,
            )
        return st.unpack(got)


_IDS_END = IDS_OFFSET + IDS.size
_last: tuple[bytes, bytes, int, int] | None = None
"""The last short header walked: its bytes before and after the two ids (up to the CRC), its length
and the total it declares. A connector's blobs share every header byte but the ids and the CRC, so
most walks are two byte comparisons."""


def declared_size(head: Any, size: int, fd: int | None = None) -> int:
    """Header + payload bytes that the header at the start of a ``size``-byte file declares.

    ``head``: the file's first bytes (all of them for a mapped file); ``fd`` serves
    the rest of a long header. Raises :class:`CorruptEncodedKVError` with the
    parser's reason for what it checks (``BAD_MAGIC``, ``SCALE_RANK_OUT_OF_RANGE``,
    ``NEGATIVE_PAYLOAD_LEN``, ``FIELD_OUT_OF_RANGE``, ``BAD_HASH_TABLE``,
    ``TRUNCATED_HEADER``); the full check is :func:`kvcodec.format.parse`'s.
    """
    global _last
    seen = _last
    if seen is not None:
        before, after, header_len, total = seen
        if (
            len(head) >= header_len
            and head[:IDS_OFFSET] == before
            and head[_IDS_END : header_len - CRC_FIELD.size] == after
        ):
            return total
    header_len, total = _walk(head, size, fd)
    if header_len <= min(len(head), PREFIX_LEN):  # only short headers: a real one is a few hundred bytes
        _last = (
            bytes(head[:IDS_OFFSET]),
            bytes(head[_IDS_END : header_len - CRC_FIELD.size]),
            header_len,
            total,
        )
    return total


def _walk(head: Any, size: int, fd: int | None) -> tuple[int, int]:
    """``(header length, header + payload length)``, each field read bounds-checked."""
    f = _Fields(head, size, fd)
    fixed = f.unpack(FIXED_HEADER, 0, "fixed header")
    magic, n_scale = fixed[0], fixed[-1]
    if magic != MAGIC:
        raise CorruptEncodedKVError(
            f"bad magic: expected {MAGIC!r}, found {magic!r}", reason=Reason.BAD_MAGIC
        )
    if not 0 <= n_scale <= MAX_SCALE_DIMS:
        raise CorruptEncodedKVError(
            f"scale_shape_n={n_scale} out of range: expected 0..{MAX_SCALE_DIMS}",
            reason=Reason.SCALE_RANK_OUT_OF_RANGE,
        )
    off = FIXED_HEADER.size + n_scale * SCALE_DIM.size
    lens = f.unpack(PAYLOAD_LENS, off, "payload lengths")
    for name, n in zip(("k_payload_len", "v_payload_len", "scale_payload_len"), lens):
        if not 0 <= n <= MAX_PAYLOAD_LEN:
            reason = Reason.NEGATIVE_PAYLOAD_LEN if n < 0 else Reason.FIELD_OUT_OF_RANGE
            raise CorruptEncodedKVError(f"{name}={n} out of range 0..{MAX_PAYLOAD_LEN}", reason=reason)
    off += PAYLOAD_LENS.size
    (n_pairs,) = f.unpack(HASH_PAIR_COUNT, off, "hash count")
    if n_pairs > MAX_HASH_PAIRS:
        raise CorruptEncodedKVError(
            f"hash count {n_pairs} exceeds the limit of {MAX_HASH_PAIRS}", reason=Reason.BAD_HASH_TABLE
        )
    off += HASH_PAIR_COUNT.size
    mv, n_head = f.head, len(f.head)
    for i in range(2 * n_pairs):
        if off + 2 <= n_head:  # HASH_LEN inline: the loop of a real header runs in the prefix
            length = mv[off] | (mv[off + 1] << 8)
        else:
            (length,) = f.unpack(HASH_LEN, off, f"hash string #{i} length")
        off += HASH_LEN.size + length
    f.unpack(CRC_FIELD, off, "header CRC")  # the header ends inside the file
    return off + CRC_FIELD.size, off + CRC_FIELD.size + sum(lens)


def check_size(head: Any, size: int, fd: int | None = None) -> None:
    """Refuse a file whose size is not what its header declares (see :func:`declared_size`):
    ``TRUNCATED_PAYLOAD`` when shorter, ``SIZE_MISMATCH`` when longer."""
    want = declared_size(head, size, fd)
    if want > size:
        raise CorruptEncodedKVError(
            f"truncated payload: the header declares {want} bytes, the file is {size}",
            reason=Reason.TRUNCATED_PAYLOAD,
        )
    if want < size:
        raise CorruptEncodedKVError(
            f"file is {size} bytes, its header declares {want}: {size - want} bytes too many",
            reason=Reason.SIZE_MISMATCH,
        )


def read_blob(fd: int, size: int, into: bytearray | None = None, head: bytes = b"") -> bytearray | memoryview:
    """All ``size`` bytes of a blob file whose size was checked: in ``into``'s leading bytes when it
    is large enough (a view of them), else in a new bytearray; fewer if the file shrank meanwhile
    (the parser then finds it truncated). ``head``: the file's first bytes, read already."""
    reuse = into is not None and len(into) >= size
    buf = into if reuse else bytearray(size)
    with memoryview(buf) as whole, whole[:size] as view:
        n = min(len(head), size)
        view[:n] = head[:n]
        got = n + read_into(fd, view[n:], n)
        if reuse:
            return view[:got]  # its own view of ``into``: it outlives these two
    if got < size:
        del buf[got:]
    return buf


def read_checked(fd: int, size: int, into: bytearray | None = None) -> bytearray | memoryview:
    """A ``size``-byte blob file's bytes (see :func:`read_blob`), its size checked against its header
    (:func:`check_size`) before anything parses them. When ``into`` holds the whole file (a reused
    buffer, already allocated) the file is read in one call and its header checked there; else the
    prefix is read and checked first, so that no buffer is sized by a header that lies."""
    if into is not None and len(into) >= size:
        view = memoryview(into)[:size]  # one view of ``into`` (the slice's base is released with it)
        got = read_into(fd, view, 0)
        blob = view if got == size else view[:got]
        check_size(blob, size)  # a file that shrank meanwhile reads short: the parser finds it truncated
        return blob
    head = read_prefix(fd, size)
    check_size(head, size, fd)
    return read_blob(fd, size, into, head)


def check_max_blob(max_bytes: Any, size: int, limit: int) -> None:
    """Refuse a ``size``-byte stored object larger than ``max_bytes``, the largest blob its reader
    expects (``SIZE_MISMATCH``, before it is read); ``max_bytes`` must be None or an int in
    1..``limit``."""
    if max_bytes is None:
        return
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or not 0 < max_bytes <= limit:
        raise UnsupportedConfigError(
            f"max_bytes must be an int in 1..{limit}, got {max_bytes!r}", reason=Reason.BAD_VALUE
        )
    if size > max_bytes:
        raise CorruptEncodedKVError(
            f"{size} bytes, more than the {max_bytes} its reader expects: not read",
            reason=Reason.SIZE_MISMATCH,
        )


def load_blob(
    fd: int, size: int, whole: bool, into: bytearray | None, verify_crc: bool, verify: bool, max_bytes: Any
) -> ParsedBlob:
    """A blob file checked (``max_bytes``, then its size against its header), then read (``whole``:
    into private memory, parsed with ``verify_crc``) or mapped copy-on-write (parsed with ``verify``).

    Raises a fresh :class:`CorruptEncodedKVError` (the parser's reason kept) whose traceback holds
    no view of the map, so the map is closed before the error leaves."""
    check_max_blob(max_bytes, size, MAX_PAYLOAD_LEN)
    if size == 0:
        raise CorruptEncodedKVError("file is empty", reason=Reason.TRUNCATED_HEADER)
    if whole:
        blob = read_checked(fd, size, into)
        return parse(blob, verify_crc=verify_crc, remember=verify_crc)  # deferred: not memoised
    mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    failure: tuple[type[CorruptEncodedKVError], str, Reason] | None = None
    try:
        check_size(mm, size)
        return parse(mm, verify_crc=verify)
    except CorruptEncodedKVError as e:
        failure = (type(e), str(e), e.reason)
    try:  # outside the handler, so parse's views are released
        mm.close()
    except BufferError:  # pragma: no cover - a view still alive; GC frees it
        pass
    cls, message, reason = failure
    raise cls(message, reason=reason)
