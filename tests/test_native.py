"""The "native" backend (kvcodec._cpu, C) equals the torch reference bit for bit, on every SIMD level."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec import native, quant
from kvcodec.codec import decode, encode, resolve_backend
from kvcodec.errors import UnsupportedConfigError
from kvcodec.format import ScaleScope, parse

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason="kvcodec._cpu is not built")

S = ScaleScope
SCOPES = [(S.PER_TENSOR, None), (S.PER_LAYER_HEAD, None), (S.PER_PAGE_HEAD, 16), (S.PER_PAGE_HEAD, 3)]
LEVELS = [0, 1, 2]  # portable C, AVX2 + PCLMUL, everything the CPU has


@pytest.fixture(params=LEVELS, ids=lambda x: f"simd{x}")
def level(request):
    from kvcodec import _cpu

    prev = _cpu.simd(request.param)
    yield request.param
    _cpu.simd(2 if prev[0] or prev[1] else 0)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so NaNs compare by payload and -0 differs from +0."""
    return x.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _all_fp16() -> torch.Tensor:
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return x[torch.isfinite(x)]


def _all_bf16() -> torch.Tensor:
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return x[torch.isfinite(x)]


# --- the cast and the division -------------------------------------------------------------


@pytest.mark.parametrize("make", [_all_fp16, _all_bf16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 0.75, 3.0e-3, 1.0 / 448, 2.0**-20, 5.0e3, 1.0e-40])
def test_quantize_every_16bit_value(level, make, scale):
    """All finite fp16/bf16 values (odd count: tails of every loop), as one row, for each scale."""
    x = make()
    v = x.view(1, 1, -1)
    s = torch.tensor(scale, dtype=torch.float32)
    got = native.quantize(v, s, S.PER_TENSOR)
    want = quant.quantize(v, s, S.PER_TENSOR)
    assert torch.equal(_bits(got), _bits(want))


def test_quantize_random_fp32(level):
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), dtype=torch.int64, generator=g).to(torch.int32)
    x = bits.view(torch.float32)
    x = x[torch.isfinite(x)]
    for s in (1.0, 1.0e-30, 3.0e30, 0.125):
        v = x.view(1, 1, -1)
        st_ = torch.tensor(s)
        assert torch.equal(_bits(native.quantize(v, st_, S.PER_TENSOR)), _bits(quant.quantize(v, st_, S.PER_TENSOR)))


def test_quantize_nan_and_inf_take_the_reference(level):
    v = torch.tensor([[[1.0, float("nan"), -float("inf"), float("inf"), -2.0] * 7]], dtype=torch.float16)
    s = torch.tensor(0.5)
    assert torch.equal(_bits(native.quantize(v, s, S.PER_TENSOR)), _bits(quant.quantize(v, s, S.PER_TENSOR)))


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_quantize_bad_scales_take_the_reference(scale):
    v = torch.randn(4, 2, 40).half()
    s = torch.full((2,), scale)
    assert torch.equal(
        _bits(native.quantize(v, s, S.PER_LAYER_HEAD)), _bits(quant.quantize(v, s, S.PER_LAYER_HEAD))
    )


# --- dequantization -------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequantize_every_code(level, out_dtype):
    """All 254 non-NaN codes x scales that round, overflow to Inf, land subnormal, or are zero/negative."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    scales = [1.0, 0.3, 1.0e-3, 7.0e-8, 1.0e-40, 3.0e35, 2.0e5, 0.0, -2.5, 65504.0 / 448]
    for sv in scales:
        q = codes.view(torch.float8_e4m3fn).view(1, 1, -1)
        s = torch.tensor(sv)
        got = native.dequantize(q, s, S.PER_TENSOR, out_dtype=out_dtype)
        want = quant.dequantize(q, s, S.PER_TENSOR, out_dtype=out_dtype)
        assert torch.equal(_bits(got), _bits(want)), sv


def test_dequantize_nan_codes_and_nonfinite_scales_take_the_reference(level):
    q = torch.tensor([[[0x7F, 0x01, 0xFF, 0x40] * 5]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    for sv in (1.5, float("inf"), float("nan")):
        s = torch.tensor(sv)
        for od in (torch.float16, torch.bfloat16, torch.float32):
            got = native.dequantize(q, s, S.PER_TENSOR, out_dtype=od)
            want = quant.dequantize(q, s, S.PER_TENSOR, out_dtype=od)
            assert torch.equal(_bits(got), _bits(want))


# --- whole tensors: scopes, odd shapes, strides, threads --------------------------------------

SHAPES = [(1, 1, 8), (17, 3, 33), (5, 1, 256), (40, 2, 1), (256, 8, 128)]  # the last one runs on two threads


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scope,ps", SCOPES, ids=lambda x: getattr(x, "name", str(x)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_scales_codes_and_dequant_equal_reference(shape, scope, ps, dtype):
    g = torch.Generator().manual_seed(hash((shape, scope, ps)) & 0xFFFF)
    v = (torch.randn(shape, generator=g) * 4).to(dtype)
    v[0, 0, 0] = 0.0  # and a zero
    a = native.compute_scales(v, scope, page_size=ps)
    b = quant.compute_scales(v, scope, page_size=ps)
    assert torch.equal(_bits(a), _bits(b))
    qa, qb = native.quantize(v, a, scope, page_size=ps), quant.quantize(v, b, scope, page_size=ps)
    assert torch.equal(_bits(qa), _bits(qb))
    for od in (torch.float16, torch.bfloat16, torch.float32):
        assert torch.equal(
            _bits(native.dequantize(qa, a, scope, page_size=ps, out_dtype=od)),
            _bits(quant.dequantize(qb, b, scope, page_size=ps, out_dtype=od)),
        )


def test_strided_inputs_and_outputs():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 30, 4, 72, generator=g).half()
    v = base[1, :, 1:3, :64]  # token and head strides of a bigger tensor, head_dim contiguous
    s = native.compute_scales(v, S.PER_PAGE_HEAD, page_size=4)
    assert torch.equal(s, quant.compute_scales(v, S.PER_PAGE_HEAD, page_size=4))
    out = torch.empty(30, 2, 100, dtype=torch.float8_e4m3fn)[:, :, :64]
    native.quantize(v, s, S.PER_PAGE_HEAD, page_size=4, out=out)
    want = quant.quantize(v, s, S.PER_PAGE_HEAD, page_size=4)
    assert torch.equal(_bits(out), _bits(want))
    dst = torch.zeros(2, 30, 2, 64, dtype=torch.bfloat16)[1]
    native.dequantize(want, s, S.PER_PAGE_HEAD, page_size=4, out=dst)
    assert torch.equal(dst, quant.dequantize(want, s, S.PER_PAGE_HEAD, page_size=4, out_dtype=torch.bfloat16))
    # head_dim not contiguous: the reference does it
    vt = torch.randn(8, 2, 16, generator=g).half().transpose(0, 2)
    st_ = native.compute_scales(vt, S.PER_TENSOR)
    assert torch.equal(_bits(native.quantize(vt, st_, S.PER_TENSOR)), _bits(quant.quantize(vt, st_, S.PER_TENSOR)))


def test_nonfinite_v_is_refused_like_the_reference():
    v = torch.randn(32, 2, 16).half()
    v[21, 1, 3] = float("nan")
    with pytest.raises(UnsupportedConfigError) as a:
        native.compute_scales(v, S.PER_PAGE_HEAD, page_size=8)
    with pytest.raises(UnsupportedConfigError) as b:
        quant.compute_scales(v, S.PER_PAGE_HEAD, page_size=8)
    assert str(a.value) == str(b.value) and "page 2, head 1" in str(a.value)
    # the opt-in policy goes to the reference
    assert torch.equal(
        native.compute_scales(v, S.PER_TENSOR, nonfinite="saturate"),
        quant.compute_scales(v, S.PER_TENSOR, nonfinite="saturate"),
    )


def test_quantize_checks_scale_shape():
    v = torch.randn(4, 2, 8).half()
    with pytest.raises(UnsupportedConfigError, match="expected"):
        native.quantize(v, torch.ones(3), S.PER_LAYER_HEAD)
    with pytest.raises(UnsupportedConfigError, match="expected"):
        native.quantize(v, torch.ones(2), S.PER_LAYER_HEAD, out=torch.empty(4, 2, 7, dtype=torch.float8_e4m3fn))


# --- the fused chunk encode -------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1, 8), (33, 3, 40), (16, 8, 256), (1040, 8, 128)], ids=str)
@pytest.mark.parametrize("scope,ps", SCOPES, ids=lambda x: getattr(x, "name", str(x)))
@pytest.mark.parametrize("kdt,vdt", [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                     (torch.float16, torch.float32), (torch.float32, torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("version", [1, 2])
def test_encode_bytes_equal_torch_backend(shape, scope, ps, kdt, vdt, version):
    g = torch.Generator().manual_seed(11)
    k = torch.randn(shape, generator=g).to(kdt)
    v = (torch.randn(shape, generator=g) * 3).to(vdt)
    kw = dict(scope=scope, page_size=ps, version=version, layer_id=3)
    a = encode(k, v, backend="native", **kw)
    b = encode(k, v, backend="torch", **kw)
    assert a == b
    parse(a)  # CRC and all


def test_encode_strided_kv_slices():
    kv = torch.randn(2, 64, 4, 2, 32).half()  # [k/v, pages, page, heads, dim]
    a = encode(kv[0], kv[1], scope="per_page_head", backend="native")
    b = encode(kv[0].contiguous(), kv[1].contiguous(), scope="per_page_head", backend="torch")
    assert a == b


def test_encode_nonfinite_refused_after_fused_attempt():
    k = torch.randn(48, 2, 16).half()
    v = torch.randn(48, 2, 16).half()
    v[40, 0, 0] = float("inf")
    msgs = []
    for be in ("native", "torch"):
        with pytest.raises(UnsupportedConfigError) as e:
            encode(k, v, scope="per_page_head", page_size=16, backend=be)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "page 2, head 0" in msgs[0]


def test_encode_fp32_v_with_subnormal_absmax_matches():
    """amax / 448 underflows to a zero scale: the fused path hands the chunk to the reference."""
    k = torch.zeros(4, 1, 8).half()
    v = torch.zeros(4, 1, 8)
    v[1, 0, 2] = 1.0e-44
    assert encode(k, v, scope="per_tensor", backend="native") == encode(k, v, scope="per_tensor", backend="torch")


def test_encode_scale_dtypes_and_external_match():
    k = torch.randn(20, 2, 16).half()
    v = torch.randn(20, 2, 16).half()
    for kw in (
        dict(scope="per_page_head", page_size=8, scale_dtype=torch.float16),
        dict(scope="per_layer_head", scale_dtype=torch.float16, version=2),
        dict(scope="external", scales=torch.tensor([0.01, 0.02])),
        dict(scope="raw"),
    ):
        assert encode(k, v, backend="native", **kw) == encode(k, v, backend="torch", **kw), kw


def test_decode_dequant_matches_torch_backend():
    k = torch.randn(300, 4, 64).half()
    v = torch.randn(300, 4, 64).half()
    blob = encode(k, v, scope="per_page_head", page_size=16)
    for od in (torch.float16, torch.bfloat16, torch.float32):
        a = decode(blob, out_v_dtype=od, backend="native").v
        b = decode(blob, out_v_dtype=od, backend="torch").v
        assert torch.equal(a, b)


def test_encode_chunk_validates_outputs():
    k = torch.randn(8, 2, 16).half()
    q = torch.empty(8, 2, 16, dtype=torch.uint8)
    with pytest.raises(UnsupportedConfigError, match="s_out"):
        native.encode_chunk(k, k, S.PER_LAYER_HEAD, None, torch.empty_like(k), q, torch.empty(3, dtype=torch.uint8), 0)
    with pytest.raises(UnsupportedConfigError, match="contiguous"):
        native.encode_chunk(k, k, S.PER_TENSOR, None, torch.empty(8, 2, 32).half()[:, :, :16], q,
                            torch.empty(4, dtype=torch.uint8), 0)  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2])
def test_encode_chunk_crc_and_threads(monkeypatch, threads):
    """The CRC the C call returns continues the caller's, over K, V and the scales, on one or two threads."""
    monkeypatch.setenv("KVCODEC_THREADS", str(threads))
    g = torch.Generator().manual_seed(threads)
    for scope, ps in SCOPES:
        t = 1030  # 1030 x 8 x 128 elements: above the C side's two-thread threshold (2^20)
        k = torch.randn(t, 8, 128, generator=g).half()
        v = torch.randn(t, 8, 128, generator=g).bfloat16()
        n_s = 4 * max(1, int(torch.tensor(quant.scale_shape(scope, t, 8, ps)).prod()))
        ko, qo = torch.empty_like(k), torch.empty(t, 8, 128, dtype=torch.float8_e4m3fn)
        so = torch.empty(n_s, dtype=torch.uint8)
        status, crc = native.encode_chunk(k, v, scope, ps, ko, qo, so, 0x1234)
        assert status == -1 and native.LAST_ENCODE_THREADS == threads
        s_ref = quant.compute_scales(v, scope, page_size=ps)
        assert torch.equal(ko, k)
        assert torch.equal(_bits(qo), _bits(quant.quantize(v, s_ref, scope, page_size=ps)))
        assert torch.equal(so.view(torch.float32).reshape(s_ref.shape), s_ref)
        want = zlib.crc32(so.numpy(), zlib.crc32(qo.view(torch.uint8).numpy(), zlib.crc32(ko.view(torch.uint8).numpy(), 0x1234)))
        assert crc == want


@settings(max_examples=60, deadline=None)
@given(
    t=st.integers(0, 70),
    h=st.integers(1, 4),
    d=st.integers(1, 70),
    ps=st.integers(1, 20),
    scope=st.sampled_from(["per_tensor", "per_layer_head", "per_page_head"]),
    dt=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    mag=st.sampled_from([1e-6, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_native_equals_torch(t, h, d, ps, scope, dt, mag, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, d, generator=g).half()
    v = (torch.randn(t, h, d, generator=g) * mag).to(dt)
    a = encode(k, v, scope=scope, page_size=ps, backend="native")
    assert a == encode(k, v, scope=scope, page_size=ps, backend="torch")
    da = decode(a, out_v_dtype=torch.float16, backend="native")
    db = decode(a, out_v_dtype=torch.float16, backend="torch")
    assert torch.equal(_bits(da.v), _bits(db.v))


# --- CRC, buffers, backend choice ---------------------------------------------------------------


def test_crc32_every_level_lengths_offsets_threads(level):
    from kvcodec import _cpu

    rng = random.Random(level)
    data = rng.randbytes(3 << 20)
    lengths = [*range(0, 300), 1 << 20, (3 << 20) - 77, *(rng.randrange(0, 1 << 21) for _ in range(40))]
    for n in lengths:
        off = rng.randrange(0, 64)
        init = rng.randrange(0, 1 << 32)
        buf = memoryview(data)[off : off + n]
        want = zlib.crc32(buf, init)
        assert _cpu.crc32(buf, init) == want
        assert _cpu.crc32(buf, init, 2) == want


def test_crc32_combine():
    from kvcodec import _cpu

    rng = random.Random(5)
    for _ in range(100):
        a = rng.randbytes(rng.randrange(0, 3000))
        b = rng.randbytes(rng.randrange(0, 70000))
        assert _cpu.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_crc32_refuses_non_buffers():
    from kvcodec import _cpu

    with pytest.raises(TypeError):
        _cpu.crc32("text")


@pytest.mark.parametrize("n", [0, 1, 4095, 3 << 20])
def test_empty_bytearray(n):
    b = native.empty_bytearray(n)
    assert type(b) is bytearray and len(b) == n
    b[:] = b"\x01" * n
    assert b.count(1) == n
    with pytest.raises(ValueError):
        native.empty_bytearray(-1)


def test_backend_resolution(monkeypatch):
    monkeypatch.delenv("KVCODEC_BACKEND", raising=False)
    assert resolve_backend("auto", "cpu") == "native"
    assert resolve_backend("native", "cpu") == "native"
    with pytest.raises(UnsupportedConfigError, match="native"):
        resolve_backend("native", "meta")
    monkeypatch.setattr(native, "AVAILABLE", False)
    assert resolve_backend("auto", "cpu") == "torch"
    with pytest.raises(UnsupportedConfigError, match="not built"):
        resolve_backend("native", "cpu")
    monkeypatch.setenv("KVCODEC_BACKEND", "torch")
    monkeypatch.setattr(native, "AVAILABLE", True)
    assert resolve_backend(None, "cpu") == "torch"


def test_c_loops_on_two_threads_equal_one():
    """The C entry points can split tokens over two threads (the wrapper uses one); same bytes either way."""
    from kvcodec import _cpu

    g = torch.Generator().manual_seed(9)
    v = torch.randn(512, 8, 128, generator=g).half()  # above the C side's two-thread threshold
    s = quant.compute_scales(v, S.PER_PAGE_HEAD, page_size=16)
    outs = []
    for th in (1, 2):
        a = torch.empty(512, 8)
        _cpu.token_head_amax(v.data_ptr(), 512, 8, 128, 1024, 128, 0, a.data_ptr(), th)
        q = torch.empty(512, 8, 128, dtype=torch.uint8)
        assert not _cpu.quantize(v.data_ptr(), 512, 8, 128, 1024, 128, 0, s.data_ptr(), s.numel(), 2, 16, q.data_ptr(),
                                 1024, 128, th)  # fmt: skip
        o = torch.empty(512, 8, 128, dtype=torch.bfloat16)
        assert _cpu.dequantize(q.data_ptr(), 512, 8, 128, 1024, 128, s.data_ptr(), s.numel(), 2, 16, o.data_ptr(),
                               1024, 128, 1, th) == 0  # fmt: skip
        outs.append((a, q, o))
    for x, y in zip(*outs):
        assert torch.equal(_bits(x), _bits(y))
    assert torch.equal(outs[0][0], quant.token_head_amax(v))


# --- decode: the CRC checked while a read-only blob is copied out ------------------------------


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("kind", ["bytes", "bytearray", "copy"])
def test_decode_copy_and_crc_in_one_pass(version, kind):
    k = torch.randn(600, 4, 64).half()
    v = torch.randn(600, 4, 64).half()
    blob = encode(k, v, scope="per_page_head", page_size=16, version=version)
    src = bytes(blob) if kind == "bytes" else bytearray(blob)
    res = decode(src, copy=kind == "copy")
    assert torch.equal(res.k, k)
    assert torch.equal(res.v.view(torch.uint8), decode(bytes(blob), backend="torch").v.view(torch.uint8))
    res.k.zero_()
    if kind == "bytearray":  # a writable buffer without copy=True: K and V are views of it
        assert bytes(src) != bytes(blob)
        src = bytearray(blob)
    else:  # never an alias of an immutable buffer, nor of one the caller asked to copy
        assert bytes(src) == bytes(blob)
    dq = decode(src, out_v_dtype=torch.bfloat16)
    assert torch.equal(dq.v, decode(bytes(blob), out_v_dtype=torch.bfloat16, backend="torch").v)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("where", ["k", "v", "scales"])
@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_decode_detects_corruption_like_parse(version, where, kind):
    from kvcodec.errors import CorruptEncodedKVError

    k = torch.randn(300, 2, 64).half()
    v = torch.randn(300, 2, 64).half()
    blob = bytearray(encode(k, v, scope="per_page_head", page_size=16, version=version))
    p = parse(blob)
    off = {"k": p.header_len + 5, "v": p.header_len + p.header.k_payload_len + 7, "scales": len(blob) - 2}[where]
    blob[off] ^= 0x10
    with pytest.raises(CorruptEncodedKVError) as want:
        parse(bytes(blob))
    for od in (None, torch.float16):
        with pytest.raises(CorruptEncodedKVError) as got:
            decode(kind(blob), out_v_dtype=od)
        assert str(got.value) == str(want.value)
    assert decode(kind(blob), verify_crc=False).k.shape == (300, 2, 64)


def test_unzeroed_blob_buffers_are_written_in_full(monkeypatch):
    """Blobs start from unzeroed memory: every byte must be written. Poison it and compare."""
    cases = []
    g = torch.Generator().manual_seed(4)
    k = torch.randn(37, 3, 24, generator=g).half()
    v = torch.randn(37, 3, 24, generator=g).half()
    for be in ("native", "torch"):
        for kw in (
            dict(scope="per_page_head", page_size=8),
            dict(scope="per_tensor", version=2, hashes={"model_id": "m"}),
            dict(scope="per_layer_head", scale_dtype=torch.float16),
            dict(scope="external", scales=torch.tensor([0.1, 0.2, 0.3])),
            dict(scope="external", scales=torch.tensor(0.1), store_scales=True),
            dict(scope="raw", version=2),
        ):
            cases.append((be, kw, encode(k, v, backend=be, **kw)))
    cases.append(("empty", {}, encode(k[:0], v[:0], scope="per_tensor")))
    real = native.empty_bytearray
    monkeypatch.setattr(native, "empty_bytearray", lambda n: bytearray(b"\xa5" * n))
    for be, kw, want in cases:
        got = encode(k[:0], v[:0], scope="per_tensor") if be == "empty" else encode(k, v, backend=be, **kw)
        assert got == want, (be, kw)
    monkeypatch.setattr(native, "empty_bytearray", real)
    # decode's copy of a read-only blob too
    blob = bytes(cases[0][2])
    monkeypatch.setattr(native, "empty_bytearray", lambda n: bytearray(b"\x5a" * n))
    r = decode(blob)
    assert torch.equal(r.k, k)
    assert torch.equal(r.v.view(torch.uint8), decode(bytearray(blob)).v.view(torch.uint8))


def test_misaligned_tensors_take_the_reference():
    """Tensors over a buffer at an odd offset (views into a blob) are not handed to C."""
    g = torch.Generator().manual_seed(8)
    v = torch.randn(20, 2, 32, generator=g).half()
    def odd(n: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(1 + 2 * n), dtype=torch.float16, offset=1, count=n)

    mis = odd(v.numel()).view(20, 2, 32)
    mis.copy_(v)
    assert mis.data_ptr() % 2 == 1
    s = native.compute_scales(mis, S.PER_PAGE_HEAD, page_size=4)
    assert torch.equal(s, quant.compute_scales(v, S.PER_PAGE_HEAD, page_size=4))
    q = native.quantize(mis, s, S.PER_PAGE_HEAD, page_size=4)
    assert torch.equal(_bits(q), _bits(quant.quantize(v, s, S.PER_PAGE_HEAD, page_size=4)))
    out = odd(v.numel()).view(20, 2, 32)
    native.dequantize(q, s, S.PER_PAGE_HEAD, page_size=4, out=out)
    assert torch.equal(out, quant.dequantize(q, s, S.PER_PAGE_HEAD, page_size=4))
    assert encode(mis, mis, scope="per_tensor") == encode(v, v, scope="per_tensor", backend="torch")


# --- review findings: each took the reference or raised, never a wrong answer ------------------


def test_non_integer_page_size_never_reaches_c():
    v = torch.randn(64, 1, 16).half()
    s = torch.ones(34, 1)
    for f in (
        lambda: native.quantize(v, s, S.PER_PAGE_HEAD, page_size=1.9),
        lambda: native.dequantize(quant.quantize(v, torch.ones(64, 1), S.PER_PAGE_HEAD, page_size=1), s,
                                  S.PER_PAGE_HEAD, page_size=1.9),
    ):
        with pytest.raises((RuntimeError, UnsupportedConfigError, TypeError)):
            f()
    assert torch.equal(native.compute_scales(v, S.PER_PAGE_HEAD, page_size=2),
                       quant.compute_scales(v, S.PER_PAGE_HEAD, page_size=2))  # fmt: skip


def test_c_refuses_too_few_scales():
    from kvcodec import _cpu

    v = torch.randn(64, 2, 16).half()
    s = torch.ones(3)
    q = torch.empty(64, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="fewer scales"):
        _cpu.quantize(v.data_ptr(), 64, 2, 16, 32, 16, 0, s.data_ptr(), 3, 2, 16, q.data_ptr(), 32, 16, 1)
    with pytest.raises(ValueError, match="fewer scales"):
        _cpu.dequantize(q.data_ptr(), 64, 2, 16, 32, 16, s.data_ptr(), 3, 2, 16, v.data_ptr(), 32, 16, 0, 1)


def test_lazily_negated_tensors():
    v = torch.randn(16, 2, 8).half()
    neg = torch._neg_view(v)
    assert neg.is_neg()
    s = quant.compute_scales(neg, S.PER_TENSOR)
    assert torch.equal(native.compute_scales(neg, S.PER_TENSOR), s)
    assert torch.equal(_bits(native.quantize(neg, s, S.PER_TENSOR)), _bits(quant.quantize(neg, s, S.PER_TENSOR)))
    assert encode(neg, neg, scope="per_tensor") == encode(neg, neg, scope="per_tensor", backend="torch")


def test_overlapping_outputs_are_refused_like_the_reference():
    v = torch.randn(4, 2, 8).half()
    s = torch.tensor(0.01)
    out = torch.empty(1, 1, 8, dtype=torch.float8_e4m3fn).expand(4, 2, 8)
    with pytest.raises(RuntimeError, match="more than one element"):
        native.quantize(v, s, S.PER_TENSOR, out=out)
    q = quant.quantize(v, s, S.PER_TENSOR)
    with pytest.raises(RuntimeError, match="more than one element"):
        native.dequantize(q, s, S.PER_TENSOR, out=torch.empty(1, 1, 8).half().expand(4, 2, 8))


def test_copy_crc_overlap_noncontiguous_and_lengths():
    data = bytearray(range(256)) * 8
    want_crc = zlib.crc32(data[:1000])
    want = bytes(data[:1000])
    mv = memoryview(data)
    assert native.copy_crc(mv[24:1024], mv[:1000]) == want_crc  # overlapping, dst after src
    assert bytes(data[24:1024]) == want
    src = memoryview(bytes(range(64)))[::2]
    dst = bytearray(32)
    assert native.copy_crc(memoryview(dst), src) == zlib.crc32(bytes(src)) and dst == bytes(src)
    with pytest.raises(ValueError, match="holds"):
        native.copy_crc(memoryview(bytearray(3)), memoryview(b"ab"))
    with pytest.raises(ValueError, match="contiguous"):
        native.copy_crc(memoryview(bytearray(8))[::2], memoryview(b"abcd"))


def test_amax_nan_is_canonical():
    for dt, bad in ((torch.float16, 0x7C01), (torch.bfloat16, 0xFF81)):
        x = torch.zeros(2, 1, 4, dtype=dt)
        x.view(torch.int16)[1, 0, 2] = bad - (1 << 16) if bad >= 1 << 15 else bad
        got = native.token_head_amax(x)
        assert torch.equal(_bits(got), _bits(quant.token_head_amax(x)))


def test_corrupt_v2_header_reports_crc_first():
    from kvcodec.errors import CorruptEncodedKVError

    k = torch.randn(32, 2, 8).half()
    blob = bytearray(encode(k, k, scope="per_tensor", version=2))
    blob[20] ^= 0x01  # a layout field, covered by v2's CRC
    with pytest.raises(CorruptEncodedKVError) as want:
        parse(bytes(blob))
    with pytest.raises(CorruptEncodedKVError) as got:
        decode(bytes(blob))
    assert str(got.value) == str(want.value)


def test_quantize_checks_fp8_dtype_first():
    with pytest.raises(UnsupportedConfigError, match="not an FP8 dtype"):
        native.quantize(torch.randn(2, 2, 2).half(), torch.tensor(1.0), S.PER_TENSOR, fp8_dtype=torch.float16)


def test_encode_chunk_refuses_what_it_cannot_do():
    k = torch.randn(8, 2, 16).half()
    q = torch.empty(8, 2, 16, dtype=torch.uint8)
    with pytest.raises(UnsupportedConfigError, match="reference"):
        native.encode_chunk(k[:4], k, S.PER_TENSOR, None, torch.empty_like(k), q, torch.empty(4, dtype=torch.uint8), 0)


@pytest.mark.parametrize("openmp", [True, False], ids=["torch-openmp-team", "own-pthread"])
def test_two_thread_paths_equal(monkeypatch, openmp):
    """Both ways of running two threads (a team of torch's OpenMP runtime, or a pthread) give the same bytes."""
    from kvcodec import _cpu

    monkeypatch.setenv("KVCODEC_THREADS", "2")
    if openmp and not native.OPENMP:
        pytest.skip("torch's OpenMP runtime was not found in this process")
    try:
        if not openmp:
            _cpu.use_openmp("")
        g = torch.Generator().manual_seed(21)
        k = torch.randn(1100, 8, 128, generator=g).half()
        v = torch.randn(1100, 8, 128, generator=g).half()
        for scope in ("per_page_head", "per_layer_head"):
            a = encode(k, v, scope=scope, page_size=16)
            assert native.LAST_ENCODE_THREADS == 2
            assert a == encode(k, v, scope=scope, page_size=16, backend="torch")
        data = bytes(a)
        for th in (1, 2):
            assert _cpu.crc32(data, 5, th) == zlib.crc32(data, 5)
            dst = bytearray(len(data))
            assert _cpu.copy_crc(dst, data, 5, th) == zlib.crc32(data, 5) and dst == data
    finally:
        if native.OPENMP:
            assert _cpu.use_openmp(native._loaded_openmp())


def test_openmp_runtime_is_found_only_if_loaded():
    from kvcodec import _cpu

    assert not _cpu.use_openmp("/nonexistent/libgomp.so.1")
    assert not _cpu.use_openmp("")
    if native.OPENMP:
        assert _cpu.use_openmp(native._loaded_openmp())


_FORK_INPUTS: list[torch.Tensor] = []


def test_forked_child_encodes_without_hanging():
    """GNU libgomp hangs in a forked child that starts a team; kvcodec's child uses a pthread instead.

    (torch's own parallel ops hang in such a child too, so the child only
    encodes tensors it inherited: kvcodec's encode runs no parallel torch op.)
    """
    import multiprocessing as mp
    import os

    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    g = torch.Generator().manual_seed(3)
    _FORK_INPUTS[:] = [torch.randn(1100, 8, 128, generator=g).half() for _ in range(2)]
    want = encode(*_FORK_INPUTS, scope="per_page_head", page_size=16)  # the parent's team exists now
    assert native.LAST_ENCODE_THREADS == 2
    with mp.get_context("fork").Pool(1) as pool:
        got, used = pool.apply_async(_child_encode, ()).get(timeout=60)
    assert got == bytes(want) and used == 2


def _child_encode() -> tuple[bytes, int]:
    blob = encode(*_FORK_INPUTS, scope="per_page_head", page_size=16)
    return bytes(blob), native.LAST_ENCODE_THREADS


def test_crc_threads_follow_settings_per_call(monkeypatch):
    """A long CRC asks for its threads at each call (KVCODEC_THREADS, torch's count), not once at import."""
    from kvcodec import crc as crc_mod

    seen = []
    monkeypatch.setattr(crc_mod, "_threads_source", lambda: seen.append(1) or 1)
    data = bytes(2 << 20)
    assert crc_mod.crc32(data) == zlib.crc32(data)
    assert crc_mod.crc32(data[:1000]) == zlib.crc32(data[:1000])
    assert len(seen) == 1  # asked for the long buffer only
    monkeypatch.setenv("KVCODEC_THREADS", "1")
    assert native.crc_threads() == 1
    monkeypatch.setenv("KVCODEC_THREADS", "2")
    assert native.crc_threads() == (min(2, torch.get_num_threads()) if native.OPENMP else 1)


def test_use_openmp_switch_races_with_running_crcs():
    """Switching the OpenMP hooks while other threads run two-thread CRCs never crashes or errs."""
    import threading

    from kvcodec import _cpu

    if not native.OPENMP:
        pytest.skip("torch's OpenMP runtime was not found in this process")
    data = bytes(range(256)) * 8192  # 2 MiB
    want = zlib.crc32(data)
    bad, stop = [], threading.Event()

    def work():
        while not stop.is_set():
            if _cpu.crc32(data, 0, 2) != want:
                bad.append(1)

    ts = [threading.Thread(target=work) for _ in range(2)]
    for t in ts:
        t.start()
    path = native._loaded_openmp()
    for i in range(300):
        _cpu.use_openmp("" if i % 2 else path)
    stop.set()
    for t in ts:
        t.join()
    assert _cpu.use_openmp(path) and not bad


@settings(max_examples=50, deadline=None)
@given(
    t=st.integers(0, 40),
    h=st.integers(1, 3),
    d=st.integers(1, 40),
    ps=st.integers(1, 12),
    scope=st.sampled_from(["per_tensor", "per_layer_head", "per_page_head", "raw"]),
    version=st.sampled_from([1, 2]),
    kind=st.sampled_from(["bytes", "bytearray", "copy"]),
    od=st.sampled_from([None, torch.float16, torch.bfloat16, torch.float32]),
    trailing=st.integers(0, 3),
)
def test_hypothesis_decode_paths_equal_reference(t, h, d, ps, scope, version, kind, od, trailing):
    """Every decode path of the native backend (fused CRC + copy, K-only copy, views) equals the torch backend."""
    if scope == "raw":
        version = 2
    if version == 2:
        trailing = 0  # v2 refuses trailing bytes
    g = torch.Generator().manual_seed(t * 131 + h * 17 + d)
    k = torch.randn(t, h, d, generator=g).half()
    v = torch.randn(t, h, d, generator=g).bfloat16()
    blob = bytes(encode(k, v, scope=scope, page_size=ps, version=version)) + b"\0" * trailing
    src = bytearray(blob) if kind != "bytes" else blob
    a = decode(src, out_v_dtype=od, copy=kind == "copy")
    b = decode(bytearray(blob), out_v_dtype=od, backend="torch")
    assert torch.equal(_bits(a.k), _bits(b.k)) and torch.equal(_bits(a.v), _bits(b.v))
    assert bytes(src) == blob
