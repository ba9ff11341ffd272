"""``lmcache.v1.kv_codec.encoded_kv``: LMCache's blob record and header functions, by kvcodec's parser.

:class:`EncodedKV` is LMCache's mutable record (header fields plus the payload
``K ‖ V ‖ scales``). Every record this layer hands out is built by one
constructor, :meth:`EncodedKV.from_header`, from a Header kvcodec wrote or
parsed; the record remembers that Header and its buffer, so ``to_bytes`` copies
once and decode reuses the Header while the caller leaves the fields alone.

Reading is bounded by the bytes present: :func:`deserialize_header` is
kvcodec's bounds-checked parser (header level: structure, bounds and CRC), and
nothing here allocates by a declared length before comparing it with the
buffer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

import torch

from ....codec.dtypes import to_torch
from ....errors import CodecError, CorruptEncodedKVError, Reason, UnsupportedConfigError
from ....format import (
    FIXED_HEADER_LEN,
    MAGIC,
    Hashes,
    Header,
    ParsedBlob,
    ScaleScope,
    as_bytes_view,
    header_size,
    parse,
)
from ....format import serialize_header as _serialize_header
from .errors import with_lmcache_phrase

__all__ = [
    "ASSERT_MAGIC_BYTES",
    "CODEC_MAGIC",
    "CODEC_MAGIC_LEN",
    "CodecHashes",
    "CodecVersion",
    "CorruptEncodedKVError",
    "EncodedKV",
    "ScaleScheme",
    "ScaleScope",
    "UnsupportedConfigError",
    "deserialize_header",
    "encoded_kv_header_size",
    "serialize_header",
]

CODEC_MAGIC: bytes = MAGIC
CODEC_MAGIC_LEN: int = len(CODEC_MAGIC)
ASSERT_MAGIC_BYTES: int = 8
"""LMCache's name for the magic's length."""
_FIXED_HEADER_LEN: int = FIXED_HEADER_LEN


class CodecVersion(IntEnum):
    """Header versions: 1 (payload CRC) and 2 (header+payload CRC, scale scheme)."""

    V1 = 1
    V2 = 2


class ScaleScheme(IntEnum):
    """LMCache's names for the header's scale-scheme slot (kvcodec's ``COMPUTED``/``UNIT`` are aliases)."""

    COMPUTED_PER_TENSOR = 0
    """Scales computed from V and stored (every v1 blob)."""
    RAW_UNIT = 1
    """Raw FP8 at unit scale, no scales (needs header version 2)."""
    COMPUTED = 0
    UNIT = 1


@dataclass
class CodecHashes:
    """Identity hashes gating cross-config cache poisoning ("" = not provided)."""

    model_id: str = ""
    model_revision_hash: str = ""
    tokenizer_hash: str = ""
    rope_config_hash: str = ""
    attention_backend: str = ""
    kv_layout: str = ""

    _CHECK_ORDER: ClassVar[tuple[str, ...]] = (
        "model_id",
        "model_revision_hash",
        "tokenizer_hash",
        "rope_config_hash",
        "attention_backend",
        "kv_layout",
    )


@dataclass
class EncodedKV:
    """LMCache's mutable blob record: header fields plus ``payload`` (K ‖ V ‖ scales)."""

    k_dtype: torch.dtype
    v_dtype: torch.dtype
    scale_dtype: torch.dtype = torch.float32
    scale_scope: ScaleScope = ScaleScope.PER_PAGE_HEAD
    hashes: CodecHashes = field(default_factory=CodecHashes)
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
    payload: bytes | memoryview = b""
    header_bytes: bytes | None = None
    version: int = 1
    scale_scheme: ScaleScheme = ScaleScheme.COMPUTED_PER_TENSOR
    # (blob kvcodec built or parsed, the payload view it handed out, its Header),
    # so to_bytes copies once and decode reuses the header.
    _blob: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_header(cls, h: Header, blob: Any, header_len: int, hashes: Any = None) -> EncodedKV:
        """The record of ``blob`` (``h``'s ``header_len`` header bytes, then its payload), as kvcodec wrote or parsed it.

        ``payload`` is a view into ``blob`` (no copy); ``hashes`` is kept when it is
        already a :class:`CodecHashes` (the caller's object, as LMCache keeps it),
        else the record gets the header's.
        """
        if int(h.scale_scheme) not in {
            int(s) for s in ScaleScheme
        }:  # kvcodec's LATENT, LOSSLESS: never misread
            raise with_lmcache_phrase(
                CorruptEncodedKVError(
                    f"scale scheme {int(h.scale_scheme)} ({h.scale_scheme.name}: kvcodec's own, an MLA latent "
                    "or a lossless blob) has no LMCache record",
                    reason=Reason.UNKNOWN_SCHEME,
                )
            )
        mv = blob if isinstance(blob, memoryview) else memoryview(blob)
        payload = mv[header_len : header_len + h.payload_len]
        return cls(
            k_dtype=to_torch(h.k_dtype),
            v_dtype=to_torch(h.v_dtype),
            scale_dtype=to_torch(h.scale_dtype),
            scale_scope=h.scale_scope,
            hashes=hashes if isinstance(hashes, CodecHashes) else CodecHashes(**h.hashes.as_dict()),
            layer_id=h.layer_id,
            chunk_id=h.chunk_id,
            chunk_size=h.chunk_size,
            page_size=h.page_size,
            kv_head_count=h.kv_head_count,
            head_dim=h.head_dim,
            scale_shape=h.scale_shape,
            k_payload_len=h.k_payload_len,
            v_payload_len=h.v_payload_len,
            scale_payload_len=h.scale_payload_len,
            payload=payload,
            header_bytes=bytes(mv[:header_len]),
            version=h.version,
            scale_scheme=ScaleScheme(int(h.scale_scheme)),
            _blob=(blob, payload, h),
        )

    @property
    def total_bytes(self) -> int:
        """Header + payload bytes (-1 before the header is serialized)."""
        if self.header_bytes is None:
            return -1
        return len(as_bytes_view(self.header_bytes)) + len(payload_of(self))

    def expected_payload_len(self) -> int:
        """K + V + scale lengths as declared."""
        return self.k_payload_len + self.v_payload_len + self.scale_payload_len


# ----------------------------------------------------------------------------
# A record's fields, checked and turned back into a Header
# ----------------------------------------------------------------------------

_INT_FIELDS = (
    "layer_id",
    "chunk_id",
    "chunk_size",
    "page_size",
    "kv_head_count",
    "head_dim",
    "k_payload_len",
    "v_payload_len",
    "scale_payload_len",
    "version",
)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_record(enc: Any) -> None:
    """Refuse an EncodedKV whose fields a caller set to something no header holds (LMCache lets
    ValueError/TypeError escape from these), so everything after may trust the field types."""
    if not isinstance(enc, EncodedKV):
        raise UnsupportedConfigError(
            f"expected an EncodedKV; got {type(enc).__name__}", reason=Reason.BAD_TYPE
        )
    for name in _INT_FIELDS:
        if not _is_int(getattr(enc, name)):
            raise UnsupportedConfigError(
                f"EncodedKV.{name} must be an int; got {getattr(enc, name)!r}", reason=Reason.BAD_TYPE
            )
    if not _is_int(enc.scale_scope) or enc.scale_scope not in {int(s) for s in ScaleScope}:
        raise UnsupportedConfigError(
            f"EncodedKV.scale_scope {enc.scale_scope!r} unknown; expected one of {[s.name for s in ScaleScope]}",
            reason=Reason.BAD_SCOPE,
        )
    if not _is_int(enc.scale_scheme) or enc.scale_scheme not in {int(s) for s in ScaleScheme}:
        raise UnsupportedConfigError(
            f"EncodedKV.scale_scheme {enc.scale_scheme!r} unknown; expected 0 or 1", reason=Reason.BAD_VALUE
        )
    if not isinstance(enc.scale_shape, (tuple, list)) or not all(_is_int(d) for d in enc.scale_shape):
        raise UnsupportedConfigError(
            f"EncodedKV.scale_shape must be a tuple of ints; got {enc.scale_shape!r}", reason=Reason.BAD_SHAPE
        )
    payload_of(enc)
    if enc.header_bytes is not None and not isinstance(enc.header_bytes, (bytes, bytearray, memoryview)):
        raise UnsupportedConfigError(
            f"EncodedKV.header_bytes must be bytes or None; got {type(enc.header_bytes).__name__}",
            reason=Reason.BAD_TYPE,
        )


def payload_of(enc: EncodedKV) -> memoryview:
    """``enc.payload`` as contiguous bytes: LMCache's type is bytes or a memoryview, never a tensor."""
    if isinstance(enc.payload, torch.Tensor) or enc.payload is None:
        raise UnsupportedConfigError(
            f"EncodedKV.payload must be bytes or a memoryview; got {type(enc.payload).__name__}",
            reason=Reason.BAD_BUFFER,
        )
    return as_bytes_view(enc.payload)


def _version(enc: EncodedKV) -> int:
    """LMCache writes RAW_UNIT blobs as version 2 whatever ``enc.version`` says."""
    return max(int(enc.version), 2) if int(enc.scale_scheme) == ScaleScheme.RAW_UNIT else int(enc.version)


def _to_header(enc: EncodedKV) -> Header:
    try:
        return Header(
            k_dtype=enc.k_dtype,
            v_dtype=enc.v_dtype,
            scale_dtype=enc.scale_dtype,
            scale_scope=ScaleScope(enc.scale_scope),
            version=_version(enc),
            scale_scheme=int(enc.scale_scheme),
            layer_id=enc.layer_id,
            chunk_id=enc.chunk_id,
            chunk_size=enc.chunk_size,
            page_size=enc.page_size,
            kv_head_count=enc.kv_head_count,
            head_dim=enc.head_dim,
            scale_shape=tuple(int(d) for d in enc.scale_shape),
            k_payload_len=enc.k_payload_len,
            v_payload_len=enc.v_payload_len,
            scale_payload_len=enc.scale_payload_len,
            hashes=Hashes.coerce(enc.hashes),
        )
    except UnsupportedConfigError as e:
        raise with_lmcache_phrase(e) from None


_REUSED_FIELDS = (
    "k_payload_len",
    "v_payload_len",
    "scale_payload_len",
    "layer_id",
    "chunk_size",
    "kv_head_count",
    "head_dim",
    "page_size",
)


def header_of(enc: EncodedKV) -> Header:
    """The Header kvcodec built or parsed for ``enc`` (reused while untouched), else one from its fields."""
    if enc._blob is not None:
        h = enc._blob[2]
        if (
            all(getattr(enc, n) == getattr(h, n) for n in _REUSED_FIELDS)
            and tuple(enc.scale_shape) == h.scale_shape
            and int(enc.scale_scope) == h.scale_scope
        ):
            return h
    return _to_header(enc)


# ----------------------------------------------------------------------------
# LMCache's header functions
# ----------------------------------------------------------------------------


def encoded_kv_header_size(enc: EncodedKV) -> int:
    """Serialized header size of ``enc`` in bytes (payload excluded)."""
    check_record(enc)
    return header_size(_to_header(enc))


def serialize_header(enc: EncodedKV) -> bytes:
    """Header bytes of ``enc`` with the CRC of ``enc.payload`` (lengths must match)."""
    check_record(enc)
    lens = (enc.k_payload_len, enc.v_payload_len, enc.scale_payload_len)
    if any(n < 0 for n in lens):
        raise UnsupportedConfigError(
            f"payload lengths must be non-negative; got K, V, scales = {lens}",
            reason=Reason.NEGATIVE_PAYLOAD_LEN,
        )
    payload = payload_of(enc)
    if len(payload) != enc.expected_payload_len():
        raise UnsupportedConfigError(
            f"payload length {len(payload)} does not match "
            f"declared K({enc.k_payload_len}) + V({enc.v_payload_len}) "
            f"+ scales({enc.scale_payload_len})",
            reason=Reason.INCONSISTENT_PAYLOAD,
        )
    return _serialize_header(_to_header(enc), [payload])


def _parse(buf: Any) -> ParsedBlob:
    """kvcodec's parse with LMCache's phrases, header level: K/V/scale consistency is decode's step."""
    try:
        return parse(buf, consistency=False)
    except CodecError as e:
        raise with_lmcache_phrase(e) from None


def record_of(p: ParsedBlob, hashes: Any = None) -> EncodedKV:
    """The record of a parsed blob (see :meth:`EncodedKV.from_header`)."""
    return EncodedKV.from_header(p.header, p.blob, p.header_len, hashes)


def deserialize_header(buf: Any) -> EncodedKV:
    """Parse a blob (header + payload) into an EncodedKV whose payload views ``buf``.

    Header-level, as LMCache's: structure, bounds and the CRC are checked here;
    whether K, V and scale lengths describe one tensor is checked by decode.
    """
    return record_of(_parse(buf))
