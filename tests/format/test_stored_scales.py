"""Stored scales encode never writes (NaN, ±Inf, 0, negative) are refused while parsing, by every reader."""

from __future__ import annotations

import math
import re
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec import decode
from kvcodec.errors import CorruptEncodedKVError, Reason
from kvcodec.format import FLOAT_INF_BITS, Header, ScaleScope, check_stored_scales, parse
from kvcodec.format.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, DType
from tests._helpers import raw_blob

# dtype -> (LMCKV id, bits of each bad kind)
BAD_BITS = {
    FLOAT32: (
        4,
        {
            "NaN": 0x7FC0_0000,
            "+Inf": 0x7F80_0000,
            "-Inf": 0xFF80_0000,
            "0": 0,
            "-0": 0x8000_0000,
            "negative": 0xBF80_0000,
            "negative NaN": 0xFFC0_0001,
        },
    ),
    FLOAT16: (
        2,
        {
            "NaN": 0x7E00,
            "+Inf": 0x7C00,
            "-Inf": 0xFC00,
            "0": 0,
            "-0": 0x8000,
            "negative": 0xBC00,
            "negative NaN": 0xFE01,
        },
    ),
    BFLOAT16: (
        3,
        {
            "NaN": 0x7FC0,
            "+Inf": 0x7F80,
            "-Inf": 0xFF80,
            "0": 0,
            "-0": 0x8000,
            "negative": 0xBF80,
            "negative NaN": 0xFFC1,
        },
    ),
}
ONE = {FLOAT32: 0x3F80_0000, FLOAT16: 0x3C00, BFLOAT16: 0x3F80, FLOAT64: 0x3FF0_0000_0000_0000}
# Every scope that stores scales, as (scope id, scale_shape) over raw_blob's 4 tokens x 2 heads, page 2.
SCOPES = {
    "per_tensor": (int(ScaleScope.PER_TENSOR), ()),
    "per_layer_head": (int(ScaleScope.PER_LAYER_HEAD), (2,)),
    "per_page_head": (int(ScaleScope.PER_PAGE_HEAD), (2, 2)),
    "external": (int(ScaleScope.EXTERNAL), (2, 2)),
}


def _pack(dtype: DType, bits: list[int]) -> bytes:
    return b"".join(b.to_bytes(dtype.itemsize, "little") for b in bits)


def _blob(dtype: DType, bits: list[int], scope: str = "per_page_head", version: int = 2) -> bytes:
    scope_id, shape = SCOPES[scope]
    return raw_blob(
        version=version, scope=scope_id, s_id=BAD_BITS[dtype][0], scale_shape=shape, s=_pack(dtype, bits)
    )


def _is_good(dtype: DType, bits: int) -> bool:
    """Finite and > 0, read with struct (an oracle independent of the parser's bit test)."""
    if dtype == BFLOAT16:
        value = struct.unpack("<f", (bits << 16).to_bytes(4, "little"))[0]
    else:
        code = {FLOAT16: "e", FLOAT32: "f", FLOAT64: "d"}[dtype]
        value = struct.unpack("<" + code, bits.to_bytes(dtype.itemsize, "little"))[0]
    return math.isfinite(value) and value > 0


CASES = [
    pytest.param(dtype, kind, bits, scope, id=f"{dtype}-{kind}-{scope}")
    for dtype, (_, kinds) in BAD_BITS.items()
    for kind, bits in kinds.items()
    for scope in SCOPES
]


@pytest.mark.parametrize(("dtype", "kind", "bits", "scope"), CASES)
def test_a_bad_stored_scale_is_refused_while_parsing(dtype: DType, kind: str, bits: int, scope: str) -> None:
    n = math.prod(SCOPES[scope][1])
    scales = [ONE[dtype]] * n
    scales[-1] = bits  # the last scale: the whole section is looked at, not its start
    want = {"negative NaN": "NaN"}.get(kind, kind)
    with pytest.raises(
        CorruptEncodedKVError, match=rf"stored scale #{n - 1} \(.*\) is {re.escape(want)}"
    ) as e:
        parse(_blob(dtype, scales, scope))
    assert e.value.reason == Reason.BAD_SCALE
    parse(_blob(dtype, [ONE[dtype]] * n, scope))  # the same blob with good scales parses


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("kind", ["NaN", "+Inf", "-Inf", "0", "negative"])
def test_decode_refuses_a_bad_stored_scale(version: int, kind: str) -> None:
    bits = [ONE[FLOAT32]] * 4
    bits[1] = BAD_BITS[FLOAT32][1][kind]
    with pytest.raises(CorruptEncodedKVError) as e:
        decode(_blob(FLOAT32, bits, version=version))
    assert e.value.reason == Reason.BAD_SCALE and "page 0, head 1" in str(e.value)


def test_the_group_of_a_bad_scale_is_named_in_the_scopes_terms() -> None:
    bad = BAD_BITS[FLOAT16][1]["NaN"]
    with pytest.raises(CorruptEncodedKVError, match=r"#3 \(page 1, head 1\)"):
        parse(_blob(FLOAT16, [ONE[FLOAT16]] * 3 + [bad]))
    with pytest.raises(CorruptEncodedKVError, match=r"#1 \(head 1\)"):
        parse(_blob(FLOAT16, [ONE[FLOAT16], bad], "per_layer_head"))
    with pytest.raises(CorruptEncodedKVError, match=r"#0 \(the whole tensor\) is NaN"):
        parse(_blob(FLOAT16, [bad], "per_tensor"))


def test_header_level_parse_leaves_scales_to_the_caller() -> None:
    bits = [ONE[FLOAT32]] * 3 + [0]
    p = parse(_blob(FLOAT32, bits), consistency=False)
    with pytest.raises(CorruptEncodedKVError, match="is 0;"):
        check_stored_scales(p.header, p.scales)


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16])
def test_every_16_bit_pattern_is_judged_as_struct_reads_it(dtype: DType) -> None:
    """Exhaustive: the fast last-byte test plus the exact fallback agree with an independent reading."""
    h = Header(
        k_dtype="float16", v_dtype="float8_e4m3fn", scale_dtype=dtype, scale_scope=ScaleScope.PER_TENSOR
    )
    wrong = []
    for bits in range(1 << 16):
        try:
            check_stored_scales(h, memoryview(bits.to_bytes(2, "little")))
            accepted = True
        except CorruptEncodedKVError:
            accepted = False
        if accepted != _is_good(dtype, bits):
            wrong.append(hex(bits))
    assert not wrong, wrong[:20]


# fp32 and fp64 patterns near every boundary: zero, subnormals, the last-byte edges, the largest finite, Inf, NaN.
EDGES_32 = [
    0,
    1,
    0x007F_FFFF,
    0x0080_0000,
    0x00FF_FFFF,
    0x0100_0000,
    0x7EFF_FFFF,
    0x7F00_0000,
    0x7F7F_FFFF,
    0x7F80_0000,
    0x7F80_0001,
    0x7FFF_FFFF,
    0x8000_0000,
    0x8000_0001,
    0xFF80_0000,
    0xFFFF_FFFF,
]
EDGES_64 = [
    0,
    1,
    0x00FF_FFFF_FFFF_FFFF,
    0x0100_0000_0000_0000,
    0x7FEF_FFFF_FFFF_FFFF,
    0x7FF0_0000_0000_0000,
    0x7FF8_0000_0000_0000,
    0x8000_0000_0000_0000,
    0xBFF0_0000_0000_0000,
]


@pytest.mark.parametrize(
    ("dtype", "bits"), [(FLOAT32, b) for b in EDGES_32] + [(FLOAT64, b) for b in EDGES_64]
)
def test_boundary_patterns_are_judged_as_struct_reads_them(dtype: DType, bits: int) -> None:
    h = Header(
        k_dtype="float16", v_dtype="float8_e4m3fn", scale_dtype=dtype, scale_scope=ScaleScope.PER_TENSOR
    )
    scales = memoryview(_pack(dtype, [bits]))
    if _is_good(dtype, bits):
        check_stored_scales(h, scales)
    else:
        with pytest.raises(CorruptEncodedKVError):
            check_stored_scales(h, scales)


def test_scale_dtypes_without_an_inf_are_left_to_the_decoder() -> None:
    assert set(FLOAT_INF_BITS) == {FLOAT16, BFLOAT16, FLOAT32, FLOAT64}
    h = Header(
        k_dtype="float16", v_dtype="float8_e4m3fn", scale_dtype="uint8", scale_scope=ScaleScope.PER_TENSOR
    )
    check_stored_scales(h, memoryview(b"\x00"))


SCALE_BITS = {
    dtype: st.one_of(st.integers(0, (1 << (8 * dtype.itemsize)) - 1), st.sampled_from(list(kinds.values())))
    for dtype, (_, kinds) in BAD_BITS.items()
}


@settings(max_examples=300, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(list(BAD_BITS)), scope=st.sampled_from(list(SCOPES)))
def test_parse_accepts_exactly_the_finite_positive_scales(
    data: st.DataObject, dtype: DType, scope: str
) -> None:
    n = math.prod(SCOPES[scope][1])
    good = st.integers(1, FLOAT_INF_BITS[dtype] - 1)
    bits = data.draw(st.lists(st.one_of(good, SCALE_BITS[dtype]), min_size=n, max_size=n))
    first_bad = next((i for i, b in enumerate(bits) if not _is_good(dtype, b)), None)
    blob = _blob(dtype, bits, scope)
    if first_bad is None:
        assert bytes(parse(blob).scales) == _pack(dtype, bits)
    else:
        with pytest.raises(CorruptEncodedKVError, match=rf"stored scale #{first_bad} ") as e:
            parse(blob)
        assert e.value.reason == Reason.BAD_SCALE


@pytest.mark.parametrize("kind", ["NaN", "-Inf", "0", "negative"])
def test_kvcodec_verify_refuses_a_bad_stored_scale(tmp_path, capsys, kind: str) -> None:
    from kvcodec.tools.cli import main

    bits = [ONE[FLOAT32]] * 4
    bits[2] = BAD_BITS[FLOAT32][1][kind]
    path = tmp_path / "bad.blob"
    path.write_bytes(_blob(FLOAT32, bits, version=1))
    assert main(["verify", str(path)]) != 0
    assert "stored scale #2 (page 1, head 0)" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["NaN", "+Inf", "0", "negative"])
def test_the_lmcache_compat_decode_refuses_a_bad_stored_scale(kind: str) -> None:
    from kvcodec.integrations.lmcache import compat

    bits = [ONE[FLOAT32]] * 4
    bits[3] = BAD_BITS[FLOAT32][1][kind]
    codec = compat.AsymK16V8Codec(scale_scope=compat.ScaleScope.PER_PAGE_HEAD)
    with pytest.raises(compat.CorruptEncodedKVError):
        codec.decode(codec.from_bytes(_blob(FLOAT32, bits, version=1)))


def test_any_buffer_of_scale_bytes_is_checked() -> None:
    h = Header(
        k_dtype="float16", v_dtype="float8_e4m3fn", scale_dtype="float32", scale_scope=ScaleScope.PER_TENSOR
    )
    good, bad = struct.pack("<f", 0.5), struct.pack("<f", -0.5)
    check_stored_scales(h, good)
    check_stored_scales(h, memoryview(bytearray(good)).cast("f"))
    for buf in (bad, bytearray(bad), memoryview(bad).cast("f")):
        with pytest.raises(CorruptEncodedKVError, match="negative"):
            check_stored_scales(h, buf)
    with pytest.raises(CorruptEncodedKVError, match="not a whole number") as e:
        check_stored_scales(h, b"\x00\x00\x80")
    assert e.value.reason == Reason.BAD_SCALE_SHAPE
