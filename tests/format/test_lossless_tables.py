"""The lossless payload's stream tables (kvcodec/format/coding.py): docs/FORMAT.md's limits, and any
bytes in the tables either describe their sections exactly or are refused by reason."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcodec.errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from kvcodec.format import (
    MAX_ELEMENTS,
    MAX_PAYLOAD_LEN,
    Header,
    ScaleScheme,
    ScaleScope,
    read_coding,
    restamp_header,
    serialize_header,
)
from kvcodec.format.coding import (
    HUFF_ERRORS,
    HUFF_HEAD_BYTES,
    HUFF_LANE_LENS,
    HUFF_LANES,
    HUFF_MAX_LEN,
    HUFF_TABLE_BYTES,
    SPLIT_EXP_SYMBOLS,
    STREAM_COUNT,
    STREAM_LEN,
    TOKENS,
    max_stream_len,
    pack_table,
)
from tests.format.test_format_doc import DOC, _tables

HEADS, DIM = 2, 4


def _header(k_len: int, v_len: int, **over: object) -> Header:
    fields: dict = {
        "k_dtype": "bfloat16",
        "v_dtype": "float8_e4m3fn",
        "scale_scope": ScaleScope.PER_TENSOR,
        "scale_scheme": ScaleScheme.LOSSLESS,
        "version": 2,
        "kv_head_count": HEADS,
        "head_dim": DIM,
        "k_payload_len": k_len,
        "v_payload_len": v_len,
        "scale_payload_len": 4,
    }
    return Header(**{**fields, **over})


def test_the_doc_states_the_table_layouts_and_bounds() -> None:
    text = DOC.read_text()
    sections = _tables(text)
    (rows,) = sections[
        "Lossless payload (schemes LOSSLESS, LOSSLESS_UNIT, LOSSLESS_HUFF, LOSSLESS_HUFF_UNIT, "
        "LOSSLESS_SPLIT, LOSSLESS_SPLIT_UNIT)"
    ][1:2]
    assert {r["name"] for r in rows} == {"tokens", "stream count", "stream length", "section length"}
    assert (TOKENS.format, STREAM_COUNT.format, STREAM_LEN.format) == ("<q", "<I", "<I")
    assert "`tokens` (`q`), stream count (`I`" in text
    assert max_stream_len(1000) == 1000 + 1000 // 256 + 64  # "raw + raw / 256 + 64"
    assert (
        max_stream_len(1000, huffman=True) == 140 + -(-1000 * 11 // 8) + 4
    )  # "140 + ceil(raw x 11 / 8) + 4"
    fields, refusals = sections["Huffman stream (schemes 5 to 8)"]
    assert [(r["field"], r["bytes"]) for r in fields][:2] == [
        ("code lengths", str(HUFF_TABLE_BYTES)),
        ("lane lengths", str(HUFF_LANE_LENS.size)),
    ]
    assert HUFF_LANE_LENS.format == "<3I" and HUFF_HEAD_BYTES == 140 and (HUFF_MAX_LEN, HUFF_LANES) == (11, 4)
    assert [int(r["code"]) for r in refusals] == sorted(HUFF_ERRORS)


def test_a_written_table_reads_back() -> None:
    tokens = 3
    v = pack_table([5, 7], tokens) + bytes(12)
    k = pack_table([1, 2]) + bytes(3) + bytes(tokens * HEADS * DIM)
    c = read_coding(_header(len(k), len(v)), memoryview(k), memoryview(v))
    assert (c.tokens, c.stream_raw) == (tokens, tokens * DIM)
    assert c.v.streams == ((20, 5), (25, 7)) and c.k.streams == ((12, 1), (13, 2))
    assert c.plain.scale_scheme == ScaleScheme.COMPUTED
    assert (c.plain.k_payload_len, c.plain.v_payload_len) == (2 * tokens * HEADS * DIM, tokens * HEADS * DIM)


def _split_v(
    tokens: int,
    heads: int,
    dim: int,
    *,
    table: bytes = bytes(HUFF_TABLE_BYTES),
    extra: int = 0,
    last: int = 0,
) -> bytes:
    """A scheme-7 V section: ``heads`` streams (a code-length table and zero lanes each), then the sign
    and mantissa plane of ``tokens x heads x dim`` codes (``extra`` bytes more, ``last`` its last byte)."""
    stream = table + bytes(HUFF_HEAD_BYTES - HUFF_TABLE_BYTES)
    plane = bytearray((tokens * heads * dim + 1) // 2 + extra)
    plane[-1:] = bytes([last])
    return pack_table([len(stream)] * heads, tokens) + stream * heads + plane


@pytest.mark.parametrize("scheme", [ScaleScheme.LOSSLESS_SPLIT, ScaleScheme.LOSSLESS_SPLIT_UNIT])
@pytest.mark.parametrize("shape", [(3, 2, 4), (3, 1, 3)])
def test_split_v_section_reads_back(scheme, shape) -> None:
    tokens, heads, dim = shape
    table = bytes([0x21, 0x43]) + bytes(HUFF_TABLE_BYTES - 2)  # symbols 0..3 given lengths 1..4
    v = _split_v(tokens, heads, dim, table=table, last=0x0F)
    c = read_coding(
        _header(0, len(v), scale_scheme=scheme, kv_head_count=heads, head_dim=dim),
        memoryview(b""),
        memoryview(v),
    )
    assert c.v_split and c.huffman and c.tokens == tokens
    assert len(v) - c.v.raw_at == (tokens * heads * dim + 1) // 2


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"table": bytes(8) + b"\x01" + bytes(HUFF_TABLE_BYTES - 9)}, "symbol over 15"),
        ({"table": bytes(HUFF_TABLE_BYTES - 1) + b"\x30"}, "symbol over 15"),
        ({"extra": 1}, "plane is 6 bytes; 9 codes need 5"),
        ({"extra": -1}, "plane is 4 bytes; 9 codes need 5"),
        ({"last": 0x10}, "nonzero nibble"),
    ],
)
def test_split_v_section_refusals(kw, match) -> None:
    """A V stream of scheme 7 with a code for a symbol over 15 (no 4-bit exponent), a sign and mantissa
    plane of the wrong length, or an odd count's padding nibble set: refused before any stream is decoded."""
    v = _split_v(3, 1, 3, **kw)
    h = _header(0, len(v), scale_scheme=ScaleScheme.LOSSLESS_SPLIT, kv_head_count=1, head_dim=3)
    with pytest.raises(CorruptEncodedKVError, match=match) as e:
        read_coding(h, memoryview(b""), memoryview(v))
    assert e.value.reason == Reason.INCONSISTENT_PAYLOAD
    assert SPLIT_EXP_SYMBOLS == 16


def test_token_bound_is_overflow_safe() -> None:
    v = pack_table([1, 1], MAX_ELEMENTS) + bytes(2)
    h = _header(0, len(v), kv_head_count=1 << 40, head_dim=1 << 40)
    try:
        read_coding(h, memoryview(b""), memoryview(v))
    except CorruptEncodedKVError as e:
        assert e.reason == Reason.INCONSISTENT_PAYLOAD
    else:
        raise AssertionError("2^80 elements per token accepted")


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    tokens=st.integers(-(1 << 63), (1 << 63) - 1) | st.integers(0, 40),
    count=st.integers(0, (1 << 32) - 1) | st.integers(0, 4),
    lengths=st.lists(st.integers(0, (1 << 32) - 1) | st.integers(0, 80), max_size=4),
    body=st.binary(max_size=200),
    k_raw=st.binary(max_size=300),
    cut=st.integers(0, 40),
    scheme=st.sampled_from(
        [ScaleScheme.LOSSLESS, ScaleScheme.LOSSLESS_HUFF_UNIT, ScaleScheme.LOSSLESS_SPLIT]
    ),
)
def test_hostile_tables_read_or_refuse(tokens, count, lengths, body, k_raw, cut, scheme) -> None:
    v = TOKENS.pack(tokens) + STREAM_COUNT.pack(count) + struct.pack(f"<{len(lengths)}I", *lengths) + body
    v = v[: max(0, len(v) - cut)]
    k = k_raw
    try:
        c = read_coding(_header(len(k), len(v), scale_scheme=scheme), memoryview(k), memoryview(v))
    except CorruptEncodedKVError as e:
        assert e.reason == Reason.INCONSISTENT_PAYLOAD
        return
    assert c.huffman == (scheme != ScaleScheme.LOSSLESS) and c.v_split == (
        scheme == ScaleScheme.LOSSLESS_SPLIT
    )
    # Accepted: the tables tile each section exactly, every stream within its bound.
    raw = c.tokens * DIM
    assert len(v) - c.v.raw_at == ((raw * HEADS + 1) // 2 if c.v_split else 0) and 0 < c.tokens
    for sec in (c.v, c.k) if c.k else (c.v,):
        assert len(sec.streams) == HEADS
        assert all(0 < n <= max_stream_len(raw, c.huffman) for _, n in sec.streams)
        assert all(a + n == b for (a, n), (b, _) in zip(sec.streams, sec.streams[1:]))
    if c.k:
        assert len(k) - c.k.raw_at == raw * HEADS


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"k_payload_len": -1}, Reason.FIELD_OUT_OF_RANGE),
        ({"v_payload_len": MAX_PAYLOAD_LEN + 1}, Reason.FIELD_OUT_OF_RANGE),
        ({"version": 1}, Reason.BAD_VALUE),
    ],
)
def test_restamped_header_is_the_serialized_one(change, reason) -> None:
    """The coded header restamped over the plain one's bytes is byte for byte what serialize_header writes
    for it (scheme, K and V lengths, CRC over the payload now after it); out-of-range lengths and
    version 1 are refused, nothing written."""
    plain = _header(2 * 48, 48, scale_scheme=ScaleScheme.COMPUTED, scale_shape=(1,), scale_payload_len=4)
    hs = plain.header_len
    buf = memoryview(bytearray(serialize_header(plain, crc=0) + bytes(range(60))))
    lens = {"k_payload_len": 30, "v_payload_len": 26}
    restamp_header(buf, plain, hs, scale_scheme=ScaleScheme.LOSSLESS_HUFF, **lens)
    coded = plain.replace(scale_scheme=ScaleScheme.LOSSLESS_HUFF, **lens)
    assert bytes(buf[:hs]) == serialize_header(coded, [buf[hs:]])
    before = bytes(buf)
    version = change.pop("version", 2)
    with pytest.raises(UnsupportedConfigError) as e:
        restamp_header(
            buf,
            plain.replace(version=version),
            hs,
            scale_scheme=ScaleScheme.LOSSLESS_HUFF,
            **{**lens, **change},
        )
    assert e.value.reason == reason and bytes(buf) == before
