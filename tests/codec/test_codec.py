"""The K16/V8 codec on its torch backend: numerics, scopes, layouts, errors."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec import numerics
from kvcodec.backends import reference
from kvcodec.codec import decode, encode, encode_layers, normalize_layout
from kvcodec.errors import CodecMismatchError, Reason, UnsupportedConfigError
from kvcodec.format import Hashes, ScaleScheme, ScaleScope, parse
from tests.oracle import oracle_encode
from tests.paths import SHARED_VECTORS
from tests.raises import raises_reason

VECTORS = SHARED_VECTORS
SCOPES = ["per_tensor", "per_layer_head", "per_page_head"]
VDTYPES = [torch.float16, torch.bfloat16, torch.float32]
KDTYPES = [torch.float16, torch.bfloat16]
# (tokens, heads, head_dim, page_size): 1 token, partial last page, 1 head, head_dim 256, page 1.
SHAPES = [(1, 1, 8, 4), (37, 2, 16, 16), (20, 1, 256, 8), (12, 3, 48, 1), (64, 8, 128, 16)]


def _kv(t, h, d, kd=torch.float16, vd=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, d, generator=g).to(kd)
    v = (torch.randn(t, h, d, generator=g) * 3).to(vd)
    return k, v


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("vd", VDTYPES, ids=str)
def test_stored_scales_and_codes_equal_the_oracles(scope, shape, vd):
    t, h, d, ps = shape
    k, v = _kv(t, h, d, vd=vd, seed=t)
    raw = decode(encode(k, v, scope=scope, page_size=ps))
    s_ref, q_ref = oracle_encode(v, scope, ps, torch.float8_e4m3fn, torch.float32)
    assert torch.equal(raw.scales, s_ref)
    assert torch.equal(raw.v.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kd", KDTYPES, ids=str)
@pytest.mark.parametrize("vd", VDTYPES, ids=str)
def test_roundtrip_shapes_and_exact_k(scope, shape, kd, vd):
    t, h, d, ps = shape
    k, v = _kv(t, h, d, kd, vd, seed=d)
    blob = encode(k, v, scope=scope, page_size=ps)
    p = parse(blob)
    assert (p.header.kv_head_count, p.header.head_dim, p.header.chunk_size, p.header.page_size) == (
        h,
        d,
        t,
        ps,
    )
    raw = decode(blob)
    assert raw.k.shape == (t, h, d) and raw.v.shape == (t, h, d)
    assert torch.equal(raw.k.view(torch.uint8), k.view(torch.uint8))
    assert raw.v.dtype == torch.float8_e4m3fn
    for od in VDTYPES:
        dq = decode(blob, out_v_dtype=od)
        assert dq.v.dtype == od and dq.v.shape == (t, h, d)
        # Error bound of e4m3 (3 mantissa bits): half an ulp, relative 2^-4, per group max.
        s_tok = numerics.token_scales(dq.scales, ScaleScope[scope.upper()], t, h, ps)
        err = (dq.v.float() - v.float()).abs()
        bound = v.float().abs() * 2**-4 + s_tok * 2**-9 + 1e-2 * v.float().abs() + 1e-6
        assert bool((err <= bound).all())


def test_dequant_is_q_times_scale():
    k, v = _kv(33, 2, 16, seed=3)
    blob = encode(k, v, scope="per_page_head", page_size=8)
    raw = decode(blob)
    dq = decode(blob, out_v_dtype=torch.float32).v
    s_tok = raw.scales.repeat_interleave(8, 0)[:33].unsqueeze(-1)
    assert torch.equal(dq, raw.v.float() * s_tok)


@pytest.mark.skipif(not VECTORS.is_dir(), reason="../shared/vectors not present")
def test_codec_vectors_reproduced_byte_for_byte():
    manifest = json.loads((VECTORS / "manifest.json").read_text())
    n = 0
    for vec in manifest["vectors"]:
        if vec["kind"] != "codec":
            continue
        dt = getattr(torch, vec["input_dtype"])
        k = torch.frombuffer(bytearray((VECTORS / f"{vec['name']}.k").read_bytes()), dtype=dt)
        v = torch.frombuffer(bytearray((VECTORS / f"{vec['name']}.v").read_bytes()), dtype=dt)
        k, v = k.view(vec["input_shape"]), v.view(vec["input_shape"])
        blob = encode(
            k,
            v,
            scope=vec["scale_scope"],
            page_size=vec["page_size"],
            hashes=vec["hashes"],
            layer_id=vec["layer_id"],
            chunk_id=vec["chunk_id"],
            chunk_size=vec["chunk_size"],
            version=1,  # the reference writes v1; kvcodec's own default is the sealed v2
        )
        ref = (VECTORS / f"{vec['name']}.blob").read_bytes()
        assert bytes(blob) == ref, vec["name"]
        assert torch.equal(decode(ref).k.view(torch.uint8), k.view(torch.uint8))
        n += 1
    assert n == 3


def test_paged_input_equals_token_major():
    k, v = _kv(64, 4, 32, seed=5)
    a = encode(k, v, scope="per_page_head", page_size=16)
    b = encode(k.view(4, 16, 4, 32), v.view(4, 16, 4, 32), scope="per_page_head")
    assert a == b


@pytest.mark.parametrize("order", [(1, 0, 2), (2, 0, 1, 3), (0, 2, 1, 3)])
def test_arbitrary_layouts(order):
    """head/page axes in any order (page after head too) give the token-major blob."""
    k, v = _kv(48, 3, 16, seed=7)
    ref = encode(k, v, scope="per_page_head", page_size=16)
    if len(order) == 3:  # [heads, tokens, dim]
        kk, vv = k.permute(order), v.permute(order)
        got = encode(kk, vv, scope="per_page_head", page_size=16, head_axis=0)
    else:
        # paged [pages, slots, heads, dim] permuted; name the axes where they land
        kp, vp = k.view(3, 16, 3, 16), v.view(3, 16, 3, 16)
        kk, vv = kp.permute(order), vp.permute(order)
        head_axis, page_axis = order.index(2), order.index(0)
        got = encode(kk, vv, scope="per_page_head", head_axis=head_axis, page_axis=page_axis)
    assert got == ref


def test_noncontiguous_slice_encodes_only_its_bytes():
    kv = torch.randn(2, 40, 2, 16).half()
    blob = encode(kv[0], kv[1], scope="per_layer_head")
    assert parse(blob).header.k_payload_len == 40 * 2 * 16 * 2
    assert torch.equal(decode(blob).k, kv[0])
    assert blob == encode(kv[0].clone(), kv[1].clone(), scope="per_layer_head")


def test_decode_into_caller_buffers():
    k, v = _kv(20, 2, 16, seed=9)
    blob = encode(k, v, scope="per_page_head", page_size=8)
    big_k = torch.zeros(2, 20, 2, 16, dtype=torch.float16)
    big_v = torch.zeros(2, 20, 2, 16, dtype=torch.bfloat16)
    res = decode(blob, out_k=big_k[1], out_v=big_v[0])
    assert res.k.data_ptr() == big_k[1].data_ptr()
    assert torch.equal(big_k[1], k)
    assert torch.equal(big_v[0], decode(blob, out_v_dtype=torch.bfloat16).v)
    assert not big_v[1].any()


def test_decode_is_zero_copy_over_writable_buffer():
    k, v = _kv(8, 2, 16, seed=1)
    blob = encode(k, v, scope="per_tensor")
    p = parse(blob)
    res = decode(blob)
    base = torch.frombuffer(blob, dtype=torch.uint8).data_ptr()
    assert res.k.data_ptr() == base + p.header_len
    assert res.v.data_ptr() == base + p.header_len + p.header.k_payload_len
    copied = decode(blob, copy=True)
    assert copied.k.data_ptr() != res.k.data_ptr()
    ro = decode(bytes(blob))  # read-only source: one copy, no warning
    assert torch.equal(ro.k, k)


def test_hash_gate():
    k, v = _kv(4, 1, 8)
    blob = encode(k, v, scope="per_tensor", hashes={"model_id": "llama", "kv_layout": ""})
    decode(blob, expected_hashes={"model_id": "llama"})
    decode(blob, expected_hashes={"tokenizer_hash": "x"})  # empty in blob: wildcard
    with raises_reason(CodecMismatchError, Reason.HASH_MISMATCH):
        decode(blob, expected_hashes=Hashes(model_id="mistral"))
    with raises_reason(CodecMismatchError, Reason.HASH_MISSING):
        decode(blob, expected_hashes={"tokenizer_hash": "x"}, strict_hashes=True)


def test_nan_inf_refused_with_group_named():
    k, v = _kv(32, 2, 8)
    v[20, 1, 3] = float("nan")
    with raises_reason(UnsupportedConfigError, Reason.NONFINITE_V) as info:
        encode(k, v, scope="per_page_head", page_size=16)
    assert "page 1, head 1" in str(info.value)  # the message names the group for the user
    v[20, 1, 3] = float("inf")
    with raises_reason(UnsupportedConfigError, Reason.NONFINITE_V) as info:
        encode(k, v, scope="per_layer_head")
    assert "head 1" in str(info.value)
    with raises_reason(UnsupportedConfigError, Reason.NONFINITE_V) as info:
        encode(k, v, scope="per_tensor")
    assert "whole tensor" in str(info.value)
    blob = encode(k, v, scope="per_page_head", page_size=16, nonfinite="saturate")
    raw = decode(blob)
    assert raw.v[20, 1, 3].float().item() == 448.0
    assert torch.isfinite(raw.scales).all()


def test_empty_tensor_roundtrip():
    k = torch.empty(0, 2, 16, dtype=torch.float16)
    for scope in SCOPES:
        blob = encode(k, k, scope=scope, page_size=4)
        res = decode(blob, out_v_dtype=torch.float16)
        assert res.k.shape == (0, 2, 16) and res.v.shape == (0, 2, 16)


def test_external_scope():
    k, v = _kv(16, 2, 8)
    scales = torch.tensor([0.01, 0.02])
    blob = encode(k, v, scope="external", scales=scales)
    p = parse(blob)
    assert p.header.scale_scope == ScaleScope.EXTERNAL and p.header.scale_payload_len == 0
    raw = decode(blob)
    assert raw.scales is None
    with raises_reason(UnsupportedConfigError, Reason.MISSING_ARGUMENT):
        decode(blob, out_v_dtype=torch.float16)
    dq = decode(blob, out_v_dtype=torch.float32, scales=scales).v
    assert torch.equal(dq, raw.v.float() * scales.view(1, 2, 1))
    with raises_reason(UnsupportedConfigError, Reason.MISSING_ARGUMENT):
        encode(k, v, scope="external")


def test_raw_unit_scale_v2():
    k, v = _kv(16, 2, 8)
    v = v.clamp(-400, 400)
    blob = encode(k, v, scope="raw")
    p = parse(blob)
    assert p.header.version == 2 and p.header.scale_scheme == ScaleScheme.UNIT
    assert p.header.scale_scope == ScaleScope.NONE and p.header.scale_payload_len == 0
    raw = decode(blob)
    assert torch.equal(raw.v.view(torch.uint8), v.float().to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(decode(blob, out_v_dtype=torch.float32).v, raw.v.float())


def test_e5m2_opt_in():
    k, v = _kv(16, 2, 8)
    with raises_reason(UnsupportedConfigError, Reason.UNSUPPORTED_DTYPE):
        encode(k, v, scope="per_tensor", v_dtype=torch.float8_e5m2)
    blob = encode(k, v, scope="per_layer_head", v_dtype=torch.float8_e5m2, allow_e5m2=True)
    raw = decode(blob)
    assert raw.v.dtype == torch.float8_e5m2
    amax = v.float().abs().amax(dim=(0, 2))
    assert torch.equal(raw.scales, amax / 57344.0)


def test_precomputed_fp8_passthrough():
    k, v = _kv(32, 2, 16)
    s = reference.compute_scales(v, ScaleScope.PER_PAGE_HEAD, page_size=16)
    q = reference.quantize(v, s, ScaleScope.PER_PAGE_HEAD, page_size=16)
    a = encode(k, v, scope="per_page_head", page_size=16)
    b = encode(k, None, scope="per_page_head", page_size=16, precomputed_v_quant=q, precomputed_v_scales=s)
    assert a == b
    with raises_reason(UnsupportedConfigError, Reason.MISSING_ARGUMENT):
        encode(k, None, scope="per_page_head", page_size=16, precomputed_v_quant=q)
    with raises_reason(UnsupportedConfigError, Reason.UNSUPPORTED_DTYPE):
        encode(
            k,
            None,
            scope="per_page_head",
            page_size=16,
            precomputed_v_quant=q.view(torch.uint8),
            precomputed_v_scales=s,
        )
    with raises_reason(UnsupportedConfigError, Reason.BAD_SCALES):
        encode(
            k, None, scope="per_page_head", page_size=16, precomputed_v_quant=q, precomputed_v_scales=s[:1]
        )


def test_no_k_blob():
    _, v = _kv(8, 2, 8)
    blob = encode(None, v, scope="per_tensor")
    res = decode(blob, out_v_dtype=torch.float16)
    assert res.k is None and res.v.shape == (8, 2, 8)


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        (
            {"k": torch.zeros(4, 2, 8, dtype=torch.int16), "v": torch.zeros(4, 2, 8).half()},
            Reason.UNSUPPORTED_DTYPE,
        ),
        ({"k": torch.zeros(4, 2, 8).half(), "v": torch.zeros(4, 2, 9).half()}, Reason.BAD_SHAPE),
        (
            {"k": torch.zeros(4, 2, 8).half(), "v": torch.zeros(4, 2, 8, dtype=torch.int32)},
            Reason.UNSUPPORTED_DTYPE,
        ),
        ({"k": torch.zeros(8).half(), "v": torch.zeros(8).half()}, Reason.BAD_SHAPE),
        ({"head_axis": 2}, Reason.BAD_VALUE),
        ({"head_axis": 7}, Reason.BAD_VALUE),
        ({"scope": "per_page_head"}, Reason.MISSING_ARGUMENT),
        ({"scope": "bogus"}, Reason.BAD_SCOPE),
        ({"page_size": 0}, Reason.BAD_VALUE),
        ({"kv_head_count": 3}, Reason.BAD_SHAPE),
        ({"chunk_size": 2}, Reason.BAD_VALUE),
        ({"scale_dtype": torch.int8}, Reason.UNSUPPORTED_DTYPE),
        ({"v_dtype": torch.float16}, Reason.UNSUPPORTED_DTYPE),
        ({"version": 3}, Reason.UNSUPPORTED_VERSION),
    ],
)
def test_bad_encode_input_is_a_config_error_with_its_reason(kwargs, reason):
    base = {"k": torch.zeros(4, 2, 8).half(), "v": torch.zeros(4, 2, 8).half(), "scope": "per_tensor"}
    base.update(kwargs)
    k, v = base.pop("k"), base.pop("v")
    with raises_reason(UnsupportedConfigError, reason):
        encode(k, v, **base)


def test_unknown_backend_is_a_config_error():
    with pytest.raises(UnsupportedConfigError):
        encode(torch.zeros(4, 2, 8).half(), torch.zeros(4, 2, 8).half(), backend="cuda-magic")


def test_encode_layers():
    ks = torch.randn(3, 16, 2, 8).half()
    vs = torch.randn(3, 16, 2, 8).half()
    blobs = encode_layers(ks, vs, scope="per_layer_head")
    assert [parse(b).header.layer_id for b in blobs] == [0, 1, 2]
    assert blobs[1] == encode(ks[1], vs[1], scope="per_layer_head", layer_id=1)


def test_normalize_layout_views_without_copy():
    x = torch.randn(4, 16, 2, 8)
    y, lay = normalize_layout(x)
    assert y.data_ptr() == x.data_ptr() and lay.page_size == 16 and y.shape == (64, 2, 8)


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(0, 40),
    h=st.integers(1, 4),
    d=st.integers(1, 24),
    ps=st.integers(1, 17),
    scope=st.sampled_from(SCOPES),
    seed=st.integers(0, 2**16),
    kd=st.sampled_from(KDTYPES),
)
def test_roundtrip_property(t, h, d, ps, scope, seed, kd):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, d, generator=g).to(kd)
    v = (torch.randn(t, h, d, generator=g) * torch.rand(1, generator=g) * 100).to(kd)
    blob = encode(k, v, scope=scope, page_size=ps)
    res = decode(blob, out_v_dtype=torch.float32)
    assert torch.equal(res.k.view(torch.uint8), k.view(torch.uint8))
    if t:
        s, q = oracle_encode(v, scope, ps, torch.float8_e4m3fn, torch.float32)
        assert torch.equal(decode(blob).v.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(res.scales, s)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_cuda_torch_backend_matches_cpu():
    k, v = _kv(40, 4, 64, seed=11)
    cpu = encode(k, v, scope="per_page_head", page_size=16, backend="torch")
    gpu = encode(k.cuda(), v.cuda(), scope="per_page_head", page_size=16, backend="torch")
    assert cpu == gpu
    res = decode(cpu, device="cuda", out_v_dtype=torch.float16, backend="torch")
    assert res.v.is_cuda and torch.equal(res.v.cpu(), decode(cpu, out_v_dtype=torch.float16).v)


@pytest.mark.parametrize("dt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_widening_exact_for_all_256_codes(dt):
    codes = torch.arange(256, dtype=torch.uint8).view(dt).view(16, 1, 16)
    got = reference.fp8_to_float32(codes, torch.empty(16, 1, 16))
    ref = codes.to(torch.float32)
    same = (got.view(torch.int32) == ref.view(torch.int32)) | (got.isnan() & ref.isnan())
    assert bool(same.all())  # bitwise, so -0.0 keeps its sign
    assert torch.equal(got.isnan(), ref.isnan())


@pytest.mark.parametrize("scale", [1.0, 3.7e-3, 2.0**-120, 1e-40, 2.0**119, 3.0e38, float("inf")])
@pytest.mark.parametrize("od", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_dequant_exact_for_all_codes_and_extreme_scales(scale, od):
    """(float(q)*scale).to(od) for every code, scales near fp32's edges included."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(256, 1, 1)
    s = torch.tensor(scale, dtype=torch.float32)
    got = reference.dequantize(codes, s, ScaleScope.PER_TENSOR, out_dtype=od)
    ref = (codes.to(torch.float32) * s).to(od)
    ib = torch.int32 if od == torch.float32 else torch.int16
    same = (got.view(ib) == ref.view(ib)) | (got.isnan() & ref.isnan())
    assert bool(same.all())


def test_decoding_bytes_warns_nothing_even_with_warnings_as_errors():
    """Read-only sources: no torch 'not writable' warning escapes, and no global filter is touched per call."""
    import subprocess
    import sys

    code = (
        "import torch, warnings, kvcodec\n"
        "kvcodec.decode  # the codec's one filter is added at its import\n"
        "n = len(warnings.filters)\n"
        "b = bytes(kvcodec.encode(torch.ones(4, 1, 8).half(), torch.ones(4, 1, 8).half(), scope='per_tensor'))\n"
        "for _ in range(3): kvcodec.decode(b); kvcodec.decode(b, out_v_dtype=torch.float16)\n"
        "assert len(warnings.filters) == n\n"
    )
    res = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr


# --- review findings, each pinned -------------------------------------------------


def test_unset_layout_blob_decodes_flat_or_with_shape():
    from kvcodec.format import Header, assemble

    k, v = _kv(8, 2, 4, seed=4)
    s = reference.compute_scales(v, ScaleScope.PER_LAYER_HEAD)
    q = reference.quantize(v, s, ScaleScope.PER_LAYER_HEAD)
    h = Header(
        k_dtype=torch.float16,
        v_dtype=torch.float8_e4m3fn,
        scale_scope=ScaleScope.PER_LAYER_HEAD,
        scale_shape=(2,),
    )  # LMCache's default: layout fields unset
    blob = assemble(h, k.numpy().tobytes(), q.view(torch.uint8).numpy().tobytes(), s.numpy().tobytes())
    raw = decode(blob)
    assert raw.k.shape == (64,) and raw.v.shape == (64,)
    with raises_reason(UnsupportedConfigError, Reason.MISSING_ARGUMENT):
        decode(blob, out_v_dtype=torch.float16)
    dq = decode(blob, out_v_dtype=torch.float32, shape=(8, 2, 4))
    assert torch.equal(dq.v, reference.dequantize(q, s, ScaleScope.PER_LAYER_HEAD, out_dtype=torch.float32))
    # per tensor needs no layout: dequantized flat
    h_pt = h.replace(scale_scope=ScaleScope.PER_TENSOR, scale_shape=())
    s0 = reference.compute_scales(v, ScaleScope.PER_TENSOR)
    q0 = reference.quantize(v, s0, ScaleScope.PER_TENSOR)
    blob0 = assemble(h_pt, b"", q0.view(torch.uint8).numpy().tobytes(), s0.reshape(1).numpy().tobytes())
    flat = decode(blob0, out_v_dtype=torch.float32).v
    assert flat.shape == (64,) and torch.equal(flat, (q0.float() * s0).reshape(-1))


def test_out_v_dtype_and_out_v_must_agree():
    k, v = _kv(8, 2, 8)
    blob = encode(k, v, scope="per_tensor")
    with raises_reason(UnsupportedConfigError, Reason.BAD_OUTPUT):
        decode(blob, out_v_dtype=torch.float8_e4m3fn, out_v=torch.empty(8, 2, 8, dtype=torch.float16))
    with raises_reason(UnsupportedConfigError, Reason.UNSUPPORTED_DTYPE):
        decode(blob, out_v=torch.empty(8, 2, 8, dtype=torch.int32))
    with raises_reason(UnsupportedConfigError, Reason.UNSUPPORTED_DTYPE):
        decode(blob, out_v_dtype=torch.float64)


def test_dequant_into_noncontiguous_connector_buffer():
    k, v = _kv(32, 2, 8)
    blob = encode(k, v, scope="per_page_head", page_size=16)
    cache = torch.zeros(2, 2, 16, 2, 8, dtype=torch.float16)  # [pages, K/V, page_size, H, D]
    decode(blob, out_k=cache[:, 0], out_v=cache[:, 1])
    assert torch.equal(cache[:, 0].reshape(32, 2, 8), k)
    assert torch.equal(cache[:, 1].reshape(32, 2, 8), decode(blob, out_v_dtype=torch.float16).v)


def test_raw_scope_with_precomputed_fp8():
    k, v = _kv(8, 2, 8)
    q = v.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    blob = encode(k, None, scope="raw", precomputed_v_quant=q)
    assert torch.equal(decode(blob).v.view(torch.uint8), q.view(torch.uint8))
    assert parse(blob).header.scale_scheme == ScaleScheme.UNIT


def test_external_scales_fp16_float_and_conflicts():
    k, v = _kv(8, 2, 8)
    s = torch.tensor([0.0123, 0.05])
    blob = encode(k, v, scope="external", scales=s, scale_dtype=torch.float16)
    dq = decode(blob, out_v_dtype=torch.float32, scales=s).v
    assert torch.equal(dq, decode(blob).v.float() * s.half().float().view(1, 2, 1))  # the scales encode used
    blob1 = encode(k, v, scope="external", scales=0.02)  # a plain float works
    assert decode(blob1, out_v_dtype=torch.float32, scales=0.02).v.shape == (8, 2, 8)
    stored = encode(
        k,
        None,
        scope="external",
        precomputed_v_quant=decode(blob).v,
        precomputed_v_scales=s,
        store_scales=True,
    )
    with raises_reason(UnsupportedConfigError, Reason.BAD_SCALES):
        decode(stored, out_v_dtype=torch.float32, scales=s * 2)
    assert decode(stored, out_v_dtype=torch.float32, scales=s).v.shape == (8, 2, 8)


def test_v2_unit_scheme_with_any_scope_decodes():
    from kvcodec.format import Header, assemble

    q = torch.arange(64, dtype=torch.uint8).view(torch.float8_e4m3fn).view(8, 2, 4)
    h = Header(
        k_dtype=torch.float16,
        v_dtype=torch.float8_e4m3fn,
        scale_scope=ScaleScope.PER_PAGE_HEAD,
        version=2,
        scale_scheme=ScaleScheme.UNIT,
        chunk_size=8,
        page_size=4,
        kv_head_count=2,
        head_dim=4,
        scale_shape=(2, 2),
    )
    blob = assemble(h, b"", q.view(torch.uint8).numpy().tobytes(), b"")
    assert torch.equal(decode(blob, out_v_dtype=torch.float32).v, q.float())


@pytest.mark.parametrize("amax", [1e-6, 1e8])
def test_fp16_scales_that_do_not_fit_are_refused(amax):
    k = torch.zeros(16, 1, 8, dtype=torch.float16)
    v = torch.full((16, 1, 8), amax, dtype=torch.float32)
    with raises_reason(UnsupportedConfigError, Reason.BAD_SCALES):
        encode(k, v, scope="per_page_head", page_size=8, scale_dtype=torch.float16)
    encode(k, v, scope="per_page_head", page_size=8)  # fp32 scales are fine


def test_k_fp32_accepted_bit_exact():
    k = torch.randn(8, 2, 8)
    res = decode(encode(k, k.half(), scope="per_tensor"))
    assert res.k.dtype == torch.float32 and torch.equal(res.k, k)


def test_memoized_plans_give_the_blobs_a_fresh_plan_gives(monkeypatch):
    """encode() reuses a layout's plan and header template across calls: ids, data and env still count."""
    import importlib

    encode_module = importlib.import_module("kvcodec.codec.encode")
    k1, v1 = _kv(20, 2, 16, seed=1)
    k2, v2 = _kv(20, 2, 16, seed=2)
    encode_module._PLANS.clear()
    encode(k1, v1, scope="per_page_head", page_size=8, layer_id=1, chunk_id=3)
    hit = encode(k2, v2, scope="per_page_head", page_size=8, layer_id=2, chunk_id=4)
    assert len(encode_module._PLANS) == 1
    encode_module._PLANS.clear()
    assert hit == encode(k2, v2, scope="per_page_head", page_size=8, layer_id=2, chunk_id=4)
    assert parse(hit).header.layer_id == 2 and parse(hit).header.chunk_id == 4
    monkeypatch.setenv("KVCODEC_BACKEND", "torch")
    assert hit == encode(k2, v2, scope="per_page_head", page_size=8, layer_id=2, chunk_id=4)
    assert len(encode_module._PLANS) == 2  # another backend: another plan
    with pytest.raises(UnsupportedConfigError):
        encode(k2, v2, scope="per_page_head", page_size=8, layer_id=-7)  # ids still checked on a hit


def test_memoized_plans_keep_no_tensor_alive():
    """The cache holds layouts only: no field of a cached entry is a tensor (the caller's memory is theirs)."""
    import dataclasses
    import importlib

    plans = importlib.import_module("kvcodec.codec.encode")._PLANS
    plans.clear()
    k, v = _kv(16, 2, 8, seed=3)
    encode(k, v, scope="per_layer_head", layer_id=5)
    (entry,) = plans.values()
    parts = [getattr(x, f.name) for x in entry if dataclasses.is_dataclass(x) for f in dataclasses.fields(x)]
    assert not any(isinstance(x, torch.Tensor) for x in [*entry, *parts])
