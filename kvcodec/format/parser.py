"""The bounds-checked, zero-copy LMCKV parser.

Validation runs in one pass, in a fixed order, and the first failure raises
exactly one :class:`~kvcodec.errors.CodecError` subclass:

1. structure: magic, version, enum ids and dtype ids, each field within its
   named limit, as the fixed header is read;
2. lengths and bounds: scale dims, hash strings (UTF-8, unique keys), then
   each payload section against the bytes that remain (never a raw sum);
3. CRC (unless the caller verified it already): a corrupted blob is reported
   as such before any consistency complaint its corruption may cause;
4. consistency: K/V/scale lengths against the layout fields and the scope (a lossless blob's
   stream tables first, :func:`~.coding.read_coding`, then its plain blob's header);
5. stored scales: each finite and greater than zero, as encode writes them
   (a NaN, Inf, zero or negative scale would decode V to NaN, Inf or flipped
   signs); a C-speed pass over one byte per scale, a few µs per 1,000 scales.

``parse`` returns memoryviews into the caller's buffer; nothing is copied.
Pure Python: no torch, no extension.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any

from ..errors import CorruptEncodedKVError, Reason
from .buffer import as_bytes_view
from .coding import Coding, read_coding
from .dtypes import FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT_INF_BITS, DType, id_to_dtype
from .header import (
    COMPUTED_SCOPES,
    CRC_FIELD,
    FIXED_HEADER,
    HASH_KEYS,
    HASH_PAIR_COUNT,
    IDS,
    IDS_OFFSET,
    MAGIC,
    MAX_DIM,
    MAX_ELEMENTS,
    MAX_HASH_PAIRS,
    MAX_PAYLOAD_LEN,
    MAX_SCALE_DIMS,
    PAYLOAD_LENS,
    PLAIN_OF,
    SCALE_DIM,
    SUPPORTED_VERSIONS,
    Hashes,
    Header,
    ScaleScheme,
    ScaleScope,
    check_crc,
    check_latent,
    payload_crc,
)

__all__ = [
    "MEMO_MAX_BYTES",
    "MEMO_MAX_HEADER_BYTES",
    "Extent",
    "MemoInfo",
    "ParsedBlob",
    "blob_extent",
    "check_consistency",
    "check_stored_scales",
    "check_v_codes",
    "clear_header_memo",
    "expected_scale_shape",
    "forget_header",
    "header_fields",
    "header_memo_info",
    "parse",
    "remember_header",
    "v_group",
]


@dataclass(frozen=True)
class ParsedBlob:
    """A parsed blob: its header plus views into the caller's buffer (no copies)."""

    header: Header
    buffer: memoryview
    """The whole input buffer, as bytes."""
    header_len: int
    crc: int
    """The CRC stored in the header (verified unless parsing was told not to)."""
    trailing: int
    """Bytes after the payload (allowed in v1 unless strict)."""
    unknown_hashes: tuple[tuple[str, str], ...] = ()
    coding: Coding | None = None
    """A lossless blob's stream tables as the parse checked them (None: a plain blob, or not checked)."""

    @property
    def header_bytes(self) -> memoryview:
        """The header as stored."""
        return self.buffer[: self.header_len]

    @property
    def crc_prefix(self) -> memoryview:
        """What the CRC covers before the payload: the header up to its CRC field (v2; v1 ignores it)."""
        return self.buffer[: self.header_len - 4]

    @property
    def payload(self) -> memoryview:
        """K ‖ V ‖ scales, a view into the source buffer."""
        return self.buffer[self.header_len : self.header_len + self.header.payload_len]

    @property
    def blob(self) -> memoryview:
        """Header and payload, without trailing bytes."""
        return self.buffer[: self.header_len + self.header.payload_len]

    @property
    def k(self) -> memoryview:
        """K section of the payload."""
        s = self.header_len
        return self.buffer[s : s + self.header.k_payload_len]

    @property
    def v(self) -> memoryview:
        """V section of the payload."""
        s = self.header_len + self.header.k_payload_len
        return self.buffer[s : s + self.header.v_payload_len]

    @property
    def scales(self) -> memoryview:
        """Scale section of the payload."""
        s = self.header_len + self.header.k_payload_len + self.header.v_payload_len
        return self.buffer[s : s + self.header.scale_payload_len]


# All scale dims at once: SCALE_DIM's code n times.
_SHAPE_STRUCTS = tuple(struct.Struct("<" + SCALE_DIM.format[-1] * n) for n in range(MAX_SCALE_DIMS + 1))


class _Reader:
    """Bounds-checked cursor over a memoryview."""

    __slots__ = ("mv", "n", "off")

    def __init__(self, mv: memoryview) -> None:
        self.mv = mv
        self.off = 0
        self.n = len(mv)

    def need(self, size: int, what: str) -> None:
        if size > self.n - self.off:
            raise CorruptEncodedKVError(
                f"truncated {what}: need {size} bytes at offset {self.off}, "
                f"{self.n - self.off} remain (buffer is {self.n} bytes)",
                reason=Reason.TRUNCATED_HEADER,
            )

    def unpack(self, st: struct.Struct, what: str) -> tuple[Any, ...]:
        self.need(st.size, what)
        vals = st.unpack_from(self.mv, self.off)
        self.off += st.size
        return vals

    def string(self, what: str, *args: object) -> str:
        """A u16-length-prefixed UTF-8 string; ``what.format(*args)`` names it in errors only."""
        mv, off = self.mv, self.off
        if 2 > self.n - off:
            self.need(2, what.format(*args) + " length")
        length = mv[off] | (mv[off + 1] << 8)  # HASH_LEN, unpacked inline (the hot loop of a parse)
        off += 2
        self.off = off
        if length > self.n - off:
            self.need(length, what.format(*args))
        self.off = off + length
        if not length:
            return ""
        try:
            return str(mv[off : off + length], "utf-8")
        except UnicodeDecodeError as e:
            raise CorruptEncodedKVError(
                f"{what.format(*args)} at offset {off} is not UTF-8: {e.reason}", reason=Reason.BAD_UTF8
            ) from None


def _check_layout_int(name: str, value: int, minimum: int) -> None:
    if value == -1:
        return
    if not minimum <= value <= MAX_DIM:
        raise CorruptEncodedKVError(
            f"{name}={value} out of range: expected -1 (unset) or {minimum}..{MAX_DIM}",
            reason=Reason.FIELD_OUT_OF_RANGE,
        )


def _check_versioned_ids(magic: bytes, version: int, scope_id: int, scheme_id: int) -> None:
    """Step 1a: magic, version, and the ids whose range depends on the version."""
    if magic != MAGIC:
        raise CorruptEncodedKVError(
            f"bad magic: expected {MAGIC!r}, found {bytes(magic)!r}", reason=Reason.BAD_MAGIC
        )
    if version not in SUPPORTED_VERSIONS:
        raise CorruptEncodedKVError(
            f"unknown header version {version}; expected one of {SUPPORTED_VERSIONS}",
            reason=Reason.UNSUPPORTED_VERSION,
        )
    max_scope = ScaleScope.NONE if version >= 2 else ScaleScope.EXTERNAL
    if not 0 <= scope_id <= max_scope:
        raise CorruptEncodedKVError(
            f"unknown scale_scope id {scope_id} for header version {version}; expected 0..{int(max_scope)}",
            reason=Reason.UNKNOWN_SCOPE_ID,
        )
    if version == 1 and scheme_id != 0:
        raise CorruptEncodedKVError(
            f"reserved field is {scheme_id}; expected 0 in version 1", reason=Reason.RESERVED_NONZERO
        )
    if scheme_id not in _SCHEME_IDS:
        raise CorruptEncodedKVError(
            f"unknown scale scheme {scheme_id}; expected one of {sorted(_SCHEME_IDS)}",
            reason=Reason.UNKNOWN_SCHEME,
        )


_SCHEME_IDS = frozenset(int(s) for s in ScaleScheme)


def _check_ranges(n_scale: int, layer_id: int, chunk_id: int, layout: tuple[int, int, int, int]) -> None:
    """Step 1b: the scale dim count, the ids and the layout fields, each within its limit."""
    if not 0 <= n_scale <= MAX_SCALE_DIMS:
        raise CorruptEncodedKVError(
            f"scale_shape_n={n_scale} out of range: expected 0..{MAX_SCALE_DIMS}",
            reason=Reason.SCALE_RANK_OUT_OF_RANGE,
        )
    if layer_id < -1 or chunk_id < -1:
        raise CorruptEncodedKVError(
            f"layer_id={layer_id}, chunk_id={chunk_id}: expected -1 (unset) or >= 0",
            reason=Reason.FIELD_OUT_OF_RANGE,
        )
    chunk_size, page_size, kv_head_count, head_dim = layout
    _check_layout_int("chunk_size", chunk_size, 0)
    _check_layout_int("page_size", page_size, 1)
    _check_layout_int("kv_head_count", kv_head_count, 1)
    _check_layout_int("head_dim", head_dim, 1)


def _read_fixed(r: _Reader) -> tuple[dict[str, Any], int]:
    """Step 1: the fixed fields (FIXED_FIELDS order), each checked; also the scale dim count."""
    values = r.unpack(FIXED_HEADER, "fixed header")
    magic, version, scope_id, k_id, v_id, s_id, scheme_id, layer_id, chunk_id = values[:9]
    layout, n_scale = values[9:13], values[13]
    _check_versioned_ids(magic, version, scope_id, scheme_id)
    _check_ranges(n_scale, layer_id, chunk_id, layout)
    chunk_size, page_size, kv_head_count, head_dim = layout
    return {
        "k_dtype": id_to_dtype(k_id, "k_dtype"),
        "v_dtype": id_to_dtype(v_id, "v_dtype"),
        "scale_dtype": id_to_dtype(s_id, "scale_dtype"),
        "scale_scope": ScaleScope(scope_id),
        "version": version,
        "scale_scheme": ScaleScheme(scheme_id),
        "layer_id": layer_id,
        "chunk_id": chunk_id,
        "chunk_size": chunk_size,
        "page_size": page_size,
        "kv_head_count": kv_head_count,
        "head_dim": head_dim,
    }, n_scale


def _read_sizes(r: _Reader, n_scale: int) -> dict[str, Any]:
    """Step 2a: scale dims and section lengths, each within its limit."""
    scale_shape = r.unpack(_SHAPE_STRUCTS[n_scale], "scale_shape")
    for i, d in enumerate(scale_shape):
        if not 0 <= d <= MAX_DIM:
            raise CorruptEncodedKVError(
                f"scale_shape[{i}]={d} out of range 0..{MAX_DIM}", reason=Reason.FIELD_OUT_OF_RANGE
            )
    lens = r.unpack(PAYLOAD_LENS, "payload lengths")
    names = ("k_payload_len", "v_payload_len", "scale_payload_len")
    for name, n in zip(names, lens):
        if not 0 <= n <= MAX_PAYLOAD_LEN:
            reason = Reason.NEGATIVE_PAYLOAD_LEN if n < 0 else Reason.FIELD_OUT_OF_RANGE
            raise CorruptEncodedKVError(f"{name}={n} out of range 0..{MAX_PAYLOAD_LEN}", reason=reason)
    return {"scale_shape": tuple(scale_shape), **dict(zip(names, lens))}


def _read_hashes(r: _Reader) -> tuple[Hashes, tuple[tuple[str, str], ...]]:
    """Step 2b: the (key, value) pairs: UTF-8, unique keys; the six known ones and any others."""
    (n_pairs,) = r.unpack(HASH_PAIR_COUNT, "hash count")
    if n_pairs > MAX_HASH_PAIRS:
        raise CorruptEncodedKVError(
            f"hash count {n_pairs} exceeds the limit of {MAX_HASH_PAIRS}", reason=Reason.BAD_HASH_TABLE
        )
    known: dict[str, str] = {}
    unknown: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for i in range(n_pairs):
        key = r.string("hash key #{}", i)
        val = r.string("hash value #{} ({!r})", i, key)
        if key in seen:
            raise CorruptEncodedKVError(
                f"duplicate hash key {key!r}: pair #{i} repeats pair #{seen[key]}; expected unique keys",
                reason=Reason.BAD_HASH_TABLE,
            )
        seen[key] = i
        if key in HASH_KEYS:
            known[key] = val
        else:
            unknown.append((key, val))
    return Hashes(**known), tuple(unknown)


def _trailing(n_buf: int, header_len: int, h: Header, strict: bool) -> int:
    """Step 2c: each section against the bytes that remain (never a raw sum); the bytes left after."""
    remaining = n_buf - header_len
    for name, n in (
        ("K payload", h.k_payload_len),
        ("V payload", h.v_payload_len),
        ("scale payload", h.scale_payload_len),
    ):
        if n > remaining:
            raise CorruptEncodedKVError(
                f"truncated {name}: header declares {n} bytes, only {remaining} remain "
                f"(buffer is {n_buf} bytes, header {header_len})",
                reason=Reason.TRUNCATED_PAYLOAD,
            )
        remaining -= n
    if remaining and (h.version >= 2 or strict):
        raise CorruptEncodedKVError(
            f"{remaining} trailing bytes after the payload (blob ends at "
            f"{header_len + h.payload_len}, buffer is {n_buf} bytes)",
            reason=Reason.TRAILING_BYTES,
        )
    return remaining


MEMO_MAX_HEADER_BYTES = 4096
"""Largest header the parse memo remembers (real ones are a few hundred bytes; a legal one may be ~33 MB)."""
MEMO_MAX_BYTES = 1 << 20
"""Most header bytes the parse memo holds in all (each remembered header costs about twice its length)."""


@dataclass(frozen=True)
class MemoInfo:
    """What the parse memo holds now (:func:`header_memo_info`)."""

    entries: int
    """Headers remembered."""
    bytes: int
    """Their bytes in all (the memo's keys; the parsed headers hold about as much again)."""
    max_header_bytes: int = MEMO_MAX_HEADER_BYTES
    max_bytes: int = MEMO_MAX_BYTES


_IDS_END = IDS_OFFSET + IDS.size
_NO_IDS = bytes(IDS.size)
"""What a memo key holds in place of the ids."""
_SCHEME = struct.Struct("<H")
_SCHEME_AT = IDS_OFFSET - _SCHEME.size
"""scale_scheme: the fixed part's last field before the ids."""
_N_SCALE = struct.Struct("<q")
_N_SCALE_AT = FIXED_HEADER.size - _N_SCALE.size
"""scale_shape_n: the fixed part's last field."""
_CODED_LENS = struct.Struct("<qq")
"""k_payload_len and v_payload_len, the first two of :data:`PAYLOAD_LENS`."""
_NO_LENS = bytes(_CODED_LENS.size)
_LOSSLESS_SCHEMES = frozenset(int(s) for s in PLAIN_OF)
_Last = tuple[bytes, tuple[bytes, ...], int, int, Header, tuple[tuple[str, str], ...]]
"""A memo entry split around the ids (and a lossless header's coded lengths): the bytes before the
ids, the runs after them up to the CRC, the header's length, where the coded lengths lie (-1: none
left out), the header and its unknown hashes."""


def _lens_at(mv: memoryview, header_len: int) -> int:
    """Where the k and v payload lengths of a lossless blob's header (at the start of ``mv``) lie: each
    blob's coded sizes, left out of its memo key like the ids, so that a stream of lossless blobs of
    one layout shares one entry. -1 for any other header (its lengths are part of its layout)."""
    if header_len < FIXED_HEADER.size or _SCHEME.unpack_from(mv, _SCHEME_AT)[0] not in _LOSSLESS_SCHEMES:
        return -1
    (n_scale,) = _N_SCALE.unpack_from(mv, _N_SCALE_AT)
    at = FIXED_HEADER.size + SCALE_DIM.size * n_scale
    ok = 0 <= n_scale <= MAX_SCALE_DIMS and at + _CODED_LENS.size <= header_len - CRC_FIELD.size
    return at if ok else -1


def _runs(mv: memoryview, header_len: int, at: int) -> tuple[bytes, ...]:
    """The header's bytes after the ids up to its CRC: one run, or two around the coded lengths at ``at``."""
    end = header_len - CRC_FIELD.size
    if at < 0:
        return (mv[_IDS_END:end].tobytes(),)
    return mv[_IDS_END:at].tobytes(), mv[at + _CODED_LENS.size : end].tobytes()


def _split(mv: memoryview, header_len: int) -> tuple[bytes, tuple[bytes, ...], int]:
    """The header's bytes before the ids, its runs after them (:func:`_runs`), and where a lossless
    header's coded lengths lie (:func:`_lens_at`)."""
    at = _lens_at(mv, header_len)
    return mv[:IDS_OFFSET].tobytes(), _runs(mv, header_len, at), at


def _key(before: bytes, runs: tuple[bytes, ...]) -> bytes:
    return before + _NO_IDS + _NO_LENS.join(runs)


def _is_entry(entry: _Last, mv: memoryview, header_len: int) -> bool:
    """Whether ``entry`` is the header of ``header_len`` bytes at the start of ``mv`` (ids and a lossless
    header's coded lengths aside)."""
    return (
        entry[2] == header_len
        and mv[:IDS_OFFSET].tobytes() == entry[0]
        and _runs(mv, header_len, entry[3]) == entry[1]
    )


def _with_blob_ids(
    mv: memoryview, header: Header, header_len: int, unknown: tuple[tuple[str, str], ...], lens_at: int = -1
) -> tuple[Header, int, tuple[tuple[str, str], ...]] | None:
    """A remembered header with the ids (and a lossless header's coded lengths) of the blob at the
    start of ``mv``, read and range-checked anew; None when one is out of range (the full parse then
    names the error)."""
    layer_id, chunk_id = IDS.unpack_from(mv, IDS_OFFSET)
    if layer_id < -1 or chunk_id < -1:
        return None
    changes: dict[str, int] = {}
    if layer_id != header.layer_id or chunk_id != header.chunk_id:
        changes.update(layer_id=layer_id, chunk_id=chunk_id)
    if lens_at >= 0:
        k_len, v_len = _CODED_LENS.unpack_from(mv, lens_at)
        if not (0 <= k_len <= MAX_PAYLOAD_LEN and 0 <= v_len <= MAX_PAYLOAD_LEN):
            return None
        if k_len != header.k_payload_len or v_len != header.v_payload_len:
            changes.update(k_payload_len=k_len, v_payload_len=v_len)
    return (header.derived(**changes) if changes else header), header_len, unknown


class _HeaderMemo:
    """Headers of blobs that passed every check, by their bytes up to the CRC with the ids zeroed.

    A connector reads many blobs whose headers differ only in ``layer_id``,
    ``chunk_id`` and the CRC (and a lossless blob's in its coded ``k_payload_len``
    and ``v_payload_len``, left out of its key too): parsing is a function of
    those bytes, so a header seen before is taken from here (its ids and coded
    lengths read and range-checked anew), and only the per-blob steps run
    (trailing bytes, CRC, a lossless blob's tables, stored scales). Bounded in
    bytes, not entries: only headers up to :data:`MEMO_MAX_HEADER_BYTES` are
    remembered, and the memo starts over when it would pass :data:`MEMO_MAX_BYTES`.
    Safe across threads (lookups read a dict and the last entry; changes take a lock).
    """

    MAX_LENGTHS = 8

    def __init__(self) -> None:
        self._entries: dict[bytes, tuple[Header, tuple[tuple[str, str], ...]]] = {}
        self._lengths: tuple[int, ...] = ()
        self._bytes = 0
        self._lock = threading.Lock()
        self._last: _Last | None = None
        """The entry found or kept last, split around the ids: the blobs of one chunk come one after
        another, so most lookups are two byte comparisons (no key built, no dict lookup)."""

    def recall(self, mv: memoryview) -> tuple[Header, int, tuple[tuple[str, str], ...]] | None:
        """``(header, header_len, unknown hashes)`` of a known header at the start of ``mv``, else None."""
        last = self._last
        if last is not None and len(mv) >= last[2] and _is_entry(last, mv, last[2]):
            return _with_blob_ids(mv, last[4], last[2], last[5], last[3])
        for n in self._lengths:
            if len(mv) < n:
                continue
            before, runs, at = _split(mv, n)
            hit = self._entries.get(_key(before, runs))
            if hit is not None:
                self._last = (before, runs, n, at, *hit)
                return _with_blob_ids(mv, hit[0], n, hit[1], at)
        return None

    def remember(
        self, mv: memoryview, header: Header, header_len: int, unknown: tuple[tuple[str, str], ...]
    ) -> None:
        """Keep the header of a blob that passed every check, if it is small enough."""
        last = self._last
        if header_len > MEMO_MAX_HEADER_BYTES or (last is not None and _is_entry(last, mv, header_len)):
            return
        before, runs, at = _split(mv, header_len)
        key = _key(before, runs)
        with self._lock:
            if key not in self._entries:
                if self._bytes + len(key) > MEMO_MAX_BYTES:
                    self._entries.clear()
                    self._bytes = 0
                self._entries[key] = (header, unknown)
                self._bytes += len(key)
                if header_len not in self._lengths:
                    self._lengths = (header_len, *self._lengths)[: self.MAX_LENGTHS]
            self._last = (before, runs, header_len, at, *self._entries[key])

    def forget(self, mv: memoryview, header_len: int) -> bool:
        """Drop the header at the start of ``mv`` (``header_len`` bytes); whether it was there."""
        key = _key(*_split(mv, header_len)[:2])
        with self._lock:
            self._last = None
            if self._entries.pop(key, None) is None:
                return False
            self._bytes -= len(key)
            return True

    def clear(self) -> None:
        """Forget every header."""
        with self._lock:
            self._last = None
            self._entries.clear()
            self._lengths = ()
            self._bytes = 0

    def info(self) -> MemoInfo:
        """What the memo holds now."""
        with self._lock:
            return MemoInfo(entries=len(self._entries), bytes=self._bytes)


_HEADERS = _HeaderMemo()


def header_memo_info() -> MemoInfo:
    """How many headers (and bytes) :func:`parse`'s memo holds now: for tests and memory audits."""
    return _HEADERS.info()


def forget_header(parsed: ParsedBlob) -> bool:
    """Drop ``parsed``'s header from :func:`parse`'s memo: for a caller that refuses the blob after
    parsing (an identity mismatch), so a refused blob's header is not kept. Whether it was there."""
    return _HEADERS.forget(parsed.buffer, parsed.header_len)


def remember_header(parsed: ParsedBlob) -> None:
    """Remember ``parsed``'s header once its blob passed every check: for a caller that parsed it with
    ``remember=False`` and checked its CRC itself afterwards (never before that check passed)."""
    if parsed.header_len <= len(parsed.buffer):
        _HEADERS.remember(parsed.buffer, parsed.header, parsed.header_len, parsed.unknown_hashes)


def clear_header_memo() -> None:
    """Empty :func:`parse`'s memo (it refills as blobs are parsed)."""
    _HEADERS.clear()


def parse(
    buf: Any,
    *,
    verify_crc: bool = True,
    strict: bool = False,
    consistency: bool = True,
    remember: bool = True,
) -> ParsedBlob:
    """Parse and validate an LMCKV blob without copying its payload.

    ``buf`` is any C-contiguous buffer (bytes, bytearray, memoryview, mmap,
    numpy array, ...). ``strict`` refuses trailing bytes after the payload in
    version 1 (version 2 always refuses them). ``verify_crc=False`` skips the
    checksum (for callers who verified it already). ``consistency=False``
    stops after step 3 (a header-level parse, as LMCache's ``deserialize_header``
    is); decoding such a blob is still checked.

    The header of a blob that passes every check that ran is remembered if it
    is small (:data:`MEMO_MAX_HEADER_BYTES`), in a memo bounded in bytes
    (:data:`MEMO_MAX_BYTES`, :func:`header_memo_info`); a refused blob leaves
    nothing there. A remembered header skips steps 1, 2 and 4 on its next
    blob; every per-blob step still runs. ``remember=False`` keeps a new header
    out of the memo (a caller that defers the CRC check: its blob may still
    fail it); a header already there is still used.
    """
    mv = as_bytes_view(buf)
    seen = _HEADERS.recall(mv)
    if seen is None:
        r = _Reader(mv)
        fields, n_scale = _read_fixed(r)
        fields.update(_read_sizes(r, n_scale))
        hashes, unknown = _read_hashes(r)
        header = Header(**fields, hashes=hashes)
        r.need(CRC_FIELD.size, "payload CRC")
        header_len = r.off + CRC_FIELD.size
    else:
        header, header_len, unknown = seen
    crc_off = header_len - CRC_FIELD.size
    (crc_stored,) = CRC_FIELD.unpack_from(mv, crc_off)
    trailing = _trailing(len(mv), header_len, header, strict)
    if verify_crc:
        payload = mv[header_len : header_len + header.payload_len]
        check_crc(header, crc_stored, payload_crc(header, mv[:crc_off], (payload,)))
    coded = None
    if consistency:
        if header.scale_scheme in PLAIN_OF:  # the stream tables are payload: checked on every blob
            k_at = header_len + header.k_payload_len
            coded = read_coding(header, mv[header_len:k_at], mv[k_at : k_at + header.v_payload_len])
            check_consistency(coded.plain)
        elif seen is None:
            check_consistency(header)
        scales_at = header_len + header.k_payload_len + header.v_payload_len
        check_stored_scales(header, mv[scales_at : scales_at + header.scale_payload_len])
        if seen is None and remember:  # only now: a blob refused by any check above leaves nothing
            _HEADERS.remember(mv, header, header_len, unknown)
    out = object.__new__(ParsedBlob)  # the fields as __init__ sets them, without its frozen setattrs
    out.__dict__.update(
        header=header,
        buffer=mv,
        header_len=header_len,
        crc=crc_stored,
        trailing=trailing,
        unknown_hashes=unknown,
        coding=coded,
    )
    return out


@dataclass(frozen=True)
class Extent:
    """How long a blob's header says the blob is (:func:`blob_extent`)."""

    header_len: int
    payload_len: int
    version: int

    @property
    def size(self) -> int:
        """Header and payload: the bytes a blob of this header holds (v2: exactly; v1: at least)."""
        return self.header_len + self.payload_len


def _hash_table_end(mv: memoryview, off: int) -> int:
    """Offset just past the hash pairs starting at ``off`` (the count), or ``-(bytes needed)``."""
    n = len(mv)
    if off + 2 > n:
        return -(off + 2)
    (pairs,) = HASH_PAIR_COUNT.unpack_from(mv, off)
    if pairs > MAX_HASH_PAIRS:
        raise CorruptEncodedKVError(
            f"hash count {pairs} exceeds the limit of {MAX_HASH_PAIRS}", reason=Reason.BAD_HASH_TABLE
        )
    off += 2
    for _ in range(2 * pairs):
        if off + 2 > n:
            return -(off + 2)
        off += 2 + (mv[off] | (mv[off + 1] << 8))
    return off


def blob_extent(prefix: Any) -> Extent | int:
    """The extent the header at the start of ``prefix`` declares, or how many bytes are needed to tell.

    For readers that must not read (or allocate) more than a blob really holds:
    read :data:`~kvcodec.format.FIXED_HEADER_LEN` bytes, call this, read up to
    the returned count while it is an int, then compare :attr:`Extent.size`
    with the object's size before reading the payload. The fixed fields and
    section lengths are checked as :func:`parse` checks them (same errors);
    the rest of the header is left to ``parse``.
    """
    mv = as_bytes_view(prefix)
    if len(mv) < FIXED_HEADER.size:
        return FIXED_HEADER.size
    r = _Reader(mv)
    fixed, n_scale = _read_fixed(r)
    sizes_end = r.off + SCALE_DIM.size * n_scale + PAYLOAD_LENS.size
    if len(mv) < sizes_end:
        return sizes_end
    sizes = _read_sizes(r, n_scale)
    end = _hash_table_end(mv, r.off)
    if end < 0:
        return -end
    header_len = end + CRC_FIELD.size
    if len(mv) < header_len:
        return header_len
    payload = sizes["k_payload_len"] + sizes["v_payload_len"] + sizes["scale_payload_len"]
    return Extent(header_len=header_len, payload_len=payload, version=fixed["version"])


def _elements(length: int, dtype: DType, what: str) -> int:
    if length % dtype.itemsize:
        raise CorruptEncodedKVError(
            f"{what} payload of {length} bytes is not a whole number of {dtype} elements",
            reason=Reason.INCONSISTENT_PAYLOAD,
        )
    return length // dtype.itemsize


def expected_scale_shape(
    scope: ScaleScope, tokens: int, heads: int, page_size: int
) -> tuple[int, ...] | None:
    """Scale shape a scope implies for a chunk, or None where it cannot be derived."""
    if scope == ScaleScope.PER_TENSOR:
        return ()
    if scope == ScaleScope.PER_LAYER_HEAD:
        return (heads,)
    if scope == ScaleScope.PER_PAGE_HEAD:
        return (-(-tokens // page_size), heads)
    return None


_SCALE_RANK = {scope: len(expected_scale_shape(scope, 1, 1, 1) or ()) for scope in COMPUTED_SCOPES}


def check_consistency(h: Header) -> None:
    """Cross-field checks the reference reader lacks (raises CorruptEncodedKVError)."""
    k_el = _elements(h.k_payload_len, h.k_dtype, "K")
    v_el = _elements(h.v_payload_len, h.v_dtype, "V")
    if k_el and not v_el:
        raise CorruptEncodedKVError(
            f"K holds {k_el} elements ({h.k_payload_len} bytes of {h.k_dtype}) but V is empty; "
            "a blob may omit K, never V",
            reason=Reason.INCONSISTENT_PAYLOAD,
        )
    if k_el and v_el and k_el != v_el:
        raise CorruptEncodedKVError(
            f"K holds {k_el} elements ({h.k_payload_len} bytes of {h.k_dtype}) but V holds "
            f"{v_el} ({h.v_payload_len} bytes of {h.v_dtype}); they must match",
            reason=Reason.INCONSISTENT_PAYLOAD,
        )
    elems = k_el or v_el
    heads, dim = h.kv_head_count, h.head_dim
    tokens: int | None = None
    if heads > 0 and dim > 0:
        per_tok = heads * dim
        if per_tok > MAX_ELEMENTS:
            raise CorruptEncodedKVError(
                f"kv_head_count*head_dim = {heads}*{dim} exceeds the limit of {MAX_ELEMENTS} elements per token",
                reason=Reason.LIMIT_EXCEEDED,
            )
        if elems % per_tok:
            raise CorruptEncodedKVError(
                f"payload holds {elems} elements per tensor, not a multiple of "
                f"kv_head_count*head_dim = {heads}*{dim}",
                reason=Reason.INCONSISTENT_PAYLOAD,
            )
        if k_el or v_el:
            tokens = elems // per_tok
        # A chunk may be partial (the last one of a sequence), never larger.
        if h.chunk_size >= 0 and tokens is not None and tokens > h.chunk_size:
            raise CorruptEncodedKVError(
                f"chunk_size={h.chunk_size} but the payload holds {tokens} tokens of {heads} heads x {dim}",
                reason=Reason.INCONSISTENT_PAYLOAD,
            )

    scale_n = math.prod(h.scale_shape)
    if scale_n > MAX_ELEMENTS:
        raise CorruptEncodedKVError(
            f"scale_shape {h.scale_shape} describes more than {MAX_ELEMENTS} scales",
            reason=Reason.LIMIT_EXCEEDED,
        )
    expect_s = scale_n * h.scale_dtype.itemsize
    if h.scale_scope == ScaleScope.EXTERNAL and h.scale_scheme == ScaleScheme.COMPUTED:
        # External scales live out of band; LMCache still stores them when the
        # caller attached them, and then they must fill scale_shape exactly.
        if h.scale_payload_len not in (0, expect_s):
            raise CorruptEncodedKVError(
                f"scale_payload_len={h.scale_payload_len} but an external scope stores either "
                f"no scales (0) or all of scale_shape {h.scale_shape} of {h.scale_dtype} ({expect_s})",
                reason=Reason.BAD_SCALE_SHAPE,
            )
        return
    if h.scale_scheme == ScaleScheme.LATENT:
        check_latent(h, CorruptEncodedKVError, Reason.INCONSISTENT_PAYLOAD)
        return
    no_scales = h.scale_scope == ScaleScope.NONE or h.scale_scheme == ScaleScheme.UNIT
    if no_scales:
        if h.scale_payload_len:
            raise CorruptEncodedKVError(
                f"scale_payload_len={h.scale_payload_len} but scope {h.scale_scope.name} / "
                f"scheme {h.scale_scheme.name} stores no scales; expected 0",
                reason=Reason.BAD_SCALE_SHAPE,
            )
        return
    if h.scale_payload_len != expect_s and not (h.scale_payload_len == 0 and not v_el):
        raise CorruptEncodedKVError(
            f"scale_payload_len={h.scale_payload_len} but scale_shape {h.scale_shape} of "
            f"{h.scale_dtype} needs {expect_s} bytes",
            reason=Reason.BAD_SCALE_SHAPE,
        )
    if len(h.scale_shape) != _SCALE_RANK[h.scale_scope]:
        raise CorruptEncodedKVError(
            f"scale_shape {h.scale_shape} has {len(h.scale_shape)} dims; scope "
            f"{h.scale_scope.name} needs {_SCALE_RANK[h.scale_scope]}",
            reason=Reason.BAD_SCALE_SHAPE,
        )
    if heads > 0 and h.scale_scope != ScaleScope.PER_TENSOR and h.scale_shape[-1] != heads:
        raise CorruptEncodedKVError(
            f"scale_shape {h.scale_shape} does not end in kv_head_count={heads}",
            reason=Reason.BAD_SCALE_SHAPE,
        )
    if h.scale_scope == ScaleScope.PER_PAGE_HEAD and tokens is not None and h.page_size > 0:
        pages = -(-tokens // h.page_size)  # integer ceil: exact at any size
        if h.scale_shape[0] != pages:
            raise CorruptEncodedKVError(
                f"scale_shape {h.scale_shape} has {h.scale_shape[0]} pages; {tokens} tokens "
                f"at page_size {h.page_size} make {pages}",
                reason=Reason.BAD_SCALE_SHAPE,
            )


_ITEM_CODES = {2: "H", 4: "I", 8: "Q"}
# A stored scale whose last byte (little-endian: sign and top exponent bits) lies in
# 0x01 .. (+Inf's last byte - 1) is finite and > 0 whatever its other bytes hold;
# any other last byte needs a look at the whole value.
_SAFE_LAST_BYTES = {
    dtype: bytes(range(1, inf >> (8 * (dtype.itemsize - 1)))) for dtype, inf in FLOAT_INF_BITS.items()
}


def check_stored_scales(h: Header, scales: Any) -> None:
    """Refuse stored scales encode never writes: NaN, ±Inf, zero or negative (:class:`CorruptEncodedKVError`).

    ``scales`` is the blob's scale section (:attr:`ParsedBlob.scales`, or any
    buffer of those bytes). Scale dtypes without an IEEE Inf (none the codec
    writes) are left to the decoder. Pure Python at C speed: one strided byte
    copy and one ``translate`` over one byte per scale; whole values are read
    only when a last byte is unusual.
    """
    inf = FLOAT_INF_BITS.get(h.scale_dtype)
    if inf is None:
        return
    if type(scales) is not memoryview or scales.format != "B":
        scales = as_bytes_view(scales)
    if not len(scales):
        return
    size = h.scale_dtype.itemsize
    if len(scales) % size:
        raise CorruptEncodedKVError(
            f"scale payload of {len(scales)} bytes is not a whole number of {h.scale_dtype} scales",
            reason=Reason.BAD_SCALE_SHAPE,
        )
    if not scales.tobytes()[size - 1 :: size].translate(None, _SAFE_LAST_BYTES[h.scale_dtype]):
        return
    for i, (bits,) in enumerate(struct.iter_unpack("<" + _ITEM_CODES[size], scales)):
        if not 0 < bits < inf:
            raise CorruptEncodedKVError(
                f"stored scale #{i} ({_scale_group(h, i)}) is {_describe_scale(h.scale_dtype, bits, inf)}; "
                "encode writes only finite scales > 0, and V would decode to NaN, Inf, zeros or flipped signs",
                reason=Reason.BAD_SCALE,
            )


# FP8 codes that decode to NaN or ±Inf (sign bit either way); encode writes none of them.
_NONFINITE_CODES: dict[DType, bytes] = {
    FLOAT8_E4M3FN: bytes((0x7F, 0xFF)),
    FLOAT8_E5M2: bytes((*range(0x7C, 0x80), *range(0xFC, 0x100))),
}
_FINITE_CODES = {dt: bytes(sorted(set(range(256)) - set(bad))) for dt, bad in _NONFINITE_CODES.items()}


def check_v_codes(h: Header, v: Any) -> None:
    """Refuse V codes encode never writes: FP8 NaN codes (e4m3fn ``0x7F``/``0xFF``; e5m2 also ±Inf).

    ``v`` is the blob's V section (:attr:`ParsedBlob.v`). Such a blob decodes
    V to NaN (or Inf) in the named group; its CRC says nothing, since whoever
    wrote the codes sealed them. V dtypes other than FP8 are left to the decoder.
    One byte copy and one ``translate`` over V, at C speed.
    """
    finite = _FINITE_CODES.get(h.v_dtype)
    if finite is None:
        return
    data = as_bytes_view(v).tobytes()
    left = data.translate(None, finite)
    if not left:
        return
    first = min(i for code in set(left) if (i := data.find(bytes((code,)))) >= 0)
    raise CorruptEncodedKVError(
        f"V holds {len(left)} {h.v_dtype} code(s) that decode to NaN or Inf, the first "
        f"({data[first]:#04x}) at element {first} ({v_group(h, first)}); encode never writes them",
        reason=Reason.BAD_CODE,
    )


def v_group(h: Header, element: int) -> str:
    """Where V element ``element`` lies: token and head, and its scale group in the scope's terms."""
    heads, dim = h.kv_head_count, h.head_dim
    if heads <= 0 or dim <= 0:
        return f"element {element}; the layout fields are unset"
    token, head = divmod(element // dim, heads)
    where = f"token {token}, head {head}"
    if h.scale_scope == ScaleScope.PER_PAGE_HEAD and h.page_size > 0 and len(h.scale_shape) == 2:
        return f"{where}: scale group {_scale_group(h, (token // h.page_size) * heads + head)}"
    if h.scale_scope in (ScaleScope.PER_LAYER_HEAD, ScaleScope.PER_TENSOR):
        return f"{where}: scale group {_scale_group(h, head)}"
    return where


def _scale_group(h: Header, i: int) -> str:
    """Which group scale ``i`` belongs to, in the scope's terms."""
    if h.scale_scope == ScaleScope.PER_TENSOR:
        return "the whole tensor"
    if h.scale_scope == ScaleScope.PER_LAYER_HEAD:
        return f"head {i}"
    if h.scale_scope == ScaleScope.PER_PAGE_HEAD and len(h.scale_shape) == 2:
        page, head = divmod(i, h.scale_shape[1])
        return f"page {page}, head {head}"
    return f"index {i} of scale_shape {h.scale_shape}"


def _describe_scale(dtype: DType, bits: int, inf: int) -> str:
    """NaN, +Inf, -Inf, 0, -0 or the negative value a scale's bits hold."""
    sign = 1 << (8 * dtype.itemsize - 1)
    magnitude = bits & (sign - 1)
    if magnitude > inf:
        return "NaN"
    if magnitude == inf:
        return "-Inf" if bits & sign else "+Inf"
    if magnitude == 0:
        return "-0" if bits & sign else "0"
    if dtype.itemsize == 2 and dtype.name == "bfloat16":
        value = struct.unpack("<f", (bits << 16).to_bytes(4, "little"))[0]
    else:
        value = struct.unpack(
            "<" + {2: "e", 4: "f", 8: "d"}[dtype.itemsize], bits.to_bytes(dtype.itemsize, "little")
        )[0]
    return f"negative ({value:.4g})"


def header_fields(h: Header) -> dict[str, Any]:
    """The header as plain JSON-friendly values (for CLIs and reports)."""
    out: dict[str, Any] = {}
    for f in fields(h):
        val = getattr(h, f.name)
        if isinstance(val, DType):
            val = val.name
        elif isinstance(val, IntEnum):
            val = val.name
        elif isinstance(val, Hashes):
            val = val.as_dict()
        elif isinstance(val, tuple):
            val = list(val)
        out[f.name] = val
    return out
