"""Byte-compatibility harness against the real LMCache 0.5.6 (``make lmcache`` installs it).

On random inputs, for every scope LMCache supports, kvcodec's native ``encode``
and its ``integrations.lmcache.compat.AsymK16V8Codec`` must write exactly the bytes
LMCache's ``AsymK16V8Codec`` writes (same header fields given), and each side
must read the other's blobs. Skipped when LMCache is not importable.
"""

from __future__ import annotations

import pytest
import torch

lm = pytest.importorskip("lmcache.v1.kv_codec", reason="LMCache 0.5.6 not installed (make lmcache)")

from kvcodec.codec import decode, encode  # noqa: E402
from kvcodec.integrations.lmcache.compat import AsymK16V8Codec as KvCompat  # noqa: E402

SCOPES = ["PER_TENSOR", "PER_LAYER_HEAD", "PER_PAGE_HEAD"]


def _inputs(seed: int, pages: int, ps: int, h: int, d: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(pages, ps, h, d, generator=g).to(dtype)
    scale = torch.rand(1, 1, h, 1, generator=g) * 50
    v = (torch.randn(pages, ps, h, d, generator=g) * scale).to(dtype)
    v[0, :, 0] = 0  # an all-zero group
    return k, v


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_blobs_byte_identical_to_lmcache(scope, dtype, seed):
    pages, ps, h, d = [(2, 16, 4, 64), (3, 8, 1, 128), (1, 16, 8, 32), (4, 4, 2, 256)][seed]
    k, v = _inputs(seed, pages, ps, h, d, dtype)
    fields = dict(layer_id=seed, chunk_id=7, chunk_size=pages * ps, page_size=ps, kv_head_count=h, head_dim=d)
    page_axis = 0 if scope == "PER_PAGE_HEAD" else None
    hashes_kw = dict(model_id="m", kv_layout="NHD")
    ref_codec = lm.AsymK16V8Codec(scale_scope=lm.ScaleScope[scope])
    ref = ref_codec.to_bytes(
        ref_codec.encode(k, v, hashes=lm.CodecHashes(**hashes_kw), page_axis=page_axis, **fields)
    )
    ours = KvCompat(scale_scope=getattr(lm.ScaleScope, scope).value)
    got = ours.to_bytes(ours.encode(k, v, hashes=hashes_kw, page_axis=page_axis, **fields))
    assert got == ref
    native = encode(
        k,
        v,
        scope=scope.lower(),
        hashes=hashes_kw,
        layer_id=seed,
        chunk_id=7,
        chunk_size=pages * ps,
        version=1,
    )
    assert bytes(native) == ref
    # Each reads the other's blob.
    k2, v2, s2 = ref_codec.decode(ref_codec.from_bytes(bytes(native)))
    assert torch.equal(k2.view(torch.uint8), k.reshape(-1).view(torch.uint8))
    res = decode(ref)
    assert torch.equal(res.v.reshape(-1).view(torch.uint8), v2.view(torch.uint8))
    assert torch.equal(res.scales, s2)


def test_external_scope_with_attached_scales_identical():
    k, v = _inputs(9, 2, 8, 2, 16, torch.float16)
    s = torch.tensor([0.05, 0.1])
    q = (v.float() / s.view(1, 1, 2, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    ref_codec = lm.AsymK16V8Codec(scale_scope=lm.ScaleScope.EXTERNAL)
    ref = ref_codec.to_bytes(
        ref_codec.encode(
            k,
            v,
            precomputed_v_quant=q,
            precomputed_v_scales=s,
            kv_head_count=2,
            head_dim=16,
            chunk_size=16,
            page_size=8,
        )
    )
    ours = KvCompat(scale_scope=3)
    got = ours.to_bytes(
        ours.encode(
            k,
            v,
            precomputed_v_quant=q,
            precomputed_v_scales=s,
            kv_head_count=2,
            head_dim=16,
            chunk_size=16,
            page_size=8,
        )
    )
    assert got == ref


def test_lmcache_cannot_dequant_per_head_but_kvcodec_can():
    k, v = _inputs(3, 2, 16, 4, 32, torch.float16)
    ref_codec = lm.AsymK16V8Codec(scale_scope=lm.ScaleScope.PER_PAGE_HEAD)
    blob = ref_codec.to_bytes(ref_codec.encode(k, v, page_axis=0, page_size=16, kv_head_count=4, head_dim=32))
    with pytest.raises(Exception):  # noqa: B017 - LMCache's own failure, whatever its type
        ref_codec.decode(ref_codec.from_bytes(blob), out_v_dtype=torch.float16)
    res = decode(blob, out_v_dtype=torch.float16)
    assert res.v.shape == (32, 4, 32)
    assert (res.v.float() - v.reshape(32, 4, 32).float()).abs().max() < 0.07 * v.float().abs().max()


@pytest.mark.parametrize("scope", ["PER_TENSOR", "PER_LAYER_HEAD"])
def test_head_major_layout_byte_identical(scope):
    g = torch.Generator().manual_seed(5)
    k = torch.randn(4, 32, 16, generator=g).half()  # [heads, tokens, dim]
    v = (torch.randn(4, 32, 16, generator=g) * 3).half()
    ref_codec = lm.AsymK16V8Codec(scale_scope=lm.ScaleScope[scope])
    ref = ref_codec.to_bytes(ref_codec.encode(k, v, head_axis=0, layer_id=2))
    ours = KvCompat(scale_scope=getattr(lm.ScaleScope, scope).value)
    assert ours.to_bytes(ours.encode(k, v, head_axis=0, layer_id=2)) == ref


def test_caller_layout_per_page_head_byte_identical():
    """[pages, heads, slots, dim] (head before the slots, so bytes stay in the caller's layout),
    an all-zero group included: scales and codes come from kvcodec's backends, bytes from LMCache."""
    g = torch.Generator().manual_seed(6)
    k = torch.randn(3, 4, 8, 16, generator=g).half()
    v = (torch.randn(3, 4, 8, 16, generator=g) * torch.rand(1, 4, 1, 1, generator=g) * 40).half()
    v[1, 2] = 0
    kw = dict(head_axis=1, page_axis=0, layer_id=1, page_size=8)
    ref_codec = lm.AsymK16V8Codec(scale_scope=lm.ScaleScope.PER_PAGE_HEAD)
    ours = KvCompat(scale_scope=2)
    assert ours.to_bytes(ours.encode(k, v, **kw)) == ref_codec.to_bytes(ref_codec.encode(k, v, **kw))


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_primitives_bit_identical_to_lmcache(scope, out_dtype):
    """quantize_v_fp8 / dequantize_v_fp8 (now through kvcodec's dispatcher) against LMCache's, in
    layouts that are not token-major (LMCache's own quantize fails when the head axis precedes the page axis)."""
    from kvcodec.integrations.lmcache import compat

    g = torch.Generator().manual_seed(8)
    v = (torch.randn(4, 3, 8, 32, generator=g) * torch.rand(4, 1, 1, 1, generator=g) * 30).to(out_dtype)
    kw = dict(head_axis=1, page_axis=0) if scope == "PER_PAGE_HEAD" else dict(head_axis=0)
    s = lm.compute_v_scales(v, lm.ScaleScope[scope], **kw)
    assert torch.equal(compat.compute_v_scales(v, getattr(lm.ScaleScope, scope).value, **kw), s)
    q_ref = lm.quantize_v_fp8(v, s, lm.ScaleScope[scope], **kw)
    q = compat.quantize_v_fp8(v, s, getattr(lm.ScaleScope, scope).value, **kw)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    dq_ref = lm.dequantize_v_fp8(q_ref, s, lm.ScaleScope[scope], out_dtype=out_dtype, **kw)
    dq = compat.dequantize_v_fp8(q, s, getattr(lm.ScaleScope, scope).value, out_dtype=out_dtype, **kw)
    assert torch.equal(dq, dq_ref)
