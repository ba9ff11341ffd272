"""The lossless stage: a plain blob to its lossless twin and back, byte for byte.

``compress_blob`` splits K into its high-byte plane (sign and exponent; laid out channel by channel
per head, where neighbouring values share exponents) and its low-byte plane (near-random mantissa
bits, stored raw), and V's FP8 codes into their exponents and their sign + mantissa nibbles (stored
raw, two a byte), and codes K's high plane and V's exponents one stream per head (``docs/FORMAT.md``,
"Lossless payload"). ``expand_blob`` gives back the plain blob exactly, so a decode of either is the
same bits by construction; ``expand_payload`` gives its header and payload without writing or parsing
a plain header (what ``decode`` reads: into this thread's reused buffer when every byte is copied out
of it before the thread's next decode).

The coder (schemes LOSSLESS_SPLIT / LOSSLESS_SPLIT_UNIT, what ``compression="lossless"`` writes) is an
order-0 canonical Huffman code per stream, lengths of at most 11 bits, the symbols cut in four lanes
that decode side by side (``docs/FORMAT.md``, "Huffman stream"): ``kvcodec/csrc/huff.c`` through
:mod:`kvcodec.backends`, else :mod:`.huffman` (the same bytes, slower). It was chosen by measurement
(docs/quality.md): on real KV it codes as small as deflate level 1 and decodes several times faster
than ISA-L's inflate on these planes. V's exponents (16 symbols, ~2.6 bits a code) decode up to five
a table lookup where whole codes (~6.6 bits) took one each, for 0.5% more bytes of V: V's streams
decode about twice as fast (docs/quality.md).

Blobs of schemes LOSSLESS_HUFF / LOSSLESS_HUFF_UNIT (whole V codes in V's streams, written before the
split; ``compress_blob(coder="huffman")`` still writes them) and LOSSLESS / LOSSLESS_UNIT (raw
deflate) are still read: deflate through ISA-L's igzip (python-isal, the ``fast`` extra) when
installed, else the stdlib's zlib; each deflate stream is decoded with at most ``tokens x head_dim +
1`` bytes of output, the size the header's geometry gives, so a stream that claims more (a
decompression bomb) is refused without being expanded. ``compress_blob(coder="deflate")`` still
writes them (golden vectors, tests).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import backends
from ..errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from ..format import (
    DEFLATE_OF,
    HUFF_OF,
    LOSSLESS_OF,
    PLAIN_OF,
    BlobCrc,
    Coding,
    Header,
    ParsedBlob,
    ScaleScheme,
    check_crc,
    parse,
    read_coding,
    restamp_header,
    serialize_header,
)
from ..format.coding import (
    CODED_K_ITEMSIZE,
    HUFF_ERRORS,
    STREAM_COUNT,
    STREAM_LEN,
    TOKENS,
    Section,
    max_stream_len,
    pack_table,
)
from ..hostmem import new_buffer
from . import huffman

__all__ = [
    "CODER",
    "CODERS",
    "COMPRESSIONS",
    "DEFLATE_CODER",
    "Expansion",
    "Planes",
    "compress_blob",
    "encode_planes",
    "expand_blob",
    "expand_payload",
    "is_lossless",
    "merge_v",
    "plain_scratch",
    "split_planes",
    "split_v",
]

COMPRESSIONS = ("none", "lossless")
"""``encode(compression=...)``: ``none`` writes the plain payload, ``lossless`` the coded one."""
CODERS = ("split", "huffman", "deflate")
"""``compress_blob(coder=...)``: Huffman streams of K's high plane and V's exponents (schemes 7/8, the
default), of K's high plane and whole V codes (5/6), or raw deflate (3/4)."""
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


_compress, _decompressor, _STREAM_ERRORS, DEFLATE_CODER = _coders()
CODER = "huffman-c" if backends.cache_lanes_available() else "huffman-python"
"""What codes ``compression="lossless"`` here: huff.c, or the Python coder when the C loops are not built."""


def is_lossless(h: Header) -> bool:
    """Whether ``h`` is a lossless blob's header (schemes LOSSLESS(_UNIT) or LOSSLESS_HUFF(_UNIT))."""
    return h.scale_scheme in PLAIN_OF


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


def split_planes(
    k: Any, tokens: int, heads: int, dim: int, *, reuse: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The high plane ``[heads, dim, tokens]`` and low plane ``[tokens, heads, dim]`` of 16-bit K's bytes
    ``k`` (any C-contiguous buffer; C, else numpy). ``reuse``: both in this thread's plane buffer
    (:func:`encode_planes`), for an encode that codes them before its next use of that buffer."""
    n = tokens * heads * dim
    hi, lo = encode_planes(n) if reuse else (np.empty(n, np.uint8), np.empty(n, np.uint8))
    if not backends.k_planes(k, hi, lo, tokens, heads, dim, merge=False):
        kb = np.frombuffer(k, np.uint8).reshape(tokens, heads, dim, CODED_K_ITEMSIZE)
        hi.reshape(heads, dim, tokens)[...] = kb[..., 1].transpose(1, 2, 0)
        lo.reshape(tokens, heads, dim)[...] = kb[..., 0]
    return hi, lo


def split_v(v: Any, tokens: int, heads: int, dim: int, exp: np.ndarray) -> np.ndarray:
    """V's codes ``v`` (``[tokens, heads, dim]``) split: their exponents (bits 3..6) into ``exp``, each
    head's ``[tokens, dim]`` one after another; returns their sign (bit 7 as bit 3) and mantissa
    (bits 0..2) nibbles, two a byte in payload order (low nibble first; an odd count's last high
    nibble 0). C, else numpy."""
    n = tokens * heads * dim
    nib = np.empty((n + 1) // 2, np.uint8)
    if not backends.v_nibbles(v, exp, nib, tokens, heads, dim, merge=False):
        x = np.frombuffer(v, np.uint8, n)
        exp.reshape(heads, tokens, dim)[...] = ((x >> 3) & 15).reshape(tokens, heads, dim).transpose(1, 0, 2)
        s = np.zeros(2 * nib.size, np.uint8)
        s[:n] = ((x >> 4) & 8) | (x & 7)
        nib[...] = s[0::2] | (s[1::2] << 4)
    return nib


def merge_v(out: Any, exp: np.ndarray, nib: Any, tokens: int, heads: int, dim: int) -> None:
    """V's codes written into ``out`` from their exponents and nibbles (:func:`split_v`'s inverse)."""
    if not backends.v_nibbles(out, exp, nib, tokens, heads, dim, merge=True):
        n = tokens * heads * dim
        b = np.frombuffer(nib, np.uint8)
        s = np.empty(2 * b.size, np.uint8)
        s[0::2], s[1::2] = b & 15, b >> 4
        e = exp.reshape(heads, tokens, dim).transpose(1, 0, 2).reshape(-1) & 15
        np.frombuffer(out, np.uint8, n)[...] = ((s[:n] & 8) << 4) | (e << 3) | (s[:n] & 7)


# ----------------------------------------------------------------------------- Huffman (schemes 5 to 8)


def _rows(buf: Any, at: int, n: int, row: int, stride: int) -> np.ndarray:
    """The ``n`` symbols at ``buf[at + (j // row) * stride + j % row]`` as a (strided) numpy view."""
    flat = np.frombuffer(buf, np.uint8)
    return np.lib.stride_tricks.as_strided(flat[at:], (n // row, row), (stride, 1), writeable=False)


def _encode_streams(
    src: Any, at: int, step: int, heads: int, n: int, row: int, stride: int, out: memoryview
) -> list[int]:
    """Each head's stream (head i's symbols from ``at + i * step``) written one after another at the start
    of ``out`` (C, else the Python coder): their lengths."""
    got = backends.huff_encode_many(src, at, step, heads, n, row, stride, out, 0)
    if got is None:
        got, pos = [], 0
        rows = [np.ascontiguousarray(_rows(src, at + i * step, n, row, stride)) for i in range(heads)]
        for stream in huffman.encode_section(rows):
            out[pos : pos + len(stream)] = stream
            got.append(len(stream))
            pos += len(stream)
    return _within_bound(got, n)


def _within_bound(got: list[int], n: int) -> list[int]:
    cap = max_stream_len(n, huffman=True)
    if not all(0 < x <= cap for x in got):  # pragma: no cover - the bound is the coder's worst case
        raise AssertionError(f"Huffman streams of {n} symbols took {got} bytes; the bound is {cap}")
    return got


def _encode_split_v(
    v: Any, tokens: int, heads: int, dim: int, out: memoryview
) -> tuple[list[int], np.ndarray]:
    """V's exponents coded one stream per head at the start of ``out``, and its sign and mantissa nibbles:
    (the streams' lengths, the nibbles). Where each head's count is a multiple of 8 the C loops take the
    exponents two a byte (split and coded a pair at a time: the same bytes, half the lookups)."""
    raw = tokens * dim
    n = raw * heads
    if raw % 8 == 0:  # both halves of the plane buffer's first n bytes: K's high plane, coded by now
        pair = np.frombuffer(_scratch_view(n, "plane"), np.uint8)
        exp2, nib = pair[: n // 2], pair[n // 2 :]
        if backends.v_nibbles_pairs(v, exp2, nib, tokens, heads, dim):
            return _within_bound(
                backends.huff_encode_pairs_many(exp2, 0, raw // 2, heads, raw, out, 0), raw
            ), nib
    exp = np.frombuffer(_scratch_view(n, "plane"), np.uint8)
    nib = split_v(v, tokens, heads, dim, exp)
    return _encode_streams(exp, 0, raw, heads, raw, raw, raw, out), nib


Planes = tuple[np.ndarray, np.ndarray]
"""K's high plane ``[heads, dim, tokens]`` and low plane ``[tokens, heads, dim]``, flat uint8."""


def _planes_of(
    p: ParsedBlob, tokens: int, heads: int, dim: int, given: Planes | None, *, reuse: bool = False
) -> Planes:
    """K's planes: those ``given`` (split where K lives: kvcodec.codec.lossless_device), else split here
    from the plain blob's K (``reuse``: into this thread's plane buffer)."""
    if given is None:
        return split_planes(p.k, tokens, heads, dim, reuse=reuse)
    n = tokens * heads * dim
    if len(given) != 2 or any(
        not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.size != n for a in given
    ):
        raise _refuse(f"k_planes must be two uint8 arrays of {n} bytes (K's high and low planes)")
    return given[0].reshape(-1), given[1].reshape(-1)


def _huffman_blob(
    p: ParsedBlob, tokens: int, heads: int, dim: int, planes: Planes | None = None, *, split: bool = True
) -> bytearray:
    """The LOSSLESS_SPLIT(_UNIT) blob of plain blob ``p`` (LOSSLESS_HUFF(_UNIT) when not ``split``):
    streams coded in place into one buffer."""
    h, raw, hs = p.header, tokens * dim, p.header_len
    bound = max_stream_len(raw, huffman=True)
    table = STREAM_COUNT.size + heads * STREAM_LEN.size
    k_cap = table + heads * (bound + raw) if h.k_payload_len else 0
    nib_len = (raw * heads + 1) // 2 if split else 0
    cap = hs + k_cap + TOKENS.size + table + heads * bound + nib_len + h.scale_payload_len
    out = new_buffer(cap)
    mv = memoryview(out)
    mv[:hs] = p.buffer[:hs]  # the plain header, restamped below
    at = hs
    if h.k_payload_len:
        hi, lo = _planes_of(p, tokens, heads, dim, planes, reuse=True)
        lengths = _encode_streams(
            hi, 0, raw, heads, raw, raw, raw, mv[at + table : at + table + heads * bound]
        )
        mv[at : at + table] = pack_table(lengths)
        at += table + sum(lengths)
        mv[at : at + lo.size] = lo
        at += lo.size
    k_len, v_at = at - hs, at
    at += TOKENS.size + table
    streams = mv[at : at + heads * bound]
    if split:
        lengths, nib = _encode_split_v(p.v, tokens, heads, dim, streams)
    else:
        lengths = _encode_streams(p.v, 0, dim, heads, raw, dim, heads * dim, streams)
    streams.release()
    mv[v_at:at] = pack_table(lengths, tokens)
    at += sum(lengths)
    if split:
        mv[at : at + nib_len] = nib
        at += nib_len
    end = at + h.scale_payload_len
    mv[at:end] = p.scales
    scheme = (LOSSLESS_OF if split else HUFF_OF)[ScaleScheme(h.scale_scheme)]
    restamp_header(mv, h, hs, scale_scheme=scheme, k_payload_len=k_len, v_payload_len=at - v_at)
    mv.release()
    del out[end:]
    return out


def _decode_streams(
    src: memoryview,
    sec: Section,
    raw: int,
    out: Any,
    out_at: int,
    step: int,
    row: int,
    stride: int,
    what: str,
) -> None:
    """Each stream of ``sec`` decoded to exactly ``raw`` symbols, stream i's written at ``out[out_at + i *
    step + (j // row) * stride + j % row]`` (C, else the Python coder), or CorruptEncodedKVError(BAD_STREAM)."""
    got = backends.huff_decode_many(src, sec.streams, raw, out, out_at, step, row, stride)
    if got is None:
        got = True
        flat = np.frombuffer(out, np.uint8)
        for i, (at, n) in enumerate(sec.streams):
            try:
                syms = huffman.decode(src[at : at + n], raw)
            except huffman.HuffmanError as e:
                got = (i, e.code)
                break
            view = np.lib.stride_tricks.as_strided(flat[out_at + i * step :], (raw // row, row), (stride, 1))
            view[...] = syms.reshape(-1, row)
    if got is not True:
        raise _stream_error(what, sec, raw, *got)


def _stream_error(what: str, sec: Section, raw: int, i: int, code: int) -> CorruptEncodedKVError:
    return CorruptEncodedKVError(
        f"{what} stream {i} (a Huffman stream of {sec.streams[i][1]} bytes for {raw} symbols) {HUFF_ERRORS[code]}",
        reason=Reason.BAD_STREAM,
    )


def _expand_in_one_call(
    c: Coding,
    p: ParsedBlob,
    v_out: memoryview,
    k_out: memoryview,
    crc: bool,
    deq: tuple[Any, ...] | None = None,
) -> bool | str:
    """A split payload's K bytes and V codes by one C call (``crc``: the coded blob's CRC checked in it
    first): one GIL hand-over a blob where the stages take five (the CRC, and each section's streams and
    merge), each of which a busy Python thread beside this one (an engine's loop) may hold on to for its
    switch interval. False when the C loops are not built (nothing done). With ``deq`` (the arguments of
    the cpu backend's ``expand_dequant`` plan) the codes are dequantized in the same call: True then, or
    C's reason for declining that (a str; all else written)."""
    n = c.heads * c.stream_raw
    plane = _scratch_view(n, "plane")  # V's exponents, then K's high bytes
    k, v = c.k, c.v
    got = backends.lossless_expand(
        p.payload,
        len(p.k),
        len(p.v),
        () if k is None else k.streams,
        0 if k is None else k.raw_at,
        v.streams,
        v.raw_at,
        (c.tokens, c.heads, c.head_dim),
        None if k is None else k_out,
        v_out if deq is None else v_out.cast("B", (c.tokens, c.heads, c.head_dim)),
        plane,
        (p.crc_prefix, p.crc) if crc else None,
        deq,
    )
    if got is True or got is False or type(got) is str:
        return got
    if got[0] == "crc":
        check_crc(p.header, p.crc, got[1])
    what, i, code = got
    raise _stream_error(what, v if what == "V" else k, c.stream_raw, i, code)


def _expand_huffman(c: Coding, p: ParsedBlob, mv: memoryview, hs: int, k_out: memoryview) -> None:
    heads, dim, raw = c.heads, c.head_dim, c.stream_raw
    v_at = hs + c.plain.k_payload_len
    if c.v_split:  # the exponents into the plane scratch, merged with the nibbles before K uses it
        exp = np.frombuffer(_scratch_view(heads * raw, "plane"), np.uint8)
        _decode_streams(p.v, c.v, raw, exp, 0, raw, raw, raw, "V")
        merge_v(mv[v_at : v_at + c.plain.v_payload_len], exp, p.v[c.v.raw_at :], c.tokens, heads, dim)
    else:
        _decode_streams(p.v, c.v, raw, mv, v_at, dim, dim, heads * dim, "V")
    if c.k is not None:
        hi = np.frombuffer(_scratch_view(heads * raw, "plane"), np.uint8)  # K's high plane, merged below
        _decode_streams(p.k, c.k, raw, hi, 0, raw, raw, raw, "K")
        _merge_k(k_out, hi, p.k[c.k.raw_at :], c)


# ----------------------------------------------------------------------------- deflate (schemes 3/4)


def _deflate_parts(p: ParsedBlob, tokens: int, heads: int, dim: int, planes: Planes | None) -> list[Any]:
    """The deflate payload's parts in order: K's table, streams and low plane; V's table and streams."""
    codes = np.frombuffer(p.v, np.uint8).reshape(tokens, heads, dim)
    v_streams = [_compress(np.ascontiguousarray(codes[:, i, :])) for i in range(heads)]
    parts: list[Any] = []
    if p.header.k_payload_len:
        hi, lo = _planes_of(p, tokens, heads, dim, planes)
        per = tokens * dim
        k_streams = [_compress(hi[i * per : (i + 1) * per]) for i in range(heads)]
        parts += [pack_table([len(s) for s in k_streams]), *k_streams, lo]
    return [*parts, pack_table([len(s) for s in v_streams], tokens), *v_streams]


def _deflate_blob(
    p: ParsedBlob, tokens: int, heads: int, dim: int, planes: Planes | None = None
) -> bytearray:
    h = p.header
    parts = _deflate_parts(p, tokens, heads, dim, planes)
    sizes = [memoryview(x).nbytes for x in parts]
    v_len = sum(sizes[-(heads + 1) :])
    coded = h.replace(
        scale_scheme=DEFLATE_OF[ScaleScheme(h.scale_scheme)],
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


def _expand_deflate(c: Coding, p: ParsedBlob, mv: memoryview, hs: int, k_out: memoryview) -> None:
    t, heads, dim, raw = c.tokens, c.heads, c.head_dim, c.stream_raw
    k_len = c.plain.k_payload_len
    codes = np.frombuffer(mv, np.uint8, c.plain.v_payload_len, hs + k_len).reshape(t, heads, dim)
    for i, got in enumerate(_streams(c.v, p.v, raw, "V")):
        codes[:, i, :] = np.frombuffer(got, np.uint8).reshape(t, dim)
    if c.k is not None:
        hi = np.empty(heads * raw, np.uint8)
        for i, got in enumerate(_streams(c.k, p.k, raw, "K")):
            hi[i * raw : (i + 1) * raw] = np.frombuffer(got, np.uint8)
        _merge_k(k_out, hi, p.k[c.k.raw_at :], c)


# ----------------------------------------------------------------------------- both


def compress_blob(plain: Any, *, coder: str = "split", k_planes: Planes | None = None) -> bytearray:
    """The lossless blob of plain version-2 blob ``plain`` (checked, CRC included): Huffman streams of
    V's exponents (scheme LOSSLESS_SPLIT or LOSSLESS_SPLIT_UNIT), of whole V codes with
    ``coder="huffman"`` (LOSSLESS_HUFF(_UNIT)), or raw deflate with ``coder="deflate"`` (LOSSLESS,
    LOSSLESS_UNIT): the last two what kvcodec wrote before, kept for golden vectors and tests.

    ``k_planes``: K's (high, low) planes already split where K lives (an encode of a GPU K), used
    instead of the plain blob's K bytes, which are then never read."""
    if coder not in CODERS:
        raise _refuse(f"coder={coder!r}; expected one of {CODERS}")
    p = plain if isinstance(plain, ParsedBlob) else parse(plain)
    tokens, heads, dim = _check_plain(p.header)
    if coder == "deflate":
        return _deflate_blob(p, tokens, heads, dim, k_planes)
    return _huffman_blob(p, tokens, heads, dim, k_planes, split=coder == "split")


def _merge_k(out: memoryview, hi: np.ndarray, lo: memoryview, c: Coding) -> None:
    """Write K's bytes into ``out`` from its planes (C, else numpy)."""
    t, heads, dim = c.tokens, c.heads, c.head_dim
    if not backends.k_planes(out, hi, lo, t, heads, dim, merge=True):
        k = np.frombuffer(out, np.uint8).reshape(t, heads, dim, CODED_K_ITEMSIZE)
        k[..., 0] = np.frombuffer(lo, np.uint8).reshape(t, heads, dim)
        k[..., 1] = hi.reshape(heads, dim, t).transpose(2, 0, 1)


SCRATCH_MAX_BYTES = 64 << 20
"""The largest plain payload (or planes: an encode's two of K, a decode's one) the lossless stage writes into one
of its thread's two reused buffers (a larger one gets a buffer of its own, freed with it): what a thread
keeps between calls is bounded, at twice this."""
_scratch = threading.local()


def plain_scratch(n: int) -> memoryview:
    """``n`` bytes of this thread's reused payload buffer, for the plain blob an encode writes only for
    :func:`compress_blob` to code (the lossless blob is a new buffer; nothing keeps the plain one)."""
    return _scratch_view(n)


def encode_planes(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two ``n``-byte planes for an encode's K (high, then low), one after another in this thread's plane
    buffer: a fresh pair per blob cost its page faults (a 256-token blob of 8 x 128: 54 -> 41 us a split).
    V's exponents and nibbles then reuse the first ``n`` bytes, once K's high plane is coded and its low
    plane copied into the blob."""
    buf = np.frombuffer(_scratch_view(2 * n, "plane"), np.uint8)
    return buf[:n], buf[n:]


def _scratch_view(n: int, name: str = "payload") -> memoryview:
    """``n`` bytes of this thread's reused buffer ``name`` (grown to the largest size asked for, up to
    :data:`SCRATCH_MAX_BYTES`), or a new buffer's beyond that. Two names: the plain payload (a decode's,
    or the plain blob a lossless encode codes), and the planes (a decode's V exponents, then K's high
    bytes before they are merged; an encode's K planes, then V's exponents and nibbles): a fresh buffer
    of that size each call costs its page faults."""
    if n > SCRATCH_MAX_BYTES:
        return memoryview(new_buffer(n))
    buf = getattr(_scratch, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(n, np.uint8)
        setattr(_scratch, name, buf)
    return memoryview(buf)[:n]


def _coding(p: ParsedBlob) -> Coding:
    """``p``'s stream tables: as its parse checked them, else checked here."""
    return p.coding if p.coding is not None else read_coding(p.header, p.k, p.v)


def _expand_into(c: Coding, p: ParsedBlob, mv: memoryview, at: int) -> None:
    """The plain payload of ``p`` (tables ``c``) written at ``mv[at:]``: K, V's codes, the scales."""
    _write_scales(c, p, mv, at)
    _expand_streams(c, p, mv, at, None)


def _write_scales(c: Coding, p: ParsedBlob, mv: memoryview, at: int) -> None:
    mv[at + c.plain.k_payload_len + c.plain.v_payload_len :] = p.scales


def _expand_streams(
    c: Coding,
    p: ParsedBlob,
    mv: memoryview,
    at: int,
    k_into: memoryview | None,
    crc: bool = False,
    deq: tuple[Any, ...] | None = None,
) -> bool | str:
    """K and V's codes of the plain payload at ``mv[at:]``; K into ``k_into`` instead when given.
    ``crc``: the coded blob's CRC checked first (CorruptEncodedKVError, CRC_MISMATCH; nothing decoded).
    ``deq``: see :meth:`Expansion.fill` (what this returns)."""
    k_len, v_len = c.plain.k_payload_len, c.plain.v_payload_len
    k_out = mv[at : at + k_len] if k_into is None else k_into
    if c.huffman and c.v_split:
        got = _expand_in_one_call(c, p, mv[at + k_len : at + k_len + v_len], k_out, crc, deq)
        if got is not False:
            return got if deq is not None else False
    if crc:  # the stages' way: the coded blob's CRC first
        BlobCrc(p).finish(None)
    (_expand_huffman if c.huffman else _expand_deflate)(c, p, mv, at, k_out)
    return False


class Expansion:
    """A lossless blob's plain payload in two steps, for a decode that wants K merged straight into its
    ``out_k``: building one takes the tables and writes the scales (what a decode reads to plan the
    pass), :meth:`fill` decodes the streams, K into the payload or into the caller's buffer."""

    def __init__(self, p: ParsedBlob, *, reuse: bool = False) -> None:
        self.parsed, self.coding = p, _coding(p)
        n = self.coding.plain.payload_len
        self.payload = _scratch_view(n) if reuse else memoryview(new_buffer(n))
        _write_scales(self.coding, p, self.payload, 0)

    @property
    def header(self) -> Header:
        """The plain header the blob codes (no plain header is written or parsed)."""
        return self.coding.plain

    def fill(
        self, *, k_into: memoryview | None = None, crc: bool = False, deq: tuple[Any, ...] | None = None
    ) -> bool | str:
        """The payload's K and codes; K's bytes into ``k_into`` (exactly ``k_payload_len`` writable bytes),
        the payload's K left unwritten then, when given. ``crc``: the coded blob's CRC checked first, in
        the same C call where the C loops take the blob (a blob parsed with ``verify_crc=False``):
        CorruptEncodedKVError (CRC_MISMATCH) before any stream is decoded. ``deq`` (the arguments of the
        cpu backend's ``expand_dequant`` plan): the codes dequantized in that same call too. Returns True when they were, False when not (not asked, or this blob's stages do not take it:
        the caller dequantizes), or C's reason for declining (the output may be partly written then)."""
        k_len = self.coding.plain.k_payload_len
        if k_into is not None and (k_into.readonly or k_into.nbytes != k_len):
            raise _refuse(f"k_into must be {k_len} writable bytes; got {k_into.nbytes}")
        return _expand_streams(self.coding, self.parsed, self.payload, 0, k_into, crc, deq)


def expand_payload(p: ParsedBlob, *, reuse: bool = False) -> tuple[Header, memoryview]:
    """The plain header and payload that lossless blob ``p`` (parsed, CRC checked) codes, with no
    plain header written or parsed (decode). ``reuse``: the payload lies in this thread's reused
    buffer (:func:`_scratch_view`), valid until the thread's next ``expand_payload(reuse=True)`` or
    lossless encode: for a caller that copies everything out of it before then (a decode into ``out_k``
    and ``out_v``)."""
    e = Expansion(p, reuse=reuse)
    e.fill()
    return e.header, e.payload


def expand_blob(p: ParsedBlob, *, crc: bool = True, into: Callable[[int], Any] | None = None) -> Any:
    """The plain blob that lossless blob ``p`` (parsed, CRC checked) codes, byte for byte: a new
    bytearray, or with ``into`` a view of the start of ``into(size)``, a writable buffer of at least
    ``size`` bytes (a read pool's: reused memory costs no page faults, where a fresh buffer per blob
    faults in every page it writes).

    ``crc=False`` leaves the plain header's CRC field 0 instead of computing it over the payload: for
    a caller that parses the result with ``verify_crc=False`` and never hands it on."""
    c = _coding(p)
    plain = c.plain
    hs = p.header_len  # the plain header has the same fields and strings: the same size
    size = hs + plain.payload_len
    out = new_buffer(size) if into is None else into(size)
    mv = memoryview(out)
    if into is not None:
        if mv.readonly or mv.nbytes < size:
            raise _refuse(f"into({size}) gave {mv.nbytes} bytes{', read-only' if mv.readonly else ''}")
        mv = mv.cast("B")[:size]
    _expand_into(c, p, mv, hs)
    mv[:hs] = serialize_header(plain, [mv[hs:]]) if crc else serialize_header(plain, crc=0)
    return out if into is None else mv
