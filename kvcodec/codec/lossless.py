"""The lossless stage: a plain blob to its LOSSLESS twin and back, byte for byte.

``compress_blob`` splits K into its high-byte plane (sign and exponent; laid out channel by channel
per head, where neighbouring values share exponents) and its low-byte plane (near-random mantissa
bits, stored raw), and codes the high plane and V's FP8 codes with raw deflate, one stream per head
(``docs/FORMAT.md``, "Lossless payload"). ``expand_blob`` gives back the plain blob exactly, so a
decode of either is the same bits by construction.

The coder is raw deflate (RFC 1951): ISA-L's igzip (python-isal, the ``fast`` extra) when installed,
level 1 with a 16-byte history window (measured on real KV: smaller and faster than zstd level 1 on
these planes, docs/quality.md), else the stdlib's zlib at level 1. Either decodes the other's
streams. Each stream is decoded with at most ``tokens x head_dim + 1`` bytes of output, the size the
header's geometry gives, so a stream that claims more (a decompression bomb) is refused without
being expanded.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import backends
from ..errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from ..format import (
    LOSSLESS_OF,
    Coding,
    Header,
    ParsedBlob,
    ScaleScheme,
    parse,
    read_coding,
    serialize_header,
)
from ..format.coding import CODED_K_ITEMSIZE, Section, pack_table

__all__ = ["CODER", "COMPRESSIONS", "compress_blob", "expand_blob", "is_lossless"]

COMPRESSIONS = ("none", "lossless")
"""``encode(compression=...)``: ``none`` writes the plain payload, ``lossless`` the coded one."""
DEFLATE_LEVEL = 1
"""igzip / zlib level: level 1 codes these planes as small as 2 and 3 (measured), at the best speed."""
HIST_BITS = 4
"""igzip's history window (2^4 bytes): exponents repeat at short range; measured smaller than 32 KiB."""


def _coders() -> tuple[Callable[[bytes], bytes], Callable[[], Any], tuple[type[Exception], ...], str]:
    try:
        from isal import igzip_lib, isal_zlib  # type: ignore[import-not-found]
    except ImportError:  # pragma: no cover - depends on the environment
        return _zlib_compress, lambda: zlib.decompressobj(-15), (zlib.error,), "zlib"

    def compress(b: Any) -> bytes:
        return igzip_lib.compress(
            b, DEFLATE_LEVEL, igzip_lib.COMP_DEFLATE, igzip_lib.MEM_LEVEL_DEFAULT, HIST_BITS
        )

    return compress, lambda: isal_zlib.decompressobj(-15), (zlib.error, isal_zlib.error), "isal"


def _zlib_compress(b: Any) -> bytes:
    c = zlib.compressobj(DEFLATE_LEVEL, zlib.DEFLATED, -15)
    return c.compress(b) + c.flush()


_compress, _decompressor, _STREAM_ERRORS, CODER = _coders()


def is_lossless(h: Header) -> bool:
    """Whether ``h`` is a lossless blob's header (scheme LOSSLESS or LOSSLESS_UNIT)."""
    return h.scale_scheme in (ScaleScheme.LOSSLESS, ScaleScheme.LOSSLESS_UNIT)


def _refuse(msg: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"compression='lossless': {msg}", reason=Reason.BAD_VALUE)


def _check_plain(h: Header) -> tuple[int, int, int]:
    """Tokens, heads, head_dim of a plain blob the lossless stage can code (else UnsupportedConfigError)."""
    if h.version < 2:
        raise _refuse(f"needs header version 2; got {h.version} (LMCache's version 1 stays plain)")
    if h.scale_scheme not in LOSSLESS_OF:
        raise _refuse(f"scale scheme {ScaleScheme(h.scale_scheme).name} has no lossless form")
    if h.v_dtype.itemsize != 1 or (h.k_payload_len and h.k_dtype.itemsize != CODED_K_ITEMSIZE):
        raise _refuse(f"K of {h.k_dtype.name}, V of {h.v_dtype.name}: needs 16-bit K and FP8 V")
    heads, dim, tokens = h.kv_head_count, h.head_dim, h.num_tokens
    if heads < 1 or dim < 1 or not tokens:
        raise _refuse(f"needs kv_head_count, head_dim and tokens; got {heads}, {dim}, {tokens}")
    return tokens, heads, dim


def _split_k(k: memoryview, tokens: int, heads: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """K's high plane ``[heads, dim, tokens]`` and low plane ``[tokens, heads, dim]`` (C, else numpy)."""
    n = tokens * heads * dim
    hi, lo = np.empty(n, np.uint8), np.empty(n, np.uint8)
    if not backends.k_planes(k, hi, lo, tokens, heads, dim, merge=False):
        kb = np.frombuffer(k, np.uint8).reshape(tokens, heads, dim, CODED_K_ITEMSIZE)
        hi.reshape(heads, dim, tokens)[...] = kb[..., 1].transpose(1, 2, 0)
        lo.reshape(tokens, heads, dim)[...] = kb[..., 0]
    return hi, lo


def _coded_parts(p: ParsedBlob, tokens: int, heads: int, dim: int) -> list[Any]:
    """The lossless payload's parts in order: K's table, streams and low plane; V's table and streams."""
    codes = np.frombuffer(p.v, np.uint8).reshape(tokens, heads, dim)
    v_streams = [_compress(np.ascontiguousarray(codes[:, i, :])) for i in range(heads)]
    parts: list[Any] = []
    if p.header.k_payload_len:
        hi, lo = _split_k(p.k, tokens, heads, dim)
        per = tokens * dim
        k_streams = [_compress(hi[i * per : (i + 1) * per]) for i in range(heads)]
        parts += [pack_table([len(s) for s in k_streams]), *k_streams, lo]
    return [*parts, pack_table([len(s) for s in v_streams], tokens), *v_streams]


def compress_blob(plain: Any) -> bytearray:
    """The lossless blob of plain version-2 blob ``plain`` (checked, CRC included)."""
    p = plain if isinstance(plain, ParsedBlob) else parse(plain)
    h = p.header
    tokens, heads, dim = _check_plain(h)
    parts = _coded_parts(p, tokens, heads, dim)
    sizes = [memoryview(x).nbytes for x in parts]
    v_len = sum(sizes[-(heads + 1) :])
    coded = h.replace(
        scale_scheme=LOSSLESS_OF[ScaleScheme(h.scale_scheme)],
        k_payload_len=sum(sizes) - v_len,
        v_payload_len=v_len,
    )
    parts.append(p.scales)
    head = serialize_header(coded, parts)
    out = bytearray(len(head) + coded.payload_len)
    mv = memoryview(out)
    mv[: len(head)] = head
    at = len(head)
    for part in parts:
        n = memoryview(part).nbytes
        mv[at : at + n] = memoryview(part).cast("B")
        at += n
    return out


def _inflate(stream: memoryview, raw: int, what: str) -> bytes:
    """``stream`` decoded to exactly ``raw`` bytes, never more than ``raw + 1`` held (CorruptEncodedKVError)."""
    d = _decompressor()
    try:
        out = d.decompress(stream, raw + 1)
    except _STREAM_ERRORS as e:
        raise CorruptEncodedKVError(
            f"{what}: not a raw deflate stream ({e})", reason=Reason.BAD_STREAM
        ) from None
    if len(out) != raw or not d.eof or d.unconsumed_tail or d.unused_data:
        got = f"more than {raw}" if len(out) > raw else f"{len(out)}"
        state = "" if d.eof else ", unterminated"
        extra = len(d.unconsumed_tail) + len(d.unused_data)
        raise CorruptEncodedKVError(
            f"{what} decodes to {got} bytes{state}{f', {extra} bytes unread' if extra else ''}; "
            f"the geometry says {raw}",
            reason=Reason.BAD_STREAM,
        )
    return out


def _streams(sec: Section, src: memoryview, raw: int, what: str) -> list[bytes]:
    return [_inflate(src[at : at + n], raw, f"{what} stream {i}") for i, (at, n) in enumerate(sec.streams)]


def _merge_k(out: memoryview, hi: np.ndarray, lo: memoryview, c: Coding) -> None:
    """Write K's bytes into ``out`` from its planes (C, else numpy)."""
    t, heads, dim = c.tokens, c.heads, c.head_dim
    if not backends.k_planes(out, hi, lo, t, heads, dim, merge=True):
        k = np.frombuffer(out, np.uint8).reshape(t, heads, dim, CODED_K_ITEMSIZE)
        k[..., 0] = np.frombuffer(lo, np.uint8).reshape(t, heads, dim)
        k[..., 1] = hi.reshape(heads, dim, t).transpose(2, 0, 1)


def expand_blob(p: ParsedBlob) -> bytearray:
    """The plain blob that lossless blob ``p`` (parsed, CRC checked) codes, byte for byte."""
    c = read_coding(p.header, p.k, p.v)
    plain = c.plain
    hs = p.header_len  # the plain header has the same fields and strings: the same size
    out = bytearray(hs + plain.payload_len)
    mv = memoryview(out)
    t, heads, dim, raw = c.tokens, c.heads, c.head_dim, c.stream_raw
    k_len = plain.k_payload_len
    codes = np.frombuffer(mv, np.uint8, plain.v_payload_len, hs + k_len).reshape(t, heads, dim)
    for i, got in enumerate(_streams(c.v, p.v, raw, "V")):
        codes[:, i, :] = np.frombuffer(got, np.uint8).reshape(t, dim)
    if c.k is not None:
        hi = np.empty(heads * raw, np.uint8)
        for i, got in enumerate(_streams(c.k, p.k, raw, "K")):
            hi[i * raw : (i + 1) * raw] = np.frombuffer(got, np.uint8)
        _merge_k(mv[hs : hs + k_len], hi, p.k[c.k.raw_at :], c)
    mv[hs + k_len + plain.v_payload_len :] = p.scales
    mv[:hs] = serialize_header(plain, [mv[hs:]])
    return out
