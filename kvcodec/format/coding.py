"""The lossless payload of schemes LOSSLESS(_UNIT), LOSSLESS_HUFF(_UNIT) and LOSSLESS_SPLIT(_UNIT): its stream tables, read and written.

A lossless blob stores the same K, V codes and scales as its plain blob (scheme COMPUTED / UNIT),
coded so that each head decodes on its own (``docs/FORMAT.md``, "Lossless payload"):

* V section: ``tokens`` (i64), a stream count (u32, = heads), each stream's stored length (u32),
  then the streams: head h's codes ``[tokens, head_dim]``, coded (raw deflate for schemes 3/4, a
  Huffman stream for 5/6); for schemes 7/8 each stream codes the codes' exponents (bits 3..6) alone,
  and the streams are followed by every code's sign and mantissa, two a byte in payload order;
* K section (empty when the blob has no K): a stream count (u32, = heads), each stream's stored
  length (u32), the streams: head h's high bytes laid out channel by channel ``[head_dim, tokens]``,
  coded alike; then K's low bytes ``[tokens, heads, head_dim]``, stored as they are;
* scales: as in the plain blob.

:func:`read_coding` checks every table against the header before a byte is decoded: each stream
may decode to exactly ``tokens x head_dim`` bytes, so a decoder allocates by the geometry, never by
what a stream claims. A Huffman stream's own layout (its code-length table, lane lengths and lanes),
its bound and the codes of its refusals are named here too (``HUFF_*``); the coders are
``kvcodec/csrc/huff.c`` and :mod:`kvcodec.codec.huffman`. Pure Python (``struct``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import CorruptEncodedKVError, Reason
from .header import HUFFMAN_SCHEMES, MAX_ELEMENTS, PLAIN_OF, SPLIT_SCHEMES, Header, ScaleScheme

__all__ = [
    "CODED_K_ITEMSIZE",
    "HUFF_ERRORS",
    "HUFF_HEAD_BYTES",
    "HUFF_LANES",
    "HUFF_LANE_LENS",
    "HUFF_MAX_LEN",
    "HUFF_TABLE_BYTES",
    "SPLIT_EXP_SYMBOLS",
    "STREAM_COUNT",
    "STREAM_LEN",
    "TOKENS",
    "Coding",
    "Section",
    "max_stream_len",
    "pack_table",
    "plain_header",
    "read_coding",
]

TOKENS = struct.Struct("<q")
"""Tokens held: the first field of a lossless V section."""
STREAM_COUNT = struct.Struct("<I")
"""Streams in a section (one per KV head)."""
STREAM_LEN = struct.Struct("<I")
"""Stored bytes of one stream, one per stream after the count."""
CODED_K_ITEMSIZE = 2
"""K's element size in a lossless blob (bf16 or fp16: a high and a low byte plane)."""
STREAM_SLACK_DIVISOR = 256
STREAM_SLACK_BYTES = 64
"""A stored stream is at most ``raw + raw // 256 + 64`` bytes: raw deflate's worst case (stored
blocks, 5 bytes per 65,535) with room to spare. A longer one is refused before it is decoded."""


HUFF_MAX_LEN = 11
"""A Huffman stream's longest code, in bits (its decode table has 2^11 entries)."""
HUFF_TABLE_BYTES = 128
"""A Huffman stream's first field: the code length of symbols 0..255, 4 bits each (low nibble: even)."""
HUFF_LANES = 4
"""Lanes a Huffman stream's symbols are cut in, each its own bit stream."""
HUFF_LANE_LENS = struct.Struct("<3I")
"""Stored bytes of lanes 0..2, after the code-length table; lane 3 takes the rest of the stream."""
HUFF_HEAD_BYTES = HUFF_TABLE_BYTES + HUFF_LANE_LENS.size
HUFF_ERRORS: dict[int, str] = {
    1: "ends inside its code-length table or lane lengths",
    2: "declares a code length over 11 bits",
    3: "has over-subscribed code lengths (Kraft sum over 1)",
    4: "has no code for its symbols",
    5: "declares lanes longer than the stream",
    6: "decodes a code no symbol has",
    7: "has a lane whose bits run out before its symbols",
    8: "has a lane that stores more bytes than its bits need",
    9: "has a lane whose padding bits are not zero",
}
"""Why a Huffman stream is refused, by the code both coders return (``kvcodec/csrc/huff.h``)."""
SPLIT_EXP_SYMBOLS = 16
"""Symbols a V stream of schemes 7/8 may code (an e4m3 exponent's 4 bits): its code-length table gives
the rest length 0, or the blob is refused before a stream is decoded."""
_NO_CODES = bytes((256 - SPLIT_EXP_SYMBOLS) // 2)


def max_stream_len(raw: int, huffman: bool = False) -> int:
    """The most bytes a stream that decodes to ``raw`` bytes may store: raw deflate's bound (schemes
    3/4), or a Huffman stream's (5/6): its head, 11 bits a symbol, a padding byte per lane."""
    if huffman:
        return HUFF_HEAD_BYTES + (raw * HUFF_MAX_LEN + 7) // 8 + HUFF_LANES
    return raw + raw // STREAM_SLACK_DIVISOR + STREAM_SLACK_BYTES


@dataclass(frozen=True)
class Section:
    """One coded section: where its streams lie (offsets from the section's start) and what follows."""

    streams: tuple[tuple[int, int], ...]
    """(offset, stored length) of each head's stream."""
    raw_at: int
    """Where the bytes stored raw start (K's low plane; V's sign and mantissa nibbles for schemes 7/8,
    else the section's end for V)."""


@dataclass(frozen=True)
class Coding:
    """A lossless blob's tables, checked: its geometry, sections and the plain header it decodes to."""

    tokens: int
    heads: int
    head_dim: int
    k: Section | None
    v: Section
    plain: Header
    huffman: bool
    """Whether the streams are Huffman streams (schemes 5 to 8), else raw deflate (3/4)."""
    v_split: bool = False
    """Whether V's streams code its exponents, its signs and mantissas stored raw (schemes 7/8)."""

    @property
    def stream_raw(self) -> int:
        """Bytes every stream decodes to: ``tokens x head_dim``."""
        return self.tokens * self.head_dim


def _bad(msg: str, reason: Reason = Reason.INCONSISTENT_PAYLOAD) -> CorruptEncodedKVError:
    return CorruptEncodedKVError(f"lossless payload: {msg}", reason=reason)


def pack_table(lengths: list[int], tokens: int | None = None) -> bytes:
    """A section's table: ``tokens`` (V only), the stream count, each stream's stored length."""
    head = TOKENS.pack(tokens) if tokens is not None else b""
    return head + STREAM_COUNT.pack(len(lengths)) + struct.pack(f"<{len(lengths)}I", *lengths)


def _section(buf: memoryview, at: int, heads: int, raw: int, what: str, huffman: bool) -> Section:
    """The streams of a section whose table starts at ``at``; each length within its bound."""
    n = len(buf)
    if n - at < STREAM_COUNT.size:
        raise _bad(f"{what} section of {n} bytes ends inside its table")
    (count,) = STREAM_COUNT.unpack_from(buf, at)
    at += STREAM_COUNT.size
    if count != heads:
        raise _bad(f"{what} section has {count} streams; kv_head_count is {heads}")
    if (n - at) // STREAM_LEN.size < count:
        raise _bad(f"{what} section of {n} bytes cannot hold {count} stream lengths")
    lengths = struct.unpack_from(f"<{count}I", buf, at)
    at += count * STREAM_LEN.size
    bound, streams = max_stream_len(raw, huffman), []
    for i, length in enumerate(lengths):
        if not 0 < length <= bound or length > n - at:
            raise _bad(
                f"{what} stream {i} claims {length} bytes; 1..{bound} fit a {raw}-byte stream "
                f"and {n - at} remain"
            )
        streams.append((at, length))
        at += length
    return Section(tuple(streams), at)


def plain_header(h: Header, tokens: int, with_k: bool) -> Header:
    """The header of the plain blob ``h`` decodes to (``tokens`` tokens, K present or not), derived on
    every decode (:meth:`Header.derived`)."""
    elems = tokens * h.kv_head_count * h.head_dim
    return h.derived(
        scale_scheme=PLAIN_OF[ScaleScheme(h.scale_scheme)],
        k_payload_len=elems * CODED_K_ITEMSIZE if with_k else 0,
        v_payload_len=elems,
    )


def _check_header(h: Header) -> None:
    if h.version < 2 or h.scale_scheme not in PLAIN_OF:
        raise _bad(f"version {h.version} scheme {ScaleScheme(h.scale_scheme).name} is not a lossless blob")
    if h.kv_head_count < 1 or h.head_dim < 1:
        raise _bad(f"kv_head_count={h.kv_head_count}, head_dim={h.head_dim}: a lossless blob sets both")
    if h.v_dtype.itemsize != 1 or (h.k_payload_len and h.k_dtype.itemsize != CODED_K_ITEMSIZE):
        raise _bad(f"K of {h.k_dtype.name}, V of {h.v_dtype.name}: lossless needs 16-bit K and 8-bit V")


def read_coding(h: Header, k: memoryview, v: memoryview) -> Coding:
    """Check a lossless blob's tables against its header (``k``, ``v``: its stored sections).

    Raises :class:`CorruptEncodedKVError` (``INCONSISTENT_PAYLOAD``) for any table that does not
    describe exactly its section: a wrong stream count, a length past its bound or the section's end,
    bytes left over, a token count out of range.
    """
    _check_header(h)
    heads, dim = h.kv_head_count, h.head_dim
    if len(v) < TOKENS.size:
        raise _bad(f"V section of {len(v)} bytes ends inside its table")
    (tokens,) = TOKENS.unpack_from(v, 0)
    if not 0 < tokens <= MAX_ELEMENTS // (heads * dim):
        raise _bad(f"tokens={tokens}: expected 1..{MAX_ELEMENTS // (heads * dim)} at {heads} x {dim}")
    raw, huffman = tokens * dim, h.scale_scheme in HUFFMAN_SCHEMES
    vs = _section(v, TOKENS.size, heads, raw, "V", huffman)
    split = h.scale_scheme in SPLIT_SCHEMES
    if split:
        _check_split_v(v, vs, raw * heads)
    elif vs.raw_at != len(v):
        raise _bad(f"V section has {len(v) - vs.raw_at} bytes after its streams")
    ks = None
    if len(k):
        ks = _section(k, 0, heads, raw, "K", huffman)
        if len(k) - ks.raw_at != raw * heads:
            raise _bad(f"K's low plane is {len(k) - ks.raw_at} bytes; {tokens} tokens need {raw * heads}")
    return Coding(tokens, heads, dim, ks, vs, plain_header(h, tokens, ks is not None), huffman, split)


def _check_split_v(v: memoryview, vs: Section, codes: int) -> None:
    """Schemes 7/8: each V stream codes exponents only (no code for a symbol over 15), and the sign and
    mantissa nibbles after the streams are exactly ``codes`` nibbles, an odd count's last one padded with 0."""
    for i, (at, n) in enumerate(vs.streams):
        table = v[at + SPLIT_EXP_SYMBOLS // 2 : at + min(n, HUFF_TABLE_BYTES)].tobytes()
        if table != _NO_CODES[: len(table)]:
            raise _bad(
                f"V stream {i} gives a code to a symbol over {SPLIT_EXP_SYMBOLS - 1} (exponents have 4 bits)"
            )
    nib = (codes + 1) // 2
    if len(v) - vs.raw_at != nib:
        raise _bad(f"V's sign and mantissa plane is {len(v) - vs.raw_at} bytes; {codes} codes need {nib}")
    if codes % 2 and v[len(v) - 1] >> 4:
        raise _bad("V's sign and mantissa plane pads its last byte with a nonzero nibble")
