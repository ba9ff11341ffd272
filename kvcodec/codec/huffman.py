"""The Huffman stream of the lossless payload (schemes LOSSLESS_HUFF / LOSSLESS_HUFF_UNIT) in Python.

The same coder as ``kvcodec/csrc/huff.c``, byte for byte and refusal for refusal: the fallback when the
C extension is not built and the tests' oracle (``docs/FORMAT.md``, "Huffman stream"). A stream codes
n byte symbols with order-0 canonical Huffman codes of at most 11 bits:

* 128 bytes: symbol s's code length (0 = absent) in the low nibble of byte s // 2 for even s, the high
  nibble for odd s;
* lanes 0..2's stored lengths (``<3I``); lane 3 takes the rest;
* the lanes: the n symbols cut in four runs of q = ceil(n / 4) (the last ones shorter or empty), each
  packed LSB first (codes bit-reversed, as deflate packs them) and padded with zero bits to a byte.

Lengths come from Huffman's two-queue construction over the symbols sorted by (count, symbol), a tie
taking the leaf first; lengths over 11 are cut to 11 and the Kraft excess is given back by splitting the
longest shorter code, once per 11-bit code dropped (deflate's classic fix); then the most frequent
symbols take the shortest lengths. One distinct symbol takes length 1. Codes are canonical (by length,
then symbol). A section's streams (:func:`encode_section`) take the lengths of all their symbols together
where those cost a stream at most 1 / SHARE_SLACK more bits than its own (a decoder builds one table for
them), else their own.

Encoding is numpy (vectorised bit packing); decoding a loop per symbol (about a microsecond each):
the fallback is for correctness, not speed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..format.coding import (
    HUFF_ERRORS,
    HUFF_HEAD_BYTES,
    HUFF_LANE_LENS,
    HUFF_LANES,
    HUFF_MAX_LEN,
    HUFF_TABLE_BYTES,
)

__all__ = [
    "SHARE_SLACK",
    "HuffmanError",
    "code_lengths",
    "decode",
    "encode",
    "encode_section",
    "lane_counts",
    "section_lengths",
]

_TABLE = 1 << HUFF_MAX_LEN
SHARE_SLACK = 32
"""A stream takes its section's shared code lengths at a cost of at most 1 / SHARE_SLACK more bits (huff.h's
HUFF_SHARE_SLACK: keep them in step)."""
_HOLE = 0x8000


class HuffmanError(ValueError):
    """A stream refused: ``code`` is the refusal's number (``HUFF_ERRORS``), the same as the C decoder's."""

    def __init__(self, code: int) -> None:
        super().__init__(HUFF_ERRORS[code])
        self.code = code


def lane_counts(n: int) -> list[int]:
    """Symbols in each lane: n cut in runs of ceil(n / 4), the last ones shorter or empty."""
    q = -(-n // HUFF_LANES)
    return [max(0, min(q, n - q * i)) for i in range(HUFF_LANES)]


def code_lengths(freq: Any) -> list[int]:
    """The code length of each of the 256 symbols counted in ``freq`` (0 = absent)."""
    items = sorted((int(f), s) for s, f in enumerate(freq) if f)
    lens = [0] * 256
    m = len(items)
    if m == 0:
        return lens
    if m == 1:
        lens[items[0][1]] = 1
        return lens
    w = [f for f, _ in items] + [0] * (m - 1)
    parent = [0] * (2 * m - 1)
    li, ih, nt = 0, m, m
    for _ in range(m - 1):
        pick = []
        for _ in range(2):
            if li < m and (ih == nt or w[li] <= w[ih]):
                pick.append(li)
                li += 1
            else:
                pick.append(ih)
                ih += 1
        w[nt] = w[pick[0]] + w[pick[1]]
        parent[pick[0]] = parent[pick[1]] = nt
        nt += 1
    depth = [0] * (2 * m - 1)
    for i in range(2 * m - 3, -1, -1):
        depth[i] = depth[parent[i]] + 1
    count = [0] * (HUFF_MAX_LEN + 1)
    for i in range(m):
        count[min(depth[i], HUFF_MAX_LEN)] += 1
    total = sum(count[n] << (HUFF_MAX_LEN - n) for n in range(1, HUFF_MAX_LEN + 1))
    while total != _TABLE:
        count[HUFF_MAX_LEN] -= 1
        for n in range(HUFF_MAX_LEN - 1, 0, -1):
            if count[n]:
                count[n] -= 1
                count[n + 1] += 2
                break
        total -= 1
    i = m - 1
    for n in range(1, HUFF_MAX_LEN + 1):
        for _ in range(count[n]):
            lens[items[i][1]] = n
            i -= 1
    return lens


def _codes(lens: list[int]) -> list[int]:
    """Canonical codes of ``lens``, bit-reversed (LSB-first packing)."""
    count = [0] * (HUFF_MAX_LEN + 1)
    for n in lens:
        count[n] += 1
    count[0] = 0
    nxt = [0] * (HUFF_MAX_LEN + 2)
    for n in range(1, HUFF_MAX_LEN + 1):
        nxt[n + 1] = (nxt[n] + count[n]) << 1
    codes = [0] * 256
    for s, n in enumerate(lens):
        if n:
            c = nxt[n]
            nxt[n] += 1
            codes[s] = int(f"{c:0{n}b}"[::-1], 2)
    return codes


def _pack(sym: np.ndarray, code: np.ndarray, length: np.ndarray) -> bytes:
    """One lane: the symbols' codes packed LSB first, padded with zero bits to a byte."""
    c, n = code[sym].astype(np.int64), length[sym].astype(np.int64)
    total = int(n.sum())
    bits = np.zeros(-(-total // 8) * 8, np.uint8)
    at = np.cumsum(n) - n
    for b in range(HUFF_MAX_LEN):
        m = n > b
        bits[at[m] + b] = (c[m] >> b) & 1
    return np.packbits(bits, bitorder="little").tobytes()


def encode(symbols: Any, lens: list[int] | None = None) -> bytes:
    """The Huffman stream of ``symbols`` (a 1-D uint8 array or bytes-like): with its own code lengths, or
    ``lens`` (which must give every present symbol a code)."""
    sym = _flat(symbols)
    freq = np.bincount(sym, minlength=256)
    lens = code_lengths(freq) if lens is None else lens
    if any(f and not n for f, n in zip(freq, lens, strict=True)):
        raise ValueError("the lengths give no code to a symbol the stream holds")
    code, length = np.array(_codes(lens), np.int64), np.array(lens, np.int64)
    lanes, at = [], 0
    for c in lane_counts(sym.size):
        lanes.append(_pack(sym[at : at + c], code, length))
        at += c
    table = bytes(lens[2 * i] | lens[2 * i + 1] << 4 for i in range(HUFF_TABLE_BYTES))
    return table + HUFF_LANE_LENS.pack(*(len(x) for x in lanes[:-1])) + b"".join(lanes)


def _flat(symbols: Any) -> np.ndarray:
    return np.frombuffer(symbols, np.uint8) if not isinstance(symbols, np.ndarray) else symbols.reshape(-1)


def section_lengths(freqs: list[Any]) -> list[list[int]]:
    """Each stream's code lengths in a section of streams with symbol counts ``freqs``: the section's
    shared lengths (of all its symbols together) where they cost the stream at most 1 / SHARE_SLACK more
    bits than its own, else its own (huff.c's huff_encode_section: a decoder builds shared tables once)."""
    shared = code_lengths(np.sum(freqs, axis=0, dtype=np.int64) if freqs else np.zeros(256, np.int64))
    out = []
    for f in freqs:
        own = code_lengths(f)
        bits = [int(np.dot(np.asarray(f, np.int64), lens)) for lens in (shared, own)]
        out.append(shared if bits[0] * SHARE_SLACK <= bits[1] * (SHARE_SLACK + 1) else own)
    return out


def encode_section(streams: list[Any]) -> list[bytes]:
    """The Huffman streams of a section's ``streams`` (each a 1-D uint8 array or bytes-like), with the
    lengths of :func:`section_lengths`: huff.c's bytes."""
    syms = [_flat(x) for x in streams]
    lens = section_lengths([np.bincount(x, minlength=256) for x in syms])
    return [encode(x, n) for x, n in zip(syms, lens, strict=True)]


def _lane(data: bytes, start: int, end: int, t: list[int], out: np.ndarray) -> None:
    """Decode one lane ``data[start:end]`` into ``out`` (every symbol), or raise its refusal."""
    buf = bits = 0
    p = start
    for k in range(out.size):
        while bits <= 56 and p < end:
            buf |= data[p] << bits
            p += 1
            bits += 8
        e = t[buf & (_TABLE - 1)]
        if e & _HOLE:
            raise HuffmanError(6)
        n = (e >> 8) & 15
        if n > bits:
            raise HuffmanError(7)
        out[k] = e & 0xFF
        buf >>= n
        bits -= n
    used = (p - start) * 8 - bits
    if -(-used // 8) != end - start:
        raise HuffmanError(8)
    if used & 7 and data[start + used // 8] >> (used & 7):
        raise HuffmanError(9)


def decode(stream: Any, n: int) -> np.ndarray:
    """The ``n`` symbols of Huffman stream ``stream``, or :class:`HuffmanError` (the first refusal: the
    stream's head, then each lane in order)."""
    data = bytes(stream)
    if len(data) < HUFF_HEAD_BYTES:
        raise HuffmanError(1)
    lens = [0] * 256
    for i in range(HUFF_TABLE_BYTES):
        lens[2 * i], lens[2 * i + 1] = data[i] & 15, data[i] >> 4
    if max(lens) > HUFF_MAX_LEN:
        raise HuffmanError(2)
    kraft = sum(1 << (HUFF_MAX_LEN - x) for x in lens if x)
    if kraft > _TABLE:
        raise HuffmanError(3)
    if not kraft and n:
        raise HuffmanError(4)
    sizes, rest = [], len(data) - HUFF_HEAD_BYTES
    for x in HUFF_LANE_LENS.unpack_from(data, HUFF_TABLE_BYTES):
        if x > rest:
            raise HuffmanError(5)
        sizes.append(x)
        rest -= x
    sizes.append(rest)
    t = [_HOLE | HUFF_MAX_LEN << 8] * _TABLE
    for s, c in enumerate(_codes(lens)):
        if lens[s]:
            for j in range(c, _TABLE, 1 << lens[s]):
                t[j] = s | lens[s] << 8
    out = np.empty(n, np.uint8)
    at, o = HUFF_HEAD_BYTES, 0
    for size, c in zip(sizes, lane_counts(n), strict=True):
        _lane(data, at, at + size, t, out[o : o + c])
        at += size
        o += c
    return out
