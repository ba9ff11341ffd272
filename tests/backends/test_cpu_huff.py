"""The lossless payload's Huffman streams (kvcodec/csrc/huff.c) against their Python oracle
(kvcodec.codec.huffman): the same bytes written, the same symbols or the same refusal read, on random,
skewed and hostile inputs; every refusal by its code, and through a blob as BAD_STREAM."""

from __future__ import annotations

import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec.backends import cpu
from kvcodec.codec import huffman
from kvcodec.codec.lossless import compress_blob
from kvcodec.errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from kvcodec.format import assemble, parse, read_coding
from kvcodec.format.coding import (
    HUFF_ERRORS,
    HUFF_HEAD_BYTES,
    HUFF_LANE_LENS,
    HUFF_MAX_LEN,
    HUFF_TABLE_BYTES,
    max_stream_len,
    pack_table,
)

pytestmark = pytest.mark.skipif(not cpu.AVAILABLE, reason=cpu.REASON)


def c_encode(sym: np.ndarray) -> bytes:
    """huff.c's stream of ``sym``, coded into an output of exactly the bound's size (numpy's own
    allocation: under AddressSanitizer a byte written past it is caught)."""
    n = sym.size
    out = np.empty(max_stream_len(n, huffman=True), np.uint8)
    got = cpu.huff_encode(sym.copy(), 0, n, max(n, 1), max(n, 1), out, 0)
    assert got is not None and got > 0
    return out[:got].tobytes()


def c_decode(stream: bytes, n: int) -> tuple[int, bytes]:
    """huff.c's decode of ``stream`` held in a buffer of exactly its size, into one of exactly n bytes
    (under AddressSanitizer a byte read or written past either is caught)."""
    src, out = np.frombuffer(stream, np.uint8).copy(), np.empty(n, np.uint8)
    code = cpu.huff_decode(src, 0, len(stream), n, out, 0, max(n, 1), max(n, 1))
    return code, out.tobytes()


def py_decode(stream: bytes, n: int) -> tuple[int, bytes | None]:
    try:
        return 0, huffman.decode(stream, n).tobytes()
    except huffman.HuffmanError as e:
        return e.code, None


def _fib_freqs(m: int) -> np.ndarray:
    """Symbols with Fibonacci counts: a Huffman tree m - 1 deep, so the 11-bit limit has to cut it."""
    f = [1, 1]
    while len(f) < m:
        f.append(f[-1] + f[-2])
    return np.repeat(np.arange(m, dtype=np.uint8), f[:m])


def _symbols(kind: str, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.integers(0, 256, n, dtype=np.uint8)
    if kind == "one":
        return np.full(n, 77, np.uint8)
    if kind == "two":
        return rng.integers(5, 7, n, dtype=np.uint8)
    if kind == "exponents":  # K's high bytes: a few exponents, short codes (the decoder's runs of three)
        return (120 + rng.geometric(0.5, n)).clip(0, 255).astype(np.uint8)
    if kind == "gauss":  # V's FP8 codes
        return rng.normal(0, 40, n).clip(-127, 127).astype(np.int8).view(np.uint8)
    if (
        kind == "signed"
    ):  # bf16 K's high bytes: a sign and the exponent's top, both signs (compared, not counted)
        return (rng.integers(0x38, 0x43, n) | (rng.integers(0, 2, n) << 7)).astype(np.uint8)
    if kind == "negative":  # one sign only, 32 values: the most the compares take
        return rng.integers(0xA0, 0xC0, n, dtype=np.uint8)
    if kind == "wide33":  # 33 values: one past them (counted per byte)
        return rng.integers(0x20, 0x41, n, dtype=np.uint8)
    if kind == "quads":  # V's exponents: four 2-bit codes, the rest longer (the decoder's runs of five)
        common = rng.integers(6, 10, n, dtype=np.uint8)
        return np.where(rng.random(n) < 0.92, common, rng.integers(0, 16, n, dtype=np.uint8)).astype(np.uint8)
    if kind == "all256":
        return np.resize(rng.permutation(256).astype(np.uint8), n)
    raise AssertionError(kind)


KINDS = ["uniform", "one", "two", "exponents", "gauss", "all256", "quads", "signed", "negative", "wide33"]
SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 63, 64, 65, 257, 4099, 40000]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
def test_c_writes_the_oracles_bytes_and_both_read_them(kind, n) -> None:
    sym = _symbols(kind, n, seed=n)
    stream = c_encode(sym)
    assert stream == huffman.encode(sym)
    assert len(stream) <= max_stream_len(n, huffman=True)
    assert c_decode(stream, n) == (0, sym.tobytes())
    assert py_decode(stream, n) == (0, sym.tobytes())


def test_the_stream_layout() -> None:
    """128 bytes of nibbles (low = even symbol), three lane lengths, four lanes of ceil(n / 4)."""
    sym = np.array([3, 3, 3, 3, 3, 4, 4, 200], np.uint8)  # 3: code 0 (1 bit); 4: 10; 200: 11
    stream = huffman.encode(sym)
    lens = [0] * 256
    for i, b in enumerate(stream[:HUFF_TABLE_BYTES]):
        lens[2 * i], lens[2 * i + 1] = b & 15, b >> 4
    assert (lens[3], lens[4], lens[200], sum(1 for x in lens if x)) == (1, 2, 2, 3)
    assert stream[1] == 0x10 and stream[2] == 0x02  # symbol 3: high nibble of byte 1; symbol 4: low of 2
    assert HUFF_LANE_LENS.unpack_from(stream, HUFF_TABLE_BYTES) == (1, 1, 1)
    # lanes of 2: [3, 3] -> bits 0, 0; [3, 3]; [3, 4] -> 0 then 10 reversed = 01 -> byte 0b010;
    # [4, 200] -> code 10 packed LSB first as bits 0,1 ... -> 0b1101
    assert stream[HUFF_HEAD_BYTES:] == bytes([0, 0, 0b010, 0b1101])
    assert huffman.lane_counts(5) == [2, 2, 1, 0] and huffman.lane_counts(1) == [1, 0, 0, 0]


def test_lengths_are_limited_deterministic_and_complete() -> None:
    sym = _fib_freqs(30)
    lens = huffman.code_lengths(np.bincount(sym, minlength=256))
    assert max(lens) == HUFF_MAX_LEN and sum(2.0**-x for x in lens if x) == 1.0
    assert c_encode(sym) == huffman.encode(sym)
    assert c_decode(c_encode(sym), sym.size) == (0, sym.tobytes())
    one = huffman.code_lengths(np.bincount(np.full(5, 9, np.uint8), minlength=256))
    assert one[9] == 1 and sum(one) == 1  # one distinct symbol: length 1, code 0
    tie = huffman.code_lengths([1] * 256)
    assert set(tie) == {8}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(min_size=1, max_size=3000), skew=st.integers(0, 7))
def test_round_trips_match_the_oracle(data, skew) -> None:
    sym = np.frombuffer(data, np.uint8) >> skew  # fewer, more skewed symbols as skew grows
    stream = c_encode(sym)
    assert stream == huffman.encode(sym)
    assert c_decode(stream, sym.size) == (0, sym.tobytes()) == py_decode(stream, sym.size)


def _stream(lens: dict[int, int], lanes: list[bytes]) -> bytes:
    table = bytearray(HUFF_TABLE_BYTES)
    for s, n in lens.items():
        table[s // 2] |= n << (4 * (s % 2))
    return bytes(table) + HUFF_LANE_LENS.pack(*(len(x) for x in lanes[:3])) + b"".join(lanes)


HOSTILE = {
    1: (b"\x00" * (HUFF_HEAD_BYTES - 1), 1),
    2: (_stream({0: 12}, [b"\x00", b"", b"", b""]), 1),
    3: (_stream({0: 1, 1: 1, 2: 1}, [b"\x00", b"", b"", b""]), 1),
    4: (_stream({}, [b"", b"", b"", b""]), 4),
    # lanes 0..2 declare 1 + 0 + 1 bytes; 1 follows the head
    5: (bytes([0x11]) + bytes(HUFF_TABLE_BYTES - 1) + HUFF_LANE_LENS.pack(1, 0, 1) + b"\x00", 1),
    6: (_stream({0: 1}, [b"\x01", b"", b"", b""]), 1),
    7: (_stream({0: 1, 1: 1}, [b"", b"", b"", b""]), 1),
    8: (_stream({0: 1, 1: 1}, [b"\x00\x00", b"", b"", b""]), 1),
    9: (_stream({0: 1, 1: 1}, [b"\x02", b"", b"", b""]), 1),
}


@pytest.mark.parametrize("code", sorted(HUFF_ERRORS))
def test_each_refusal_by_its_code(code) -> None:
    stream, n = HOSTILE[code]
    assert c_decode(stream, n)[0] == code
    assert py_decode(stream, n)[0] == code


def test_a_lane_after_a_good_one_is_the_one_named() -> None:
    """The first failing lane in order, whichever loop met it: lane 0 good, lane 1 short."""
    good = huffman.encode(np.zeros(400, np.uint8) | (np.arange(400) % 2).astype(np.uint8))
    a, b, c = HUFF_LANE_LENS.unpack_from(good, HUFF_TABLE_BYTES)
    cut = good[: HUFF_HEAD_BYTES + a + b - 1] + good[HUFF_HEAD_BYTES + a + b :]
    cut = cut[:HUFF_TABLE_BYTES] + HUFF_LANE_LENS.pack(a, b - 1, c) + cut[HUFF_HEAD_BYTES:]
    assert c_decode(cut, 400)[0] == py_decode(cut, 400)[0] == 7


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    n=st.integers(1, 600),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
    cut=st.integers(0, 3),
    extra=st.binary(max_size=3),
    lane=st.none() | st.tuples(st.integers(0, 2), st.integers(0, 300)),
    n_delta=st.integers(-2, 2),
)
def test_hostile_streams_refused_alike(kind, n, edits, cut, extra, lane, n_delta) -> None:
    """Bytes changed, cut or added, lane lengths lying, a wrong symbol count: C and Python refuse with
    the same code, or decode the same symbols."""
    s = bytearray(huffman.encode(_symbols(kind, n, seed=n)))
    for at, b in edits:
        s[at % len(s)] = b
    if lane is not None:
        struct.pack_into("<I", s, HUFF_TABLE_BYTES + 4 * lane[0], lane[1])
    s = bytes(s[: len(s) - cut]) + extra
    m = max(1, n + n_delta)
    got, want = c_decode(s, m), py_decode(s, m)
    assert got[0] == want[0]
    if not got[0]:
        assert got[1] == want[1]


def _drifting(n: int, seed: int, long_lane: int, common: int = 1) -> np.ndarray:
    """Symbols whose four lanes decode at different paces in the runs table: every lane but
    ``long_lane`` mostly ``common`` symbols (one: a 1-bit code, three a lookup; four: 2-bit codes, five
    a lookup from the table of long runs), ``long_lane`` spread over forty (one a lookup), so the lanes
    side by side stop with that one hundreds of symbols short."""
    rng = np.random.default_rng(seed)
    sym = np.where(rng.random(n) < 0.97, 120 + rng.integers(0, common, n), rng.integers(100, 140, n)).astype(
        np.uint8
    )
    q = (n + 3) // 4
    sym[long_lane * q : (long_lane + 1) * q] = rng.integers(
        100, 140, len(sym[long_lane * q : (long_lane + 1) * q])
    )
    return sym


def _shortest_code(sym: np.ndarray) -> int:
    lengths = np.asarray(huffman.code_lengths(np.bincount(sym, minlength=256)))
    return int(lengths[lengths > 0].min())


def test_a_stream_narrow_at_first_and_wide_later_codes_the_oracles_bytes() -> None:
    """A stream whose first 1 KiB holds a few values and the rest many (the compares' first look passes,
    the whole one does not: counted per byte), and the reverse: the oracle's bytes either way."""
    rng = np.random.default_rng(5)
    narrow, wide = rng.integers(0x38, 0x40, 1500, dtype=np.uint8), rng.integers(0, 256, 9000, dtype=np.uint8)
    for sym in (
        np.concatenate([narrow, wide]),
        np.concatenate([wide, narrow]),
        np.concatenate([narrow, narrow[:40] | 0x80]),
    ):
        assert c_encode(sym) == huffman.encode(sym)


def test_the_runs_kinds_take_the_tables_they_name() -> None:
    """The symbols the runs tests use have the shortest code each table of runs is built for: 1 bit (runs
    of three), 2 bits (runs of five: "quads", and drifting lanes of four common symbols)."""
    assert _shortest_code(_symbols("exponents", 4099)) == 1
    assert _shortest_code(_symbols("quads", 4099)) == 2
    assert _shortest_code(_drifting(4099, 1, 0)) == 1
    assert _shortest_code(_drifting(4099, 1, 0, common=4)) == 2


@pytest.mark.parametrize("common", [1, 4])
@pytest.mark.parametrize("long_lane", range(4))
@pytest.mark.parametrize("n", [4096, 4099, 40000, 40003])
def test_lanes_that_drift_apart_decode_as_the_oracle(long_lane, n, common) -> None:
    """The lanes' tails once they no longer all run side by side (two, then one at a time), in runs of
    up to three or up to five: the same symbols as the oracle, alone and in a section."""
    sym = _drifting(n, n + long_lane, long_lane, common)
    stream = huffman.encode(sym)
    assert c_decode(stream, n) == (0, sym.tobytes())
    src, spans, got = _section_of([sym, _drifting(n, 7, 3 - long_lane, common)])
    out = np.zeros(2 * n, np.uint8)
    assert cpu.huff_decode_many(src, spans, n, out, 0, n, n, n) is True
    assert out.tobytes() == b"".join(x.tobytes() for x in got)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    long_lane=st.integers(0, 3),
    common=st.sampled_from([1, 4]),
    edits=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=3),
)
def test_drifting_lanes_damaged_are_refused_alike(long_lane, common, edits) -> None:
    """Bytes changed anywhere in drifting lanes (the tails' loops included): C and Python refuse with the
    same code, or decode the same symbols."""
    n = 4099
    s = bytearray(huffman.encode(_drifting(n, 3, long_lane, common)))
    for at, b in edits:
        s[HUFF_HEAD_BYTES + int(at * (len(s) - HUFF_HEAD_BYTES - 1))] = b
    got, want = c_decode(bytes(s), n), py_decode(bytes(s), n)
    assert got[0] == want[0]
    if not got[0]:
        assert got[1] == want[1]


def test_strided_rows_in_and_out() -> None:
    """A head's codes read from and written to [tokens, heads, dim] rows in place."""
    t, heads, dim = 33, 3, 8
    codes = np.random.default_rng(1).integers(0, 40, (t, heads, dim), dtype=np.uint8)
    flat = codes.reshape(-1)
    out = bytearray(max_stream_len(t * dim, huffman=True))
    for h in range(heads):
        n = cpu.huff_encode(flat, h * dim, t * dim, dim, heads * dim, out, 0)
        stream = bytes(out[:n])
        assert stream == huffman.encode(np.ascontiguousarray(codes[:, h, :]))
        back = np.zeros_like(codes)
        assert cpu.huff_decode(stream, 0, n, t * dim, back.reshape(-1), h * dim, dim, heads * dim) == 0
        assert (
            np.array_equal(back[:, h, :], codes[:, h, :])
            and not back[:, [i for i in range(heads) if i != h]].any()
        )


def test_many_streams_in_one_call() -> None:
    t, heads, dim = 40, 4, 16
    codes = np.random.default_rng(2).normal(0, 9, (t, heads, dim)).astype(np.int8).view(np.uint8)
    out = bytearray(heads * max_stream_len(t * dim, huffman=True))
    lens = cpu.huff_encode_many(codes.reshape(-1), 0, dim, heads, t * dim, dim, heads * dim, out, 0)
    want = huffman.encode_section([np.ascontiguousarray(codes[:, h, :]) for h in range(heads)])
    at, spans = 0, []
    for h, n in enumerate(lens):
        assert bytes(out[at : at + n]) == want[h]
        spans.append((at, n))
        at += n
    back = np.zeros_like(codes)
    assert (
        cpu.huff_decode_many(bytes(out), spans, t * dim, back.reshape(-1), 0, dim, dim, heads * dim) is True
    )
    assert np.array_equal(back, codes)
    bad = bytearray(out)
    bad[spans[2][0]] = 0xFF  # stream 2's table: lengths of 15 bits
    assert cpu.huff_decode_many(bytes(bad), spans, t * dim, back.reshape(-1), 0, dim, dim, heads * dim) == (
        2,
        2,
    )


def _section_of(syms: list[np.ndarray]) -> tuple[bytes, list[tuple[int, int]], list[np.ndarray]]:
    """The oracle's streams of ``syms`` one after another, their spans, and the symbols."""
    streams = [huffman.encode(x) for x in syms]
    spans, at = [], 0
    for x in streams:
        spans.append((at, len(x)))
        at += len(x)
    return b"".join(streams), spans, syms


def _section(kinds: list[str], n: int) -> tuple[bytes, list[tuple[int, int]], list[np.ndarray]]:
    """Streams of n symbols one after another (as a section holds them): each of ``kinds``, and their
    spans and symbols."""
    rng = np.random.default_rng(n)
    syms = {
        "wide": lambda: rng.normal(128, 30, n).clip(0, 255).astype(np.uint8),  # ~7-bit codes: a pair's
        "short": lambda: rng.geometric(0.6, n).clip(0, 255).astype(np.uint8),  # runs table: alone
        "one": lambda: np.full(n, 9, np.uint8),  # an incomplete table: the careful loop, alone
    }
    return _section_of([syms[k]() for k in kinds])


def _one_at_a_time(src: bytes, spans, n: int, row: int, stride: int, step: int, size: int):
    """huff_decode stream by stream: the output and the first refusal, as huff_decode_many's."""
    out = np.zeros(size, np.uint8)
    for i, (at, length) in enumerate(spans):
        code = cpu.huff_decode(src, at, length, n, out, i * step, row, stride)
        if code:
            return out, (i, code)
    return out, True


KINDS = [
    ["wide", "wide"],
    ["wide", "wide", "wide"],
    ["wide", "short", "wide", "wide"],
    ["short", "wide", "wide", "one", "wide"],
    ["wide", "one", "wide", "wide", "wide", "wide"],
]


@pytest.mark.parametrize("kinds", KINDS, ids=["-".join(k) for k in KINDS])
@pytest.mark.parametrize("tokens,dim", [(40, 16), (41, 6), (16, 4), (12, 5)])  # n % 4: 0, 2; n = 64, 60
@pytest.mark.parametrize("rows", [True, False], ids=["rows", "planes"])
def test_streams_decoded_two_at_a_time_are_those_decoded_one_at_a_time(kinds, tokens, dim, rows) -> None:
    """huff_decode_many runs two streams' eight lanes side by side where both allow it (complete tables
    of long codes, n a multiple of 4): the same symbols as huff_decode one stream at a time, whatever
    mix of streams and lengths, into V's rows (strided: through a scratch) or K's plane (in place)."""
    n, heads = tokens * dim, len(kinds)
    src, spans, syms = _section(kinds, n)
    row, stride, step = (dim, heads * dim, dim) if rows else (n, n, n)
    want, ok = _one_at_a_time(src, spans, n, row, stride, step, heads * n)
    assert ok is True
    got = np.zeros(heads * n, np.uint8)
    assert cpu.huff_decode_many(src, spans, n, got, 0, step, row, stride) is True
    assert np.array_equal(got, want)
    laid = np.stack([x.reshape(tokens, dim) for x in syms], 1) if rows else np.stack(syms)
    assert np.array_equal(got, laid.reshape(-1))


@pytest.mark.parametrize("kinds", KINDS[1:3], ids=["-".join(k) for k in KINDS[1:3]])
@pytest.mark.parametrize("damaged", [(0,), (1,), (2,), (1, 2), (0, 1)])
@pytest.mark.parametrize("where", ["table", "lanes"])
def test_two_at_a_time_refuse_the_first_damaged_stream(kinds, damaged, where) -> None:
    """A damaged stream in a pair (either one, or both) is refused as one at a time refuses it: the first
    damaged stream in order, with the same code, whether its table (before the pair starts) or its lanes
    (found after the pair's loop) are damaged."""
    n = 40 * 16
    src, spans, _ = _section(kinds, n)
    bad = bytearray(src)
    for i in damaged:
        at = spans[i][0]
        if where == "table":
            bad[at] = 0xFF  # a code length of 15 bits
        else:  # lane 0 a byte shorter: it runs out of bits (and lane 3 holds a byte too many)
            (lane0,) = struct.unpack_from("<I", bad, at + HUFF_TABLE_BYTES)
            struct.pack_into("<I", bad, at + HUFF_TABLE_BYTES, lane0 - 1)
    _, want = _one_at_a_time(bytes(bad), spans, n, 16, 16 * len(kinds), 16, len(kinds) * n)
    assert want is not True and want[0] == damaged[0]
    got = cpu.huff_decode_many(
        bytes(bad), spans, n, np.zeros(len(kinds) * n, np.uint8), 0, 16, 16, 16 * len(kinds)
    )
    assert got == want


def _tables_section(pattern: str, n: int) -> tuple[bytes, list[tuple[int, int]]]:
    """Streams of n symbols coded with the lengths ``pattern`` names, one letter a stream: A and C two
    tables of long codes (the two-at-a-time loop), B one of short codes (the runs table)."""
    rng = np.random.default_rng(len(pattern))
    draw = {
        "A": lambda: rng.normal(128, 30, n).clip(0, 255).astype(np.uint8),
        "C": lambda: rng.normal(100, 20, n).clip(0, 255).astype(np.uint8),
        "B": lambda: rng.geometric(0.6, n).clip(0, 255).astype(np.uint8),
    }
    syms = [draw[t]() for t in pattern]
    freq = {
        t: sum(np.bincount(x, minlength=256) for x, u in zip(syms, pattern) if u == t) for t in set(pattern)
    }
    lens = {t: huffman.code_lengths(f) for t, f in freq.items()}
    streams = [huffman.encode(x, lens[t]) for x, t in zip(syms, pattern)]
    spans, at = [], 0
    for x in streams:
        spans.append((at, len(x)))
        at += len(x)
    return b"".join(streams), spans


PATTERNS = ["AAAA", "ACAC", "AACC", "ABAC", "CABAC", "ABBA", "BBAB"]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("rows", [True, False], ids=["rows", "planes"])
@pytest.mark.parametrize("damaged", [None, 1, 3])
def test_streams_that_share_lengths_decode_as_one_at_a_time(pattern, rows, damaged) -> None:
    """huff_decode_many keeps the last two tables built and hands them to a stream whose lengths are the
    same bytes: the same symbols and refusals as huff_decode stream by stream, whichever order the
    tables come back in (a pair sharing one table, or two; the runs table reused), a lane damaged in a
    stream that reuses a table included."""
    tokens, dim = 40, 16
    n, heads = tokens * dim, len(pattern)
    src, spans = _tables_section(pattern, n)
    if damaged is not None:
        bad = bytearray(src)
        at = spans[damaged][0] + HUFF_TABLE_BYTES
        struct.pack_into("<I", bad, at, struct.unpack_from("<I", bad, at)[0] - 1)  # lane 0 runs short
        src = bytes(bad)
    row, stride, step = (dim, heads * dim, dim) if rows else (n, n, n)
    want, ok = _one_at_a_time(src, spans, n, row, stride, step, heads * n)
    assert (ok is True) == (damaged is None)
    got = np.zeros(heads * n, np.uint8)
    assert cpu.huff_decode_many(src, spans, n, got, 0, step, row, stride) == ok
    if damaged is None:
        assert np.array_equal(got, want)


@pytest.mark.parametrize(
    "kinds", [["wide", "wide", "wide"], ["wide", "short", "wide"], ["short", "one", "short"]]
)
def test_a_section_shares_lengths_where_they_cost_little(kinds) -> None:
    """huff_encode_many gives a section's streams its shared lengths where they cost a stream at most
    1/32 more bits than its own (so a decoder builds the table once), else the stream's own: the
    oracle's choice and bytes, and no stream over the bound."""
    n, rng = 40 * 16, np.random.default_rng(3)
    pick = {
        "wide": lambda: rng.normal(128, 30, n).clip(0, 255).astype(np.uint8),
        "short": lambda: rng.geometric(0.6, n).clip(0, 255).astype(np.uint8),
        "one": lambda: np.full(n, 9, np.uint8),
    }
    syms = [pick[k]() for k in kinds]
    freqs = [np.bincount(x, minlength=256) for x in syms]
    lens = huffman.section_lengths(freqs)
    shared = huffman.code_lengths(sum(freqs))
    for f, chosen in zip(freqs, lens, strict=True):
        own = huffman.code_lengths(f)
        bits = [int(np.dot(f, x)) for x in (chosen, own, shared)]
        assert bits[0] * 32 <= bits[1] * 33
        assert chosen == (shared if bits[2] * 32 <= bits[1] * 33 else own)
    if kinds == ["wide", "wide", "wide"]:
        assert lens[0] == lens[1] == lens[2] == shared  # like streams: one table
    if kinds == ["short", "one", "short"]:
        assert lens[1] != shared  # one symbol alone: its own one-bit code
    out = bytearray(sum(map(len, huffman.encode_section(syms))))
    flat = np.concatenate(syms)
    got = cpu.huff_encode_many(flat, 0, n, len(kinds), n, n, n, out, 0)
    assert bytes(out) == b"".join(huffman.encode_section(syms)) and sum(got) == len(out)


def _few(kind: str, n: int, rng) -> np.ndarray:
    """Symbols from a few dozen, skewed as K's exponents are (a table of their pairs): A and B the same
    symbols, B's spread wider (it keeps its own lengths beside A's), C others."""
    low, p = {"A": (0, 0.35), "B": (0, 0.15), "C": (100, 0.35)}[kind]
    return (low + rng.geometric(p, n).clip(1, 30)).astype(np.uint8)


@pytest.mark.parametrize("n", [4096, 4097, 4098, 4099, 4102, 40000])
@pytest.mark.parametrize("pattern", ["AAAA", "AABA", "ABAB", "CAAC"])
def test_few_symbols_are_coded_two_a_lookup_as_one_at_a_time(n, pattern) -> None:
    """Where a section's streams hold few byte symbols huff_encode_many codes two a lookup (a table of
    their pairs, filled for the shared lengths and again for each stream's own): byte for byte the
    oracle's streams, whatever mix of shared and own lengths and lane tails (n % 4 and lane counts odd
    and even)."""
    rng = np.random.default_rng(n)
    syms = [_few(t, n, rng) for t in pattern]
    freqs = [np.bincount(x, minlength=256) for x in syms]
    shared = huffman.code_lengths(sum(freqs))
    took = [x == shared for x in huffman.section_lengths(freqs)]
    assert pattern != "AABA" or took == [True, True, False, True]  # shared, own, shared again
    want = huffman.encode_section(syms)
    out = bytearray(sum(map(len, want)))
    got = cpu.huff_encode_many(np.concatenate(syms), 0, n, len(syms), n, n, n, out, 0)
    assert got == [len(w) for w in want] and bytes(out) == b"".join(want)


def test_a_section_that_cannot_fit_its_output_is_refused_before_its_work_is_sized() -> None:
    """A count of streams whose heads alone overflow the output: "do not fit", with no work allocated for
    each of 2^24 streams (a section's counts take ~10 KiB a stream)."""
    with pytest.raises(UnsupportedConfigError, match="do not fit"):
        cpu.huff_encode_many(np.zeros(16, np.uint8), 0, 0, 2**24, 0, 1, 1, bytearray(1 << 20), 0)
    with pytest.raises(UnsupportedConfigError, match="do not fit"):
        cpu.huff_encode_pairs_many(np.zeros(16, np.uint8), 0, 0, 2**24, 8, bytearray(1 << 20), 0)


def test_the_oracle_refuses_lengths_that_leave_a_symbol_without_a_code() -> None:
    sym = np.array([1, 2, 2, 3], np.uint8)
    lens = huffman.code_lengths(np.bincount(sym, minlength=256))
    assert huffman.encode(sym, lens) == huffman.encode(sym)
    lens[3] = 0
    with pytest.raises(ValueError, match="no code"):
        huffman.encode(sym, lens)


def test_the_encoder_stays_inside_its_capacity() -> None:
    sym = _symbols("uniform", 5000)
    need = len(huffman.encode(sym))
    buf = bytearray(b"\xaa" * (need + 64))
    assert cpu.huff_encode(sym, 0, sym.size, sym.size, sym.size, memoryview(buf)[: need - 1], 0) == -1
    assert cpu.huff_encode(sym, 0, sym.size, sym.size, sym.size, memoryview(buf)[:need], 0) == need
    assert buf[need:] == b"\xaa" * 64
    with pytest.raises(UnsupportedConfigError):
        cpu.huff_encode_many(sym, 0, 0, 2, sym.size, sym.size, sym.size, bytearray(need + 10), 0)


@pytest.mark.parametrize(
    "args",
    [
        (b"\x00" * 200, 0, 201, 4, bytearray(4), 0, 4, 4),  # the stream past its buffer
        (b"\x00" * 200, 0, 200, 8, bytearray(4), 0, 8, 8),  # the symbols past the output
        (b"\x00" * 200, 0, 200, 8, bytearray(10), 0, 4, 8),  # rows past the output (2 rows of 4 at stride 8)
        (b"\x00" * 200, 0, 200, 6, bytearray(64), 0, 4, 8),  # n not a multiple of row
        (b"\x00" * 200, 0, 200, 4, bytearray(64), 0, 8, 4),  # row over stride
    ],
)
def test_spans_outside_their_buffers_are_refused(args) -> None:
    src, at, length, n, out, out_at, row, stride = args
    with pytest.raises(UnsupportedConfigError):
        cpu.huff_decode(src, at, length, n, out, out_at, row, stride)


def test_a_stream_and_its_output_may_not_overlap() -> None:
    buf = bytearray(huffman.encode(np.zeros(64, np.uint8)) + bytes(64))
    with pytest.raises(UnsupportedConfigError):
        cpu.huff_decode(buf, 0, len(buf) - 64, 64, buf, len(buf) - 64, 64, 64)


# ------------------------------------------------------------------------------ through a blob


def _huff_blob() -> tuple[bytearray, object]:
    g = torch.Generator().manual_seed(5)
    k = (torch.randn(25, 2, 8, generator=g) * 3).to(torch.bfloat16)  # 200 symbols a stream: lanes of 50
    v = torch.randn(25, 2, 8, generator=g).to(torch.bfloat16)
    b = compress_blob(kvcodec.encode(k, v, scope="per_tensor"), coder="huffman")  # V's streams of any symbol
    return b, parse(b)


@pytest.mark.parametrize("code", sorted(HUFF_ERRORS))
@pytest.mark.parametrize("section", ["K", "V"])
def test_a_blob_with_a_refused_stream_is_bad_stream(code, section) -> None:
    """Each refusal in a blob whose tables and CRC are valid: CorruptEncodedKVError(BAD_STREAM) naming it."""
    _, p = _huff_blob()
    c = read_coding(p.header, p.k, p.v)
    raw = c.stream_raw
    stream, n = HOSTILE[code]
    if code in (1, 4) or n != raw:  # the stream must decode to the geometry's symbol count
        stream = _hostile_for(code, raw)
    sec, buf = (c.k, p.k) if section == "K" else (c.v, p.v)
    streams = [bytes(buf[a : a + m]) for a, m in sec.streams]
    streams[1] = stream
    lengths = [len(s) for s in streams]
    if section == "K":
        k = pack_table(lengths) + b"".join(streams) + bytes(buf[sec.raw_at :])
        hostile = assemble(p.header, k, p.v, p.scales)
    else:
        v = pack_table(lengths, c.tokens) + b"".join(streams)
        hostile = assemble(p.header, p.k, v, p.scales)
    try:
        parsed = parse(hostile)
    except (
        CorruptEncodedKVError
    ) as e:  # a stream under the table's bounds (code 1's 139 bytes) is refused there
        assert e.reason == Reason.INCONSISTENT_PAYLOAD and code == 1
        return
    with pytest.raises(CorruptEncodedKVError) as e:
        kvcodec.decode(parsed)
    assert e.value.reason == Reason.BAD_STREAM
    assert f"{section} stream 1" in str(e.value) and HUFF_ERRORS[code] in str(e.value)


def _hostile_for(code: int, n: int) -> bytes:
    """Refusal ``code`` in a stream of ``n`` symbols (lane 0 takes ceil(n / 4))."""
    q = -(-n // 4)
    ones = {0: 1, 1: 1}
    full = [b"\x00" * -(-q // 8)] * 3 + [b"\x00" * -(-(n - 3 * q) // 8)]
    if code == 1:
        return b"\x00" * (HUFF_HEAD_BYTES - 1)
    if code == 2:
        return _stream({0: 12}, full)
    if code == 3:
        return _stream({0: 1, 1: 1, 2: 1}, full)
    if code == 4:
        return _stream({}, full)
    if code == 5:
        s = _stream(ones, full)
        return s[:HUFF_TABLE_BYTES] + HUFF_LANE_LENS.pack(len(s), 0, 0) + s[HUFF_HEAD_BYTES:]
    if code == 6:
        return _stream({0: 1}, [b"\xff" * len(full[0]), *full[1:]])
    if code == 7:
        return _stream(ones, [full[0][:-1], *full[1:]])
    if code == 8:
        return _stream(ones, [full[0] + b"\x00", *full[1:]])
    if code == 9:
        pad = q % 8
        assert pad, "the geometry leaves no padding bits"
        last = bytes([1 << pad])
        return _stream(ones, [full[0][:-1] + last, *full[1:]])
    raise AssertionError(code)


def _exponents(kind: str, n: int, seed: int = 0) -> np.ndarray:
    """Symbols below 16, as V's exponents are: skewed like real ones, uniform, one or two of them."""
    rng = np.random.default_rng(seed)
    if kind == "skewed":
        return (15 - rng.geometric(0.4, n)).clip(0, 15).astype(np.uint8)
    if kind == "uniform":
        return rng.integers(0, 16, n, dtype=np.uint8)
    if kind == "one":
        return np.full(n, 9, np.uint8)
    if kind == "fib":  # lengths the 11-bit limit cuts: pair codes of up to 22 bits
        return np.resize(_fib_freqs(16), n)
    return rng.integers(3, 5, n, dtype=np.uint8)


@pytest.mark.parametrize("kind", ["skewed", "uniform", "one", "fib", "two"])
@pytest.mark.parametrize("n", [0, 8, 16, 64, 200, 4096, 40000])
def test_pairs_code_the_bytes_of_one_symbol_at_a_time(kind, n) -> None:
    """huff_encode_pairs (two exponents a byte, counted and coded a pair at a time): byte for byte the
    oracle's streams of the same symbols (a section of two: shared lengths or each its own), into an
    output of exactly their size; one stream alone, its own lengths."""
    a, b = _exponents(kind, n, seed=n), _exponents(kind, n, seed=n + 1)
    pairs = np.concatenate([s[0::2] | (s[1::2] << 4) for s in (a, b)]).astype(np.uint8)
    want = huffman.encode_section([a, b])
    one = np.empty(len(huffman.encode(a)), np.uint8)
    assert cpu.huff_encode_pairs_many(pairs, 0, n // 2, 1, n, one, 0) == [one.size]
    assert one.tobytes() == huffman.encode(a)
    out = np.empty(sum(map(len, want)), np.uint8)
    assert cpu.huff_encode_pairs_many(pairs, 0, n // 2, 2, n, out, 0) == [len(w) for w in want]
    assert out.tobytes() == b"".join(want)
    with pytest.raises(UnsupportedConfigError, match="do not fit"):
        cpu.huff_encode_pairs_many(pairs, 0, n // 2, 2, n, out[:-1], 0)


@pytest.mark.parametrize("level", ["scalar", "avx2"])
def test_each_level_below_the_hosts_codes_the_same_bytes(level) -> None:
    """KVCODEC_CPU_LEVEL=scalar: a pairs stream's symbols counted from its pair bytes' counts instead of by
    nibble counters, K's high bytes by a counter a byte; =avx2: both by AVX2's compares instead of
    AVX-512's (on a host that has it). A lane's tail, a whole chunk of blocks and one past it, K's kinds
    that the compares take (both signs, 32 values) and one past them: the oracle's bytes at every level."""
    sizes, kinds = (200, 33000, 40000), ("skewed", "one", "fib")
    k_sizes, k_kinds = (65, 4099, 40000, 130001), ("signed", "negative", "wide33", "exponents")
    code = (
        "import numpy as np, sys; sys.path.insert(0, 'tests/backends'); from kvcodec.backends import cpu; "
        "from test_cpu_huff import _exponents, _pairs_stream, _symbols, c_encode; "
        f"print(' '.join(_pairs_stream(_exponents(k, n, seed=n)).hex() for k in {kinds!r} for n in {sizes!r}), "
        f"' '.join(c_encode(_symbols(k, n, seed=n)).hex() for k in {k_kinds!r} for n in {k_sizes!r}))"
    )
    env = {**os.environ, "KVCODEC_CPU_LEVEL": level}
    root = pathlib.Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True
    )
    want = [huffman.encode(_exponents(k, n, seed=n)).hex() for k in kinds for n in sizes]
    want += [huffman.encode(_symbols(k, n, seed=n)).hex() for k in k_kinds for n in k_sizes]
    assert out.stdout.split() == want
    assert [_pairs_stream(_exponents(k, n, seed=n)).hex() for k in kinds for n in sizes] == want[
        : len(sizes) * 3
    ]


def _pairs_stream(sym: np.ndarray) -> bytes:
    """huff_encode_pairs_many's stream of the exponents ``sym`` (a count that is a multiple of 8), alone."""
    pairs = (sym[0::2] | (sym[1::2] << 4)).astype(np.uint8)
    out = np.empty(max_stream_len(sym.size, huffman=True), np.uint8)
    (got,) = cpu.huff_encode_pairs_many(pairs, 0, pairs.size, 1, sym.size, out, 0)
    return out[:got].tobytes()


@pytest.mark.parametrize(
    "args,match",
    [
        ((bytes(6), 0, 6, 2, 12, bytearray(400), 0), "multiple of 8"),
        ((bytes(8), 0, 4, 2, 16, bytearray(400), 0), "outside"),  # the second stream past the symbols
        ((bytes(8), 0, 8, 1, 16, bytearray(4), 5), "outside"),  # the output's offset past it
        ((bytes(8), 0, 8, -1, 16, bytearray(400), 0), "count"),
    ],
)
def test_pairs_spans_are_checked(args, match) -> None:
    with pytest.raises(UnsupportedConfigError, match=match):
        cpu.huff_encode_pairs_many(*args)
