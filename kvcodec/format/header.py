"""The LMCKV header: its fields as Python values, its limits, and its writer.

The byte layout is LMCache's ``lmcache.v1.kv_codec`` format (``docs/FORMAT.md``
has the byte table, checked against the layouts here by a test): a
little-endian header followed by the payload ``K ‖ V ‖ scales``. Version 1
puts a CRC-32 over the payload only; version 2 seals the header too (CRC over
the header up to the CRC field, then the payload) and uses the reserved slot
at byte 18 for a :class:`ScaleScheme`. Pure Python (``struct``, memoryview).
"""

from __future__ import annotations

import functools
import operator
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

from ..errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from .buffer import as_bytes_view
from .crc import crc32
from .dtypes import FLOAT32, DType, as_dtype, dtype_to_id

__all__ = [
    "COMPUTED_SCOPES",
    "CRC_FIELD",
    "DEFLATE_OF",
    "FIXED_FIELDS",
    "FIXED_HEADER",
    "FIXED_HEADER_LEN",
    "HASH_KEYS",
    "HASH_LEN",
    "HASH_PAIR_COUNT",
    "HUFFMAN_SCHEMES",
    "HUFF_OF",
    "IDS",
    "IDS_OFFSET",
    "LATENT_DTYPES",
    "LOSSLESS_OF",
    "MAGIC",
    "MAX_DIM",
    "MAX_ELEMENTS",
    "MAX_HASH_PAIRS",
    "MAX_HASH_STR",
    "MAX_PAYLOAD_LEN",
    "MAX_SCALE_DIMS",
    "PAYLOAD_LENS",
    "PLAIN_OF",
    "SCALE_DIM",
    "SCHEME",
    "SCHEME_OFFSET",
    "SCOPE_NAMES",
    "SPLIT_SCHEMES",
    "SUPPORTED_VERSIONS",
    "Hashes",
    "Header",
    "HeaderPacker",
    "ScaleScheme",
    "ScaleScope",
    "assemble",
    "check_crc",
    "check_latent",
    "header_size",
    "pack_header_into",
    "payload_crc",
    "restamp_header",
    "serialize_header",
]

MAGIC = b"LMCKV\x01\x00\x01"
"""First 8 bytes of every blob; never changes."""

# The byte layouts, in header order (docs/FORMAT.md's tables are checked against these).
FIXED_HEADER = struct.Struct("<8sHHHHHHqqqqqqq")
"""The fixed part at offset 0, one struct code per name of :data:`FIXED_FIELDS`."""
FIXED_FIELDS: tuple[str, ...] = (
    "magic",
    "version",
    "scale_scope",
    "k_dtype",
    "v_dtype",
    "scale_dtype",
    "scale_scheme",  # version 1: reserved, always 0
    "layer_id",
    "chunk_id",
    "chunk_size",
    "page_size",
    "kv_head_count",
    "head_dim",
    "scale_shape_n",
)
FIXED_HEADER_LEN = FIXED_HEADER.size  # 76
SCALE_DIM = struct.Struct("<q")
"""Each of the ``scale_shape_n`` scale dimensions, right after the fixed part."""
PAYLOAD_LENS = struct.Struct("<qqq")
"""k_payload_len, v_payload_len, scale_payload_len (bytes), after the scale dimensions."""
HASH_PAIR_COUNT = struct.Struct("<H")
"""How many (key, value) string pairs follow."""
HASH_LEN = struct.Struct("<H")
"""The byte length in front of each hash key and value (UTF-8, no terminator)."""
CRC_FIELD = struct.Struct("<I")
"""The CRC-32 (zlib polynomial) that ends the header."""
IDS = struct.Struct("<qq")
"""layer_id and chunk_id, adjacent in the fixed part at :data:`IDS_OFFSET` (patched by HeaderPacker)."""
IDS_OFFSET = struct.calcsize("<8sHHHHHH")  # 20

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
MAX_ELEMENTS = 1 << 48
"""Largest element count any product of layout fields may describe (heads x head_dim, pages x heads...)."""
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


COMPUTED_SCOPES: tuple[ScaleScope, ...] = (
    ScaleScope.PER_TENSOR,
    ScaleScope.PER_LAYER_HEAD,
    ScaleScope.PER_PAGE_HEAD,
)
"""The scopes whose scales encode computes from V and stores (their shapes: ``expected_scale_shape``)."""

SCOPE_NAMES: dict[str, ScaleScope] = {
    "per_tensor": ScaleScope.PER_TENSOR,
    "per_layer_head": ScaleScope.PER_LAYER_HEAD,
    "per_page_head": ScaleScope.PER_PAGE_HEAD,
    "external": ScaleScope.EXTERNAL,
    "raw": ScaleScope.NONE,
}
"""Each scope's name as users write it (``encode(scope=...)``, ``--scope``); ``raw``: FP8 at unit scale."""


class ScaleScheme(IntEnum):
    """Header v2's byte-18 slot: how V's scales were produced."""

    COMPUTED = 0
    """Scales computed from V and stored in the payload (per the scope)."""
    UNIT = 1
    """Raw FP8 at unit scale: no scale payload."""
    LATENT = 2
    """An MLA latent cache (version 2, scope NONE): V holds each token's whole latent entry
    (``kv_lora_rank`` latent then ``qk_rope_head_dim`` rope part, one "head") at its 16- or 32-bit
    dtype, bit for bit; no K, no scales. LMCache (version 1, schemes 0 and 1) reads none of it."""
    LOSSLESS = 3
    """COMPUTED's scales with a lossless payload (version 2, :mod:`~.coding`): K's high-byte plane and
    V's codes deflate-coded per head, K's low-byte plane raw. Decodes to COMPUTED's blob byte for byte.
    Read, no longer written: ``compression="lossless"`` writes :attr:`LOSSLESS_SPLIT`."""
    LOSSLESS_UNIT = 4
    """UNIT (raw FP8 at unit scale, no scales) with the same deflate-coded lossless payload."""
    LOSSLESS_HUFF = 5
    """COMPUTED's scales with the lossless payload's layout, each stream a four-lane canonical Huffman
    stream (:mod:`~.coding`, ``docs/FORMAT.md`` "Huffman stream"). Decodes to COMPUTED's blob byte for byte.
    Read, no longer written (``compress_blob(coder="huffman")`` on request)."""
    LOSSLESS_HUFF_UNIT = 6
    """UNIT with the same Huffman-coded lossless payload."""
    LOSSLESS_SPLIT = 7
    """COMPUTED's scales with LOSSLESS_HUFF's payload but for V: each head's stream codes V's exponents
    (bits 3..6 of a code, 16 symbols) and every code's sign and mantissa follow the streams, stored raw
    two a byte (``docs/FORMAT.md``, "Split V codes"): as small, and a decode's V takes up to three
    exponents a table lookup instead of one code. What ``compression="lossless"`` writes."""
    LOSSLESS_SPLIT_UNIT = 8
    """UNIT with the same split lossless payload."""
    COMPUTED_PER_TENSOR = 0
    """LMCache's name for COMPUTED (an alias)."""
    RAW_UNIT = 1
    """LMCache's name for UNIT (an alias)."""


LOSSLESS_OF: dict[ScaleScheme, ScaleScheme] = {
    ScaleScheme.COMPUTED: ScaleScheme.LOSSLESS_SPLIT,
    ScaleScheme.UNIT: ScaleScheme.LOSSLESS_SPLIT_UNIT,
}
"""Each plain scheme's lossless id as written today (a new id per scheme and coder, so that older
readers refuse it by its id)."""
HUFF_OF: dict[ScaleScheme, ScaleScheme] = {
    ScaleScheme.COMPUTED: ScaleScheme.LOSSLESS_HUFF,
    ScaleScheme.UNIT: ScaleScheme.LOSSLESS_HUFF_UNIT,
}
"""Each plain scheme's lossless id with whole V codes in its streams (schemes 5 and 6: still read;
written on request only)."""
DEFLATE_OF: dict[ScaleScheme, ScaleScheme] = {
    ScaleScheme.COMPUTED: ScaleScheme.LOSSLESS,
    ScaleScheme.UNIT: ScaleScheme.LOSSLESS_UNIT,
}
"""Each plain scheme's deflate-coded lossless id (schemes 3 and 4: still read; written on request only)."""
SPLIT_SCHEMES = frozenset(LOSSLESS_OF.values())
"""The lossless schemes whose V streams code V's exponents, its signs and mantissas stored raw."""
HUFFMAN_SCHEMES = SPLIT_SCHEMES | frozenset(HUFF_OF.values())
"""The lossless schemes whose streams are Huffman streams (the others' are raw deflate)."""
PLAIN_OF: dict[ScaleScheme, ScaleScheme] = {
    **{v: k for k, v in DEFLATE_OF.items()},
    **{v: k for k, v in HUFF_OF.items()},
    **{v: k for k, v in LOSSLESS_OF.items()},
}
"""Each lossless scheme's plain scheme: the blob it decodes to, byte for byte."""


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
                    f"unknown hash keys {sorted(unknown)}; expected some of {list(HASH_KEYS)}",
                    reason=Reason.BAD_HASH,
                )
            return cls(**{k: value.get(k) or "" for k in HASH_KEYS})
        try:
            return cls(**{k: getattr(value, k) or "" for k in HASH_KEYS})
        except AttributeError as e:
            raise UnsupportedConfigError(
                f"cannot read hashes from {type(value).__name__}: {e}", reason=Reason.BAD_HASH
            ) from None

    def as_dict(self) -> dict[str, str]:
        """The six fields, in check order."""
        return {k: getattr(self, k) for k in HASH_KEYS}


@dataclass(frozen=True)
class Header:
    """Every field of an LMCKV header, as typed Python values.

    Sizes are the payload section lengths in bytes. ``scale_scheme`` is only
    meaningful in version 2 (version 1 stores a reserved zero there).
    """

    k_dtype: DType
    v_dtype: DType
    scale_dtype: DType = FLOAT32
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

    def __post_init__(self) -> None:
        # Accept a DType, its name, or a framework dtype (torch.float16) for each dtype field.
        for name in ("k_dtype", "v_dtype", "scale_dtype"):
            value = getattr(self, name)
            if not isinstance(value, DType):
                object.__setattr__(self, name, as_dtype(value))
        if not isinstance(self.hashes, Hashes):  # a mapping or an object with the six fields
            object.__setattr__(self, "hashes", Hashes.coerce(self.hashes))

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

    def derived(self, **changes: Any) -> Header:
        """A copy with ``changes`` applied field for field, nothing checked or coerced: for values the
        caller has checked (``replace`` costs ten times as much; ``Header`` checks no ranges when built,
        the parser's consistency checks do)."""
        out = object.__new__(Header)
        out.__dict__.update(self.__dict__, **changes)
        return out

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
            raise UnsupportedConfigError(
                f"hash {k!r} is a {type(val).__name__}; expected str", reason=Reason.BAD_HASH
            )
        try:
            vb = val.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UnsupportedConfigError(
                f"hash {k!r} cannot be encoded as UTF-8: {e.reason}", reason=Reason.BAD_HASH
            ) from None
        if len(vb) > MAX_HASH_STR:
            raise UnsupportedConfigError(
                f"hash {k!r} is {len(vb)} bytes in UTF-8; at most {MAX_HASH_STR} fit",
                reason=Reason.BAD_HASH,
            )
        out.append((kb, vb))
    return tuple(out)


_hash_pairs_cached = functools.lru_cache(maxsize=256)(_hash_pairs_of)


def header_size(h: Header) -> int:
    """Bytes the serialized header of ``h`` takes (CRC field included)."""
    n = FIXED_HEADER_LEN + SCALE_DIM.size * len(h.scale_shape) + PAYLOAD_LENS.size + HASH_PAIR_COUNT.size
    for kb, vb in _hash_pairs(h):
        n += 2 * HASH_LEN.size + len(kb) + len(vb)
    return n + CRC_FIELD.size


def _as_int(name: str, value: Any) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise UnsupportedConfigError(
            f"{name} is a {type(value).__name__}; expected an int", reason=Reason.BAD_TYPE
        ) from None


LATENT_DTYPES = ("float16", "bfloat16", "float32")
"""What a :attr:`ScaleScheme.LATENT` blob's V may be: a latent cache's own dtype, copied exactly."""


def check_latent(h: Header, error: type[Exception], reason: Reason) -> None:
    """The rules of a :attr:`ScaleScheme.LATENT` blob (version 2, scope NONE, a 16/32-bit V, no K,
    no scales), each broken one raised as ``error(reason=reason)``."""
    problems = []
    if h.version < 2 or h.scale_scope != ScaleScope.NONE:
        problems.append(f"version {h.version} scope {ScaleScope(h.scale_scope).name} (needs 2, NONE)")
    if h.v_dtype.name not in LATENT_DTYPES:
        problems.append(f"V of {h.v_dtype.name} (needs one of {LATENT_DTYPES})")
    if h.k_payload_len or h.scale_payload_len:
        problems.append(f"{h.k_payload_len} K and {h.scale_payload_len} scale bytes (needs none)")
    if problems:
        raise error(f"scale scheme LATENT (an MLA latent entry): {'; '.join(problems)}", reason=reason)


def _check_writable_header(h: Header) -> None:
    """Refuse (UnsupportedConfigError) any field the parser would refuse or struct cannot pack."""
    if _as_int("version", h.version) not in SUPPORTED_VERSIONS:
        raise UnsupportedConfigError(
            f"header version {h.version} unsupported; expected 1 or 2", reason=Reason.UNSUPPORTED_VERSION
        )
    try:
        scope = ScaleScope(h.scale_scope)
    except ValueError:
        raise UnsupportedConfigError(
            f"scale_scope {h.scale_scope!r} unknown; expected one of {[s.name for s in ScaleScope]}",
            reason=Reason.BAD_SCOPE,
        ) from None
    try:
        scheme = ScaleScheme(h.scale_scheme)
    except ValueError:
        raise UnsupportedConfigError(
            f"scale_scheme {h.scale_scheme!r} unknown; expected one of {[s.name for s in ScaleScheme]}",
            reason=Reason.BAD_VALUE,
        ) from None
    if h.version == 1 and (scope == ScaleScope.NONE or scheme != ScaleScheme.COMPUTED):
        raise UnsupportedConfigError(
            "scale scope NONE and scale scheme UNIT need header version 2; got version 1 with "
            f"scope {scope.name} and scheme {scheme.name}",
            reason=Reason.BAD_VALUE,
        )
    if scheme == ScaleScheme.LATENT:
        check_latent(h, UnsupportedConfigError, Reason.BAD_VALUE)
    if not isinstance(h.hashes, Hashes):
        raise UnsupportedConfigError(
            f"hashes is a {type(h.hashes).__name__}; expected Hashes (see Hashes.coerce)",
            reason=Reason.BAD_TYPE,
        )
    for name in ("layer_id", "chunk_id"):
        v = _as_int(name, getattr(h, name))
        if not -1 <= v <= _I64_MAX:
            raise UnsupportedConfigError(
                f"{name}={v} out of range: expected -1 (unset) or 0..{_I64_MAX}", reason=Reason.BAD_VALUE
            )
    for name, minimum in _LAYOUT_MINIMUMS:
        v = _as_int(name, getattr(h, name))
        if v != -1 and not minimum <= v <= MAX_DIM:
            raise UnsupportedConfigError(
                f"{name}={v} out of range: expected -1 (unset) or {minimum}..{MAX_DIM}",
                reason=Reason.BAD_VALUE,
            )
    if not isinstance(h.scale_shape, (tuple, list)):
        raise UnsupportedConfigError(
            f"scale_shape is a {type(h.scale_shape).__name__}; expected a tuple of ints",
            reason=Reason.BAD_TYPE,
        )
    if len(h.scale_shape) > MAX_SCALE_DIMS:
        raise UnsupportedConfigError(
            f"scale_shape has {len(h.scale_shape)} dims; at most {MAX_SCALE_DIMS}",
            reason=Reason.SCALE_RANK_OUT_OF_RANGE,
        )
    for i, d in enumerate(h.scale_shape):
        d = _as_int(f"scale_shape[{i}]", d)
        if not 0 <= d <= MAX_DIM:
            raise UnsupportedConfigError(
                f"scale_shape[{i}]={d} out of range 0..{MAX_DIM}", reason=Reason.BAD_VALUE
            )
    for name in ("k_payload_len", "v_payload_len", "scale_payload_len"):
        v = _as_int(name, getattr(h, name))
        if not 0 <= v <= MAX_PAYLOAD_LEN:
            reason = Reason.NEGATIVE_PAYLOAD_LEN if v < 0 else Reason.FIELD_OUT_OF_RANGE
            raise UnsupportedConfigError(f"{name}={v} outside 0..{MAX_PAYLOAD_LEN}", reason=reason)


class HeaderPacker:
    """Packs many headers that differ only in layer_id / chunk_id, fast.

    The template is validated and serialized once; each :meth:`pack_into`
    copies its bytes and patches the two ids (int64 at offsets 20 and 28) and
    the CRC, about a microsecond instead of a full serialization. For a
    32-layer chunk this keeps header packing off the connector's critical path.
    """

    __slots__ = ("_crc_off", "_template", "header", "size")

    def __init__(self, template: Header) -> None:
        self.header = template
        self.size = header_size(template)
        buf = bytearray(self.size)
        pack_header_into(buf, template, 0)  # validates every field
        self._template = bytes(buf)
        self._crc_off = self.size - CRC_FIELD.size

    def pack_into(
        self, buf: Any, *, layer_id: int, chunk_id: int, payload: Any = None, crc: int | None = None
    ) -> int:
        """Write the header for (layer_id, chunk_id) at the start of ``buf``; return its size.

        The CRC is ``crc`` if given, else computed from ``payload`` (with the
        header prefix too in version 2). Ids are checked as the parser would.
        """
        layer_id, chunk_id = _as_int("layer_id", layer_id), _as_int("chunk_id", chunk_id)
        if layer_id < -1 or chunk_id < -1:
            raise UnsupportedConfigError(
                f"layer_id={layer_id}, chunk_id={chunk_id}: expected -1 or >= 0", reason=Reason.BAD_VALUE
            )
        mv = buf if type(buf) is memoryview and buf.format == "B" and not buf.readonly else as_bytes_view(buf)
        if mv.readonly or len(mv) < self.size:
            raise UnsupportedConfigError(
                f"cannot write a {self.size}-byte header into {type(buf).__name__} "
                f"({'read-only' if mv.readonly else f'{len(mv)} bytes'})",
                reason=Reason.BAD_OUTPUT,
            )
        mv[: self.size] = self._template
        try:
            IDS.pack_into(mv, IDS_OFFSET, layer_id, chunk_id)
        except struct.error as e:
            raise UnsupportedConfigError(
                f"layer_id={layer_id}, chunk_id={chunk_id}: {e}", reason=Reason.BAD_VALUE
            ) from None
        if crc is None:
            parts = () if payload is None else (payload,)
            crc = payload_crc(self.header, mv[: self._crc_off], parts)
        CRC_FIELD.pack_into(mv, self._crc_off, crc & 0xFFFFFFFF)
        return self.size


def pack_header_into(buf: Any, h: Header, crc: int) -> int:
    """Write the header of ``h`` with CRC field ``crc`` at the start of ``buf``; return its size.

    ``buf`` is any writable buffer at least :func:`header_size` long.
    """
    _check_writable_header(h)
    mv = as_bytes_view(buf)
    if mv.readonly:
        raise UnsupportedConfigError(
            f"cannot write a header into read-only {type(buf).__name__}", reason=Reason.BAD_OUTPUT
        )
    size = header_size(h)
    if len(mv) < size:
        raise UnsupportedConfigError(
            f"buffer of {len(mv)} bytes cannot hold a {size}-byte header", reason=Reason.BAD_OUTPUT
        )
    _pack_prefix(mv, h)
    CRC_FIELD.pack_into(mv, size - 4, crc & 0xFFFFFFFF)
    return size


def _pack_prefix(mv: memoryview, h: Header) -> int:
    """Write everything before the CRC field; return the CRC field's offset."""
    reserved = int(h.scale_scheme) if h.version >= 2 else 0
    FIXED_HEADER.pack_into(
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
        SCALE_DIM.pack_into(mv, off, int(d))
        off += 8
    PAYLOAD_LENS.pack_into(mv, off, h.k_payload_len, h.v_payload_len, h.scale_payload_len)
    off += PAYLOAD_LENS.size
    pairs = _hash_pairs(h)
    HASH_PAIR_COUNT.pack_into(mv, off, len(pairs))
    off += HASH_PAIR_COUNT.size
    for kb, vb in pairs:
        for s in (kb, vb):
            HASH_LEN.pack_into(mv, off, len(s))
            off += HASH_LEN.size
            mv[off : off + len(s)] = s
            off += len(s)
    return off


SCHEME = struct.Struct("<H")
SCHEME_OFFSET = struct.calcsize("<8sHHHHH")  # 18
"""Where version 2's scale_scheme (version 1's reserved field) lies in the fixed part."""


def restamp_header(
    mv: memoryview, h: Header, header_len: int, *, scale_scheme: int, k_payload_len: int, v_payload_len: int
) -> None:
    """Turn version-2 header ``h``, stored in ``mv[:header_len]`` (as parsed: any hash pairs kept) with
    its payload after it, into the header that differs from it only in its scale scheme and K and V
    lengths (the lossless stage's coded header over its plain one), with the CRC over the payload now
    there: three fields patched in place, no serialization (a tenth of :func:`serialize_header`'s cost)."""
    if h.version < 2:
        raise UnsupportedConfigError("restamp_header writes version 2 headers", reason=Reason.BAD_VALUE)
    ScaleScheme(scale_scheme)  # a known scheme, else ValueError (a caller's bug)
    for name, n in (("k_payload_len", k_payload_len), ("v_payload_len", v_payload_len)):
        if not 0 <= n <= MAX_PAYLOAD_LEN:
            raise UnsupportedConfigError(
                f"{name}={n} outside 0..{MAX_PAYLOAD_LEN}", reason=Reason.FIELD_OUT_OF_RANGE
            )
    SCHEME.pack_into(mv, SCHEME_OFFSET, int(scale_scheme))
    lens_at = FIXED_HEADER_LEN + SCALE_DIM.size * len(h.scale_shape)
    PAYLOAD_LENS.pack_into(mv, lens_at, k_payload_len, v_payload_len, h.scale_payload_len)
    crc_at, end = (
        header_len - CRC_FIELD.size,
        header_len + k_payload_len + v_payload_len + h.scale_payload_len,
    )
    CRC_FIELD.pack_into(mv, crc_at, payload_crc(h, mv[:crc_at], (mv[header_len:end],)))


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
            f"{'header+' if h.version >= 2 else ''}payload gives {got:#010x}",
            reason=Reason.CRC_MISMATCH,
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
        parts = [as_bytes_view(p) for p in (payload or ())]
        got = sum(len(p) for p in parts)
        if got != h.payload_len:
            raise UnsupportedConfigError(
                f"payload is {got} bytes but the header declares K({h.k_payload_len}) + "
                f"V({h.v_payload_len}) + scales({h.scale_payload_len}) = {h.payload_len}",
                reason=Reason.INCONSISTENT_PAYLOAD,
            )
        crc = payload_crc(h, mv[:crc_off], parts)
    CRC_FIELD.pack_into(mv, crc_off, crc & 0xFFFFFFFF)
    return bytes(buf)


def assemble(h: Header, k: Any = b"", v: Any = b"", scales: Any = b"") -> bytearray:
    """One buffer holding header and payload, with lengths and CRC filled in from the parts."""
    parts = [as_bytes_view(p) for p in (k, v, scales)]
    h = h.replace(k_payload_len=len(parts[0]), v_payload_len=len(parts[1]), scale_payload_len=len(parts[2]))
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
    CRC_FIELD.pack_into(mv, crc_off, crc)
    return out
