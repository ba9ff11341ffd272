"""Property tests of the LMCKV parser: mutated blobs fail cleanly; valid headers round-trip."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcodec.errors import CodecError
from kvcodec.format import (
    DTYPE_TO_ID,
    FIXED_HEADER_LEN,
    FLOAT_INF_BITS,
    DType,
    Hashes,
    Header,
    ScaleScheme,
    ScaleScope,
    assemble,
    expected_scale_shape,
    header_size,
    parse,
    serialize_header,
)

I64 = st.integers(-(1 << 63), (1 << 63) - 1)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Base:
    name: str
    blob: bytes
    header: Header
    payload: bytes
    n_dims: int

    @property
    def lens_off(self) -> int:
        return FIXED_HEADER_LEN + 8 * self.n_dims

    @property
    def hash_count_off(self) -> int:
        return self.lens_off + 24


def _base(
    name: str,
    *,
    version: int,
    scope: ScaleScope,
    scheme: ScaleScheme = ScaleScheme.COMPUTED,
    tokens: int = 3,
    heads: int = 2,
    dim: int = 4,
    page: int = 2,
    no_k: bool = False,
) -> Base:
    no_scales = scope in (ScaleScope.EXTERNAL, ScaleScope.NONE) or scheme == ScaleScheme.UNIT
    shape = (
        ()
        if scope in (ScaleScope.EXTERNAL, ScaleScope.NONE)
        else expected_scale_shape(scope, tokens, heads, page)
    )
    n_el = tokens * heads * dim
    k = b"" if no_k else bytes((7 * i + 1) & 0xFF for i in range(2 * n_el))
    v = bytes((13 * i + 5) & 0xFF for i in range(n_el))
    s = b"" if no_scales else struct.pack(f"<{max(1, _prod(shape))}f", *([0.5] * max(1, _prod(shape))))
    h = Header(
        k_dtype=torch.float16,
        v_dtype=torch.float8_e4m3fn,
        scale_scope=scope,
        scale_scheme=scheme,
        version=version,
        layer_id=2,
        chunk_id=9,
        chunk_size=tokens,
        page_size=page,
        kv_head_count=heads,
        head_dim=dim,
        scale_shape=shape,
        hashes=Hashes(model_id="org/model", tokenizer_hash="t0", kv_layout="NHD"),
    )
    blob = bytes(assemble(h, k, v, s))
    p = parse(blob, strict=True)
    return Base(name, blob, p.header, k + v + s, len(shape))


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


BASES = [
    _base("v1_pph", version=1, scope=ScaleScope.PER_PAGE_HEAD),
    _base("v1_plh", version=1, scope=ScaleScope.PER_LAYER_HEAD),
    _base("v1_pt", version=1, scope=ScaleScope.PER_TENSOR),
    _base("v1_ext_no_k", version=1, scope=ScaleScope.EXTERNAL, no_k=True),
    _base("v2_pph", version=2, scope=ScaleScope.PER_PAGE_HEAD),
    _base("v2_pt", version=2, scope=ScaleScope.PER_TENSOR),
    _base("v2_none_unit", version=2, scope=ScaleScope.NONE, scheme=ScaleScheme.UNIT),
    _base("v2_pph_unit", version=2, scope=ScaleScope.PER_PAGE_HEAD, scheme=ScaleScheme.UNIT),
]


# A mutation is a tuple the applier interprets; hypothesis shrinks them readably.
def _int_rewrites(base: Base) -> st.SearchStrategy:
    int64_fields = st.sampled_from(
        [("len", i) for i in range(3)]
        + [("fixed", off) for off in range(20, FIXED_HEADER_LEN, 8)]  # layer_id .. scale_shape_n
        + [("dim", i) for i in range(base.n_dims)]
    )
    interesting = st.sampled_from(
        [-1, 0, 1, 9, 1 << 31, 1 << 40, 1 << 48, 1 << 62, (1 << 63) - 1, -(1 << 63)]
    )
    return st.one_of(
        st.tuples(st.just("int64"), int64_fields, st.one_of(I64, interesting)),
        st.tuples(st.just("hash_count"), st.integers(0, 0xFFFF)),
        st.tuples(st.just("scale_shape_n"), st.one_of(I64, st.integers(-2, 10))),
    )


def _mutations(base: Base) -> st.SearchStrategy:
    n = len(base.blob)
    pos = st.integers(0, n - 1)
    return st.one_of(
        st.tuples(st.just("flip"), pos, st.integers(1, 255)),
        st.tuples(st.just("truncate"), st.integers(0, n - 1)),
        st.tuples(st.just("insert"), st.integers(0, n), st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("delete"), pos, st.integers(1, 16)),
        _int_rewrites(base),
    )


MUTATIONS = {b.name: st.lists(_mutations(b), min_size=1, max_size=3) for b in BASES}
INT_REWRITES = {b.name: _int_rewrites(b) for b in BASES}


def _apply(base: Base, blob: bytearray, m: tuple) -> bytearray:
    op = m[0]
    if op == "flip":
        if m[1] < len(blob):
            blob[m[1]] ^= m[2]
    elif op == "truncate":
        del blob[m[1] :]
    elif op == "insert":
        blob[m[1] : m[1]] = m[2]
    elif op == "delete":
        del blob[m[1] : m[1] + m[2]]
    elif op == "int64":
        (kind, i), value = m[1], m[2]
        off = {"len": base.lens_off + 8 * i, "fixed": i, "dim": FIXED_HEADER_LEN + 8 * i}[kind]
        if off + 8 <= len(blob):
            struct.pack_into("<q", blob, off, value)
    elif op == "hash_count":
        if base.hash_count_off + 2 <= len(blob):
            struct.pack_into("<H", blob, base.hash_count_off, m[1])
    elif op == "scale_shape_n":
        if 76 <= len(blob):
            struct.pack_into("<q", blob, 68, m[1])
    return blob


def _check_outcome(base: Base, mutated: bytes) -> None:
    for strict in (False, True):
        try:
            p = parse(mutated, strict=strict)
        except CodecError:
            continue
        # Anything but a CodecError propagates and fails the test. A success is only
        # acceptable where the CRC cannot see the change: a v1 header field, or trailing
        # bytes (v1, not strict). The payload itself must be the original's.
        if mutated == base.blob:
            assert p.header == base.header
            continue
        assert base.header.version == 1 and p.header.version == 1, "v2 blob mutated yet accepted"
        assert bytes(p.payload) == base.payload, "v1 blob accepted with a payload the CRC did not cover"
        assert p.blob.nbytes == len(mutated) - p.trailing
        assert not strict or p.trailing == 0


@pytest.mark.parametrize("base", BASES, ids=[b.name for b in BASES])
def test_base_blobs_parse(base: Base) -> None:
    assert bytes(parse(base.blob, strict=True).payload) == base.payload


@pytest.mark.parametrize("base", BASES, ids=[b.name for b in BASES])
@FUZZ
@given(data=st.data())
def test_mutated_blob_fails_cleanly(base: Base, data: st.DataObject) -> None:
    muts = data.draw(MUTATIONS[base.name], label="mutations")
    blob = bytearray(base.blob)
    for m in muts:
        blob = _apply(base, blob, m)
    _check_outcome(base, bytes(blob))


@pytest.mark.parametrize("base", BASES, ids=[b.name for b in BASES])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_rewritten_int_fields_fail_cleanly(base: Base, data: st.DataObject) -> None:
    m = data.draw(INT_REWRITES[base.name], label="rewrite")
    _check_outcome(base, bytes(_apply(base, bytearray(base.blob), m)))


# ----------------------------------------------------------------------------
# Round trip: random valid headers and payloads
# ----------------------------------------------------------------------------

DTYPES = sorted(DTYPE_TO_ID, key=str)
HASH_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)


def scale_bytes(dtype: DType, count: int) -> st.SearchStrategy[bytes]:
    """``count`` stored scales as encode writes them: float dtypes finite and > 0, any bytes otherwise."""
    inf = FLOAT_INF_BITS.get(dtype)
    if inf is None:
        return st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize)
    bits = st.lists(st.integers(1, inf - 1), min_size=count, max_size=count)
    return bits.map(lambda xs: b"".join(x.to_bytes(dtype.itemsize, "little") for x in xs))


@st.composite
def headers_and_payloads(draw) -> tuple[Header, bytes, bytes, bytes]:
    version = draw(st.sampled_from([1, 2]))
    scope = draw(st.sampled_from(list(ScaleScope) if version == 2 else list(ScaleScope)[:4]))
    # LATENT (MLA) and lossless blobs have rules of their own: tests/format/test_latent.py,
    # tests/format/test_lossless_tables.py, tests/codec/test_lossless.py.
    schemes = [s for s in ScaleScheme if s in (ScaleScheme.COMPUTED, ScaleScheme.UNIT)]
    scheme = draw(st.sampled_from(schemes)) if version == 2 else ScaleScheme.COMPUTED
    k_dtype, v_dtype, s_dtype = (draw(st.sampled_from(DTYPES)) for _ in range(3))
    tokens = draw(st.integers(0, 6))
    heads = draw(st.integers(1, 3))
    dim = draw(st.integers(1, 5))
    page = draw(st.integers(1, 4))
    has_v = draw(st.booleans())
    has_k = has_v and draw(st.booleans())  # a blob may omit K, never V while holding K
    n_el = tokens * heads * dim
    k = draw(st.binary(min_size=n_el * k_dtype.itemsize, max_size=n_el * k_dtype.itemsize)) if has_k else b""
    v = draw(st.binary(min_size=n_el * v_dtype.itemsize, max_size=n_el * v_dtype.itemsize)) if has_v else b""
    no_scales = scope in (ScaleScope.EXTERNAL, ScaleScope.NONE) or scheme == ScaleScheme.UNIT
    shape = expected_scale_shape(scope, tokens, heads, page) or ()
    if no_scales:
        s = b""
    else:
        s = b"" if (not v and draw(st.booleans())) else draw(scale_bytes(s_dtype, _prod(shape)))
    unset_layout = draw(st.booleans()) and draw(st.booleans())
    h = Header(
        k_dtype=k_dtype,
        v_dtype=v_dtype,
        scale_dtype=s_dtype,
        scale_scope=scope,
        version=version,
        scale_scheme=scheme,
        layer_id=draw(st.integers(-1, (1 << 63) - 1)),
        chunk_id=draw(st.integers(-1, (1 << 63) - 1)),
        chunk_size=-1 if unset_layout else tokens + draw(st.integers(0, 64)),
        page_size=-1 if unset_layout else page,
        kv_head_count=-1 if unset_layout else heads,
        head_dim=-1 if unset_layout else dim,
        scale_shape=shape,
        hashes=Hashes(**{k_: draw(HASH_TEXT) for k_ in Hashes().as_dict()}),
    )
    return h, k, v, s


@settings(max_examples=300, deadline=None)
@given(case=headers_and_payloads(), trailing=st.binary(max_size=4))
def test_roundtrip_random_headers(case, trailing: bytes) -> None:
    h, k, v, s = case
    blob = bytes(assemble(h, k, v, s))
    want = h.replace(k_payload_len=len(k), v_payload_len=len(v), scale_payload_len=len(s))
    p = parse(blob, strict=True)
    assert p.header == want
    assert (bytes(p.k), bytes(p.v), bytes(p.scales)) == (k, v, s)
    assert p.header_len == header_size(want)
    assert serialize_header(p.header, [p.payload]) + bytes(p.payload) == blob
    if trailing:
        if h.version == 1:
            assert parse(blob + trailing).trailing == len(trailing)
        else:
            with pytest.raises(CodecError, match="trailing"):
                parse(blob + trailing)
