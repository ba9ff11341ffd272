"""LMCKV blob format: header model, serializer and a zero-copy, bounds-checked parser.

The byte layout is LMCache's ``lmcache.v1.kv_codec`` format (see FORMAT.md):
a little-endian header followed by the payload ``K ‖ V ‖ scales``. Version 1
puts a CRC-32 over the payload only; version 2 seals the header too (CRC over
the header up to the CRC field, then the payload) and uses the reserved slot
at byte 18 for a :class:`ScaleScheme`.

The parser checks every bound before slicing (memoryview slices truncate
silently), bounds every integer by a named limit, and raises exactly one
:class:`~kvcodec.errors.CodecError` subclass per failure. ``parse`` returns
memoryviews into the caller's buffer; nothing of the payload is copied.
"""

from __future__ import annotations

import functools
import math
import operator
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum
from typing import Any

import torch

from .crc import crc32
from .errors import CorruptEncodedKVError, UnsupportedConfigError

__all__ = [
    "DTYPE_TO_ID",
    "FIXED_HEADER_LEN",
    "HASH_KEYS",
    "ID_TO_DTYPE",
    "MAGIC",
    "MAX_DIM",
    "MAX_HASH_PAIRS",
    "MAX_PAYLOAD_LEN",
    "MAX_SCALE_DIMS",
    "Hashes",
    "Header",
    "HeaderPacker",
    "ParsedBlob",
    "ScaleScheme",
    "ScaleScope",
    "assemble",
    "check_crc",
    "dtype_to_id",
    "header_size",
    "id_to_dtype",
    "pack_header_into",
    "parse",
    "payload_crc",
    "serialize_header",
]

MAGIC = b"LMCKV\x01\x00\x01"
"""First 8 bytes of every blob; never changes."""

_FIXED_FMT = "<8sHHHHHHqqqqqqq"
_FIXED = struct.Struct(_FIXED_FMT)
FIXED_HEADER_LEN = _FIXED.size  # 76
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_LENS = struct.Struct("<qqq")

#: Hash keys in the order writers emit them and readers check them.
HASH_KEYS: tuple[str, ...] = (
    "model_id",
    "model_revision_hash",
    "tokenizer_hash",
    "rope_config_hash",
    "attention_backend",
    "kv_layout",
)

# Named limits. They bound what a hostile header can make us compute or
# allocate; real KV chunks are far below each.
MAX_SCALE_DIMS = 8
"""Most scale dimensions a header may declare (the reference's limit)."""
MAX_DIM = 1 << 40
"""Largest value of any layout field or scale dimension."""
MAX_PAYLOAD_LEN = 1 << 48
"""Largest payload section length (256 TiB); also capped by the buffer's size."""
MAX_HASH_PAIRS = 256
"""Most (key, value) string pairs a header may carry."""
MAX_HASH_STR = 0xFFFF
"""Longest hash key or value in bytes (u16 length prefix)."""

SUPPORTED_VERSIONS = (1, 2)

_I64_MAX = (1 << 63) - 1
# Layout fields and the smallest value each may take (-1 always means unset).
_LAYOUT_MINIMUMS = (("chunk_size", 0), ("page_size", 1), ("kv_head_count", 1), ("head_dim", 1))


class ScaleScope(IntEnum):
    """How V's scales are grouped. ``NONE`` exists only in header version 2."""

    PER_TENSOR = 0
    PER_LAYER_HEAD = 1
    PER_PAGE_HEAD = 2
    EXTERNAL = 3
    NONE = 4


class ScaleScheme(IntEnum):
    """Header v2's byte-18 slot: how V's scales were produced."""

    COMPUTED = 0
    """Scales computed from V and stored in the payload (per the scope)."""
    UNIT = 1
    """Raw FP8 at unit scale: no scale payload."""


# LMCache's protocol dtype table. Id 1 and 2 both mean float16; writers emit 2.
ID_TO_DTYPE: dict[int, torch.dtype] = {
    1: torch.float16,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.float32,
    5: torch.float64,
    6: torch.uint8,
    7: torch.float8_e4m3fn,
    8: torch.float8_e5m2,
}
DTYPE_TO_ID: dict[torch.dtype, int] = {
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float32: 4,
    torch.float64: 5,
    torch.uint8: 6,
    torch.float8_e4m3fn: 7,
    torch.float8_e5m2: 8,
}


def dtype_to_id(dtype: torch.dtype) -> int:
    """Protocol id of ``dtype``; :class:`UnsupportedConfigError` if it has none."""
    try:
        return DTYPE_TO_ID[dtype]
    except KeyError:
        raise UnsupportedConfigError(
            f"dtype {dtype} has no LMCKV dtype id; expected one of "
            f"{sorted(str(d) for d in DTYPE_TO_ID)}"
        ) from None


def id_to_dtype(idx: int, what: str = "dtype") -> torch.dtype:
    """dtype of protocol id ``idx``; :class:`CorruptEncodedKVError` if unknown (0 too)."""
    try:
        return ID_TO_DTYPE[idx]
    except KeyError:
        raise CorruptEncodedKVError(
            f"unknown {what} id {idx} in header; expected one of {sorted(ID_TO_DTYPE)}"
        ) from None


@dataclass(frozen=True)
class Hashes:
    """Identity strings that gate cross-model cache poisoning ("" = not provided)."""

    model_id: str = ""
    model_revision_hash: str = ""
    tokenizer_hash: str = ""
    rope_config_hash: str = ""
    attention_backend: str = ""
    kv_layout: str = ""

    @classmethod
    def coerce(cls, value: Hashes | Mapping[str, str | None] | Any | None) -> Hashes:
        """Build from a Hashes, a mapping, any object with the six attributes, or None."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - set(HASH_KEYS)
            if unknown:
                raise UnsupportedConfigError(
                    f"unknown hash keys {sorted(unknown)}; expected some of {list(HASH_KEYS)}"
                )
            return cls(**{k: value.get(k) or "" for k in HASH_KEYS})
        try:
            return cls(**{k: getattr(value, k) or "" for k in HASH_KEYS})
        except AttributeError as e:
            raise UnsupportedConfigError(f"cannot read hashes from {type(value).__name__}: {e}") from None

    def as_dict(self) -> dict[str, str]:
        """The six fields, in check order."""
        return {k: getattr(self, k) for k in HASH_KEYS}


@dataclass(frozen=True)
class Header:
    """Every field of an LMCKV header, as typed Python values.

    Sizes are the payload section lengths in bytes. ``scale_scheme`` is only
    meaningful in version 2 (version 1 stores a reserved zero there).
    """

    k_dtype: torch.dtype
    v_dtype: torch.dtype
    scale_dtype: torch.dtype = torch.float32
    scale_scope: ScaleScope = ScaleScope.PER_PAGE_HEAD
    version: int = 1
    scale_scheme: ScaleScheme = ScaleScheme.COMPUTED
    layer_id: int = -1
    chunk_id: int = -1
    chunk_size: int = -1
    page_size: int = -1
    kv_head_count: int = -1
    head_dim: int = -1
    scale_shape: tuple[int, ...] = ()
    k_payload_len: int = 0
    v_payload_len: int = 0
    scale_payload_len: int = 0
    hashes: Hashes = field(default_factory=Hashes)

    @property
    def payload_len(self) -> int:
        """K + V + scale bytes."""
        return self.k_payload_len + self.v_payload_len + self.scale_payload_len

    @property
    def header_len(self) -> int:
        """Serialized header size in bytes."""
        return header_size(self)

    @property
    def num_tokens(self) -> int | None:
        """Tokens held, from the payload and layout fields (None if they cannot tell)."""
        if self.kv_head_count <= 0 or self.head_dim <= 0:
            return self.chunk_size if self.chunk_size >= 0 else None
        per_tok = self.kv_head_count * self.head_dim
        if self.v_payload_len:
            return self.v_payload_len // (self.v_dtype.itemsize * per_tok)
        if self.k_payload_len:
            return self.k_payload_len // (self.k_dtype.itemsize * per_tok)
        return self.chunk_size if self.chunk_size >= 0 else 0

    def replace(self, **changes: Any) -> Header:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)


def _hash_pairs(h: Header) -> tuple[tuple[bytes, bytes], ...]:
    """The six (key, value) pairs as UTF-8, validated; memoized per Hashes (a model's are fixed)."""
    try:
        return _hash_pairs_cached(h.hashes)
    except TypeError:  # a non-str (unhashable) value: let the uncached path name it
        return _hash_pairs_of(h.hashes)


def _hash_pairs_of(hashes: Hashes) -> tuple[tuple[bytes, bytes], ...]:
    out = []
    for k in HASH_KEYS:
        kb = k.encode()
        val = getattr(hashes, k) or ""
        if not isinstance(val, str):
            raise UnsupportedConfigError(f"hash {k!r} is a {type(val).__name__}; expected str")
        try:
            vb = val.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UnsupportedConfigError(f"hash {k!r} cannot be encoded as UTF-8: {e.reason}") from None
        if len(vb) > MAX_HASH_STR:
            raise UnsupportedConfigError(
                f"hash {k!r} is {len(vb)} bytes in UTF-8; at most {MAX_HASH_STR} fit"
            )
        out.append((kb, vb))
    return tuple(out)


_hash_pairs_cached = functools.lru_cache(maxsize=256)(_hash_pairs_of)


def header_size(h: Header) -> int:
    """Bytes the serialized header of ``h`` takes (CRC field included)."""
    n = FIXED_HEADER_LEN + 8 * len(h.scale_shape) + 24 + 2
    for kb, vb in _hash_pairs(h):
        n += 4 + len(kb) + len(vb)
    return n + 4


def _as_int(name: str, value: Any) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise UnsupportedConfigError(f"{name} is a {type(value).__name__}; expected an int") from None


def _check_writable_header(h: Header) -> None:
    """Refuse (UnsupportedConfigError) any field the parser would refuse or struct cannot pack."""
    if h.version not in SUPPORTED_VERSIONS:
        raise UnsupportedConfigError(f"header version {h.version} unsupported; expected 1 or 2")
    try:
        scope = ScaleScope(h.scale_scope)
    except ValueError:
        raise UnsupportedConfigError(
            f"scale_scope {h.scale_scope!r} unknown; expected one of {[s.name for s in ScaleScope]}"
        ) from None
    try:
        scheme = ScaleScheme(h.scale_scheme)
    except ValueError:
        raise UnsupportedConfigError(
            f"scale_scheme {h.scale_scheme!r} unknown; expected one of {[s.name for s in ScaleScheme]}"
        ) from None
    if h.version == 1 and (scope == ScaleScope.NONE or scheme != ScaleScheme.COMPUTED):
        raise UnsupportedConfigError(
            "scale scope NONE and scale scheme UNIT need header version 2; got version 1 with "
            f"scope {scope.name} and scheme {scheme.name}"
        )
    if not isinstance(h.hashes, Hashes):
        raise UnsupportedConfigError(
            f"hashes is a {type(h.hashes).__name__}; expected Hashes (see Hashes.coerce)"
        )
    for name in ("layer_id", "chunk_id"):
        v = _as_int(name, getattr(h, name))
        if not -1 <= v <= _I64_MAX:
            raise UnsupportedConfigError(f"{name}={v} out of range: expected -1 (unset) or 0..{_I64_MAX}")
    for name, minimum in _LAYOUT_MINIMUMS:
        v = _as_int(name, getattr(h, name))
        if v != -1 and not minimum <= v <= MAX_DIM:
            raise UnsupportedConfigError(
                f"{name}={v} out of range: expected -1 (unset) or {minimum}..{MAX_DIM}"
            )
    if len(h.scale_shape) > MAX_SCALE_DIMS:
        raise UnsupportedConfigError(
            f"scale_shape has {len(h.scale_shape)} dims; at most {MAX_SCALE_DIMS}"
        )
    for i, d in enumerate(h.scale_shape):
        d = _as_int(f"scale_shape[{i}]", d)
        if not 0 <= d <= MAX_DIM:
            raise UnsupportedConfigError(f"scale_shape[{i}]={d} out of range 0..{MAX_DIM}")
    for name in ("k_payload_len", "v_payload_len", "scale_payload_len"):
        v = _as_int(name, getattr(h, name))
        if not 0 <= v <= MAX_PAYLOAD_LEN:
            raise UnsupportedConfigError(f"{name}={v} outside 0..{MAX_PAYLOAD_LEN}")


class HeaderPacker:
    """Packs many headers that differ only in layer_id / chunk_id, fast.

    The template is validated and serialized once; each :meth:`pack_into`
    copies its bytes and patches the two ids (int64 at offsets 20 and 28) and
    the CRC, about a microsecond instead of a full serialization. For a
    32-layer chunk this keeps header packing off the connector's critical path.
    """

    __slots__ = ("_crc_off", "_template", "header", "size")

    _IDS = struct.Struct("<qq")

    def __init__(self, template: Header) -> None:
        self.header = template
        self.size = header_size(template)
        buf = bytearray(self.size)
        pack_header_into(buf, template, 0)  # validates every field
        self._template = bytes(buf)
        self._crc_off = self.size - 4

    def pack_into(self, buf: Any, *, layer_id: int, chunk_id: int, payload: Any = None, crc: int | None = None) -> int:
        """Write the header for (layer_id, chunk_id) at the start of ``buf``; return its size.

        The CRC is ``crc`` if given, else computed from ``payload`` (with the
        header prefix too in version 2). Ids are checked as the parser would.
        """
        if layer_id < -1 or chunk_id < -1:
            raise UnsupportedConfigError(f"layer_id={layer_id}, chunk_id={chunk_id}: expected -1 or >= 0")
        mv = buf if type(buf) is memoryview and buf.format == "B" else memoryview(buf).cast("B")
        mv[: self.size] = self._template
        try:
            self._IDS.pack_into(mv, 20, layer_id, chunk_id)
        except struct.error as e:
            raise UnsupportedConfigError(f"layer_id={layer_id}, chunk_id={chunk_id}: {e}") from None
        if crc is None:
            parts = () if payload is None else (payload,)
            crc = payload_crc(self.header, mv[: self._crc_off], parts)
        _U32.pack_into(mv, self._crc_off, crc & 0xFFFFFFFF)
        return self.size


def pack_header_into(buf: Any, h: Header, crc: int) -> int:
    """Write the header of ``h`` with CRC field ``crc`` at the start of ``buf``; return its size.

    ``buf`` is any writable buffer at least :func:`header_size` long.
    """
    _check_writable_header(h)
    mv = _as_bytes_view(buf)
    if mv.readonly:
        raise UnsupportedConfigError(f"cannot write a header into read-only {type(buf).__name__}")
    size = header_size(h)
    if len(mv) < size:
        raise UnsupportedConfigError(f"buffer of {len(mv)} bytes cannot hold a {size}-byte header")
    _pack_prefix(mv, h)
    _U32.pack_into(mv, size - 4, crc & 0xFFFFFFFF)
    return size


def _pack_prefix(mv: memoryview, h: Header) -> int:
    """Write everything before the CRC field; return the CRC field's offset."""
    reserved = int(h.scale_scheme) if h.version >= 2 else 0
    _FIXED.pack_into(
        mv,
        0,
        MAGIC,
        h.version,
        int(h.scale_scope),
        dtype_to_id(h.k_dtype),
        dtype_to_id(h.v_dtype),
        dtype_to_id(h.scale_dtype),
        reserved,
        h.layer_id,
        h.chunk_id,
        h.chunk_size,
        h.page_size,
        h.kv_head_count,
        h.head_dim,
        len(h.scale_shape),
    )
    off = FIXED_HEADER_LEN
    for d in h.scale_shape:
        _I64.pack_into(mv, off, int(d))
        off += 8
    _LENS.pack_into(mv, off, h.k_payload_len, h.v_payload_len, h.scale_payload_len)
    off += 24
    pairs = _hash_pairs(h)
    _U16.pack_into(mv, off, len(pairs))
    off += 2
    for kb, vb in pairs:
        for s in (kb, vb):
            _U16.pack_into(mv, off, len(s))
            off += 2
            mv[off : off + len(s)] = s
            off += len(s)
    return off


def payload_crc(h: Header, header_prefix: Any, payload: Iterable[Any]) -> int:
    """CRC of a blob: payload parts only (v1), or header prefix then payload (v2)."""
    c = crc32(header_prefix) if h.version >= 2 else 0
    for part in payload:
        c = crc32(part, c)
    return c


def check_crc(h: Header, stored: int, got: int) -> None:
    """Raise :class:`CorruptEncodedKVError` when the CRC computed over a blob is not the one stored."""
    if got != stored:
        raise CorruptEncodedKVError(
            f"CRC mismatch: header says {stored:#010x}, "
            f"{'header+' if h.version >= 2 else ''}payload gives {got:#010x}"
        )


def serialize_header(h: Header, payload: Iterable[Any] | None = None, *, crc: int | None = None) -> bytes:
    """The header bytes of ``h``.

    The CRC is computed from ``payload`` (an iterable of buffers, K, V, scales
    in order) unless ``crc`` is given. The payload's total length must equal
    the lengths the header declares.
    """
    _check_writable_header(h)
    buf = bytearray(header_size(h))
    mv = memoryview(buf)
    crc_off = _pack_prefix(mv, h)
    if crc is None:
        parts = [_as_bytes_view(p) for p in (payload or ())]
        got = sum(len(p) for p in parts)
        if got != h.payload_len:
            raise UnsupportedConfigError(
                f"payload is {got} bytes but the header declares K({h.k_payload_len}) + "
                f"V({h.v_payload_len}) + scales({h.scale_payload_len}) = {h.payload_len}"
            )
        crc = payload_crc(h, mv[:crc_off], parts)
    _U32.pack_into(mv, crc_off, crc & 0xFFFFFFFF)
    return bytes(buf)


def assemble(h: Header, k: Any = b"", v: Any = b"", scales: Any = b"") -> bytearray:
    """One buffer holding header and payload, with lengths and CRC filled in from the parts."""
    parts = [_as_bytes_view(p) for p in (k, v, scales)]
    h = h.replace(
        k_payload_len=len(parts[0]), v_payload_len=len(parts[1]), scale_payload_len=len(parts[2])
    )
    _check_writable_header(h)
    hs = header_size(h)
    out = bytearray(hs + h.payload_len)
    mv = memoryview(out)
    off = hs
    for p in parts:
        mv[off : off + len(p)] = p
        off += len(p)
    crc_off = _pack_prefix(mv, h)
    crc = payload_crc(h, mv[:crc_off], [mv[hs:]])
    _U32.pack_into(mv, crc_off, crc)
    return out


# ----------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------


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


def _as_bytes_view(buf: Any) -> memoryview:
    if type(buf).__module__ == "torch" and isinstance(buf, torch.Tensor):
        # A host tensor (e.g. a pinned staging buffer): its bytes, without a copy.
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise UnsupportedConfigError(
                f"a tensor blob must be a contiguous CPU tensor; got {buf.device}, contiguous={buf.is_contiguous()}"
            )
        buf = buf.detach().view(-1).view(torch.uint8).numpy()
    try:
        mv = memoryview(buf)
    except TypeError:
        raise UnsupportedConfigError(
            f"expected a bytes-like buffer, got {type(buf).__name__}"
        ) from None
    if not mv.c_contiguous:
        raise UnsupportedConfigError(f"buffer must be C-contiguous; got a strided {type(buf).__name__}")
    if mv.ndim != 1 or mv.format != "B":
        try:
            mv = mv.cast("B")
        except (TypeError, ValueError) as e:
            raise UnsupportedConfigError(
                f"cannot view {type(buf).__name__} (format {mv.format!r}) as bytes: {e}"
            ) from None
    return mv


_SHAPE_STRUCTS = tuple(struct.Struct(f"<{n}q") for n in range(MAX_SCALE_DIMS + 1))


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
                f"{self.n - self.off} remain (buffer is {self.n} bytes)"
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
        length = mv[off] | (mv[off + 1] << 8)
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
            raise CorruptEncodedKVError(f"{what.format(*args)} at offset {off} is not UTF-8: {e.reason}") from None


def _check_layout_int(name: str, value: int, minimum: int) -> None:
    if value == -1:
        return
    if not minimum <= value <= MAX_DIM:
        raise CorruptEncodedKVError(
            f"{name}={value} out of range: expected -1 (unset) or {minimum}..{MAX_DIM}"
        )


def parse(buf: Any, *, verify_crc: bool = True, strict: bool = False) -> ParsedBlob:
    """Parse and validate an LMCKV blob without copying its payload.

    ``buf`` is any C-contiguous buffer (bytes, bytearray, memoryview, mmap,
    numpy array, ...). ``strict`` refuses trailing bytes after the payload in
    version 1 (version 2 always refuses them). ``verify_crc=False`` skips the
    checksum (for callers who verified it already); everything else is checked.
    """
    mv = _as_bytes_view(buf)
    r = _Reader(mv)
    (
        magic,
        version,
        scope_id,
        k_id,
        v_id,
        s_id,
        reserved,
        layer_id,
        chunk_id,
        chunk_size,
        page_size,
        kv_head_count,
        head_dim,
        n_scale,
    ) = r.unpack(_FIXED, "fixed header")
    if magic != MAGIC:
        raise CorruptEncodedKVError(f"bad magic: expected {MAGIC!r}, found {bytes(magic)!r}")
    if version not in SUPPORTED_VERSIONS:
        raise CorruptEncodedKVError(
            f"unknown header version {version}; expected one of {SUPPORTED_VERSIONS}"
        )
    max_scope = ScaleScope.NONE if version >= 2 else ScaleScope.EXTERNAL
    if not 0 <= scope_id <= max_scope:
        raise CorruptEncodedKVError(
            f"unknown scale_scope id {scope_id} for header version {version}; "
            f"expected 0..{int(max_scope)}"
        )
    scope = ScaleScope(scope_id)
    k_dtype = id_to_dtype(k_id, "k_dtype")
    v_dtype = id_to_dtype(v_id, "v_dtype")
    s_dtype = id_to_dtype(s_id, "scale_dtype")
    if version == 1:
        if reserved != 0:
            raise CorruptEncodedKVError(f"reserved field is {reserved}; expected 0 in version 1")
        scheme = ScaleScheme.COMPUTED
    else:
        if reserved not in (0, 1):
            raise CorruptEncodedKVError(f"unknown scale scheme {reserved}; expected 0 or 1")
        scheme = ScaleScheme(reserved)
    if not 0 <= n_scale <= MAX_SCALE_DIMS:
        raise CorruptEncodedKVError(
            f"scale_shape_n={n_scale} out of range: expected 0..{MAX_SCALE_DIMS}"
        )
    if layer_id < -1 or chunk_id < -1:
        raise CorruptEncodedKVError(
            f"layer_id={layer_id}, chunk_id={chunk_id}: expected -1 (unset) or >= 0"
        )
    _check_layout_int("chunk_size", chunk_size, 0)
    _check_layout_int("page_size", page_size, 1)
    _check_layout_int("kv_head_count", kv_head_count, 1)
    _check_layout_int("head_dim", head_dim, 1)

    scale_shape = r.unpack(_SHAPE_STRUCTS[n_scale], "scale_shape")
    for i, d in enumerate(scale_shape):
        if not 0 <= d <= MAX_DIM:
            raise CorruptEncodedKVError(f"scale_shape[{i}]={d} out of range 0..{MAX_DIM}")

    k_len, v_len, s_len = r.unpack(_LENS, "payload lengths")
    for name, n in (("k_payload_len", k_len), ("v_payload_len", v_len), ("scale_payload_len", s_len)):
        if not 0 <= n <= MAX_PAYLOAD_LEN:
            raise CorruptEncodedKVError(f"{name}={n} out of range 0..{MAX_PAYLOAD_LEN}")

    (n_pairs,) = r.unpack(_U16, "hash count")
    if n_pairs > MAX_HASH_PAIRS:
        raise CorruptEncodedKVError(f"hash count {n_pairs} exceeds the limit of {MAX_HASH_PAIRS}")
    known: dict[str, str] = {}
    unknown: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for i in range(n_pairs):
        key = r.string("hash key #{}", i)
        val = r.string("hash value #{} ({!r})", i, key)
        if key in seen:
            raise CorruptEncodedKVError(
                f"duplicate hash key {key!r}: pair #{i} repeats pair #{seen[key]}; expected unique keys"
            )
        seen[key] = i
        if key in HASH_KEYS:
            known[key] = val
        else:
            unknown.append((key, val))

    crc_off = r.off
    (crc_stored,) = r.unpack(_U32, "payload CRC")
    header_len = r.off

    # Overflow-safe: compare each length against what remains, never a raw sum.
    remaining = len(mv) - header_len
    for name, n in (("K payload", k_len), ("V payload", v_len), ("scale payload", s_len)):
        if n > remaining:
            raise CorruptEncodedKVError(
                f"truncated {name}: header declares {n} bytes, only {remaining} remain "
                f"(buffer is {len(mv)} bytes, header {header_len})"
            )
        remaining -= n
    payload_len = k_len + v_len + s_len
    trailing = remaining
    if trailing and (version >= 2 or strict):
        raise CorruptEncodedKVError(
            f"{trailing} trailing bytes after the payload (blob ends at "
            f"{header_len + payload_len}, buffer is {len(mv)} bytes)"
        )

    header = Header(
        k_dtype=k_dtype,
        v_dtype=v_dtype,
        scale_dtype=s_dtype,
        scale_scope=scope,
        version=version,
        scale_scheme=scheme,
        layer_id=layer_id,
        chunk_id=chunk_id,
        chunk_size=chunk_size,
        page_size=page_size,
        kv_head_count=kv_head_count,
        head_dim=head_dim,
        scale_shape=tuple(scale_shape),
        k_payload_len=k_len,
        v_payload_len=v_len,
        scale_payload_len=s_len,
        hashes=Hashes(**known),
    )

    if verify_crc:
        payload = mv[header_len : header_len + payload_len]
        check_crc(header, crc_stored, payload_crc(header, mv[:crc_off], (payload,)))
    _check_consistency(header)
    return ParsedBlob(
        header=header,
        buffer=mv,
        header_len=header_len,
        crc=crc_stored,
        trailing=trailing,
        unknown_hashes=tuple(unknown),
    )


def _elements(length: int, dtype: torch.dtype, what: str) -> int:
    if length % dtype.itemsize:
        raise CorruptEncodedKVError(
            f"{what} payload of {length} bytes is not a whole number of {dtype} elements"
        )
    return length // dtype.itemsize


def expected_scale_shape(scope: ScaleScope, tokens: int, heads: int, page_size: int) -> tuple[int, ...] | None:
    """Scale shape a scope implies for a chunk, or None where it cannot be derived."""
    if scope == ScaleScope.PER_TENSOR:
        return ()
    if scope == ScaleScope.PER_LAYER_HEAD:
        return (heads,)
    if scope == ScaleScope.PER_PAGE_HEAD:
        return (-(-tokens // page_size), heads)
    return None


def _check_consistency(h: Header) -> None:
    """Cross-field checks the reference reader lacks (raises CorruptEncodedKVError)."""
    k_el = _elements(h.k_payload_len, h.k_dtype, "K")
    v_el = _elements(h.v_payload_len, h.v_dtype, "V")
    if k_el and not v_el:
        raise CorruptEncodedKVError(
            f"K holds {k_el} elements ({h.k_payload_len} bytes of {h.k_dtype}) but V is empty; "
            "a blob may omit K, never V"
        )
    if k_el and v_el and k_el != v_el:
        raise CorruptEncodedKVError(
            f"K holds {k_el} elements ({h.k_payload_len} bytes of {h.k_dtype}) but V holds "
            f"{v_el} ({h.v_payload_len} bytes of {h.v_dtype}); they must match"
        )
    elems = k_el or v_el
    heads, dim = h.kv_head_count, h.head_dim
    tokens: int | None = None
    if heads > 0 and dim > 0:
        per_tok = heads * dim
        if elems % per_tok:
            raise CorruptEncodedKVError(
                f"payload holds {elems} elements per tensor, not a multiple of "
                f"kv_head_count*head_dim = {heads}*{dim}"
            )
        if k_el or v_el:
            tokens = elems // per_tok
        # A chunk may be partial (the last one of a sequence), never larger.
        if h.chunk_size >= 0 and tokens is not None and tokens > h.chunk_size:
            raise CorruptEncodedKVError(
                f"chunk_size={h.chunk_size} but the payload holds {tokens} tokens "
                f"of {heads} heads x {dim}"
            )

    scale_n = math.prod(h.scale_shape)
    expect_s = scale_n * h.scale_dtype.itemsize
    if h.scale_scope == ScaleScope.EXTERNAL and h.scale_scheme == ScaleScheme.COMPUTED:
        # External scales live out of band; LMCache still stores them when the
        # caller attached them, and then they must fill scale_shape exactly.
        if h.scale_payload_len not in (0, expect_s):
            raise CorruptEncodedKVError(
                f"scale_payload_len={h.scale_payload_len} but an external scope stores either "
                f"no scales (0) or all of scale_shape {h.scale_shape} of {h.scale_dtype} ({expect_s})"
            )
        return
    no_scales = h.scale_scope == ScaleScope.NONE or h.scale_scheme == ScaleScheme.UNIT
    if no_scales:
        if h.scale_payload_len:
            raise CorruptEncodedKVError(
                f"scale_payload_len={h.scale_payload_len} but scope {h.scale_scope.name} / "
                f"scheme {h.scale_scheme.name} stores no scales; expected 0"
            )
        return
    if h.scale_payload_len != expect_s and not (h.scale_payload_len == 0 and not v_el):
        raise CorruptEncodedKVError(
            f"scale_payload_len={h.scale_payload_len} but scale_shape {h.scale_shape} of "
            f"{h.scale_dtype} needs {expect_s} bytes"
        )
    want_dims = {ScaleScope.PER_TENSOR: 0, ScaleScope.PER_LAYER_HEAD: 1, ScaleScope.PER_PAGE_HEAD: 2}
    if len(h.scale_shape) != want_dims[h.scale_scope]:
        raise CorruptEncodedKVError(
            f"scale_shape {h.scale_shape} has {len(h.scale_shape)} dims; scope "
            f"{h.scale_scope.name} needs {want_dims[h.scale_scope]}"
        )
    if heads > 0 and h.scale_scope != ScaleScope.PER_TENSOR and h.scale_shape[-1] != heads:
        raise CorruptEncodedKVError(
            f"scale_shape {h.scale_shape} does not end in kv_head_count={heads}"
        )
    if h.scale_scope == ScaleScope.PER_PAGE_HEAD and tokens is not None and h.page_size > 0:
        pages = -(-tokens // h.page_size)  # integer ceil: exact at any size
        if h.scale_shape[0] != pages:
            raise CorruptEncodedKVError(
                f"scale_shape {h.scale_shape} has {h.scale_shape[0]} pages; {tokens} tokens "
                f"at page_size {h.page_size} make {pages}"
            )


def header_fields(h: Header) -> dict[str, Any]:
    """The header as plain JSON-friendly values (for CLIs and reports)."""
    out: dict[str, Any] = {}
    for f in fields(h):
        val = getattr(h, f.name)
        if isinstance(val, torch.dtype):
            val = str(val).removeprefix("torch.")
        elif isinstance(val, IntEnum):
            val = val.name
        elif isinstance(val, Hashes):
            val = val.as_dict()
        elif isinstance(val, tuple):
            val = list(val)
        out[f.name] = val
    return out
