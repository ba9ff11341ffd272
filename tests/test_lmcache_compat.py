"""kvcodec.lmcache_compat: LMCache's kv_codec API, installed under its module names."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

import kvcodec.lmcache_compat as compat
from kvcodec import errors
from kvcodec.format import parse


@pytest.fixture
def lm():
    """Install the compat layer as lmcache.v1.kv_codec, and undo it afterwards."""
    saved = {k: v for k, v in sys.modules.items() if k == "lmcache" or k.startswith("lmcache.")}
    compat.install()
    import lmcache.v1.kv_codec as mod

    yield mod
    for k in [k for k in sys.modules if k == "lmcache" or k.startswith("lmcache.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_install_registers_modules(lm):
    from lmcache.v1.kv_codec.encoded_kv import _FIXED_HEADER_LEN, CODEC_MAGIC, deserialize_header
    from lmcache.v1.kv_codec.errors import CodecError, CorruptEncodedKVError

    assert lm is compat
    assert CODEC_MAGIC == b"LMCKV\x01\x00\x01" and _FIXED_HEADER_LEN == 76
    assert CorruptEncodedKVError is errors.CorruptEncodedKVError
    assert issubclass(CorruptEncodedKVError, CodecError)
    assert deserialize_header is compat.deserialize_header


def test_lmcache_style_code_runs_unchanged(lm):
    """A connector's calls, written against LMCache's API."""
    codec = lm.AsymK16V8Codec(scale_scope=lm.ScaleScope.PER_PAGE_HEAD)
    k = torch.randn(4, 16, 2, 32).half()
    v = torch.randn(4, 16, 2, 32).half()
    hashes = lm.CodecHashes(model_id="llama", kv_layout="NHD")
    enc = codec.encode(k, v, hashes=hashes, layer_id=3, chunk_id=1, page_axis=0)
    assert isinstance(enc, lm.EncodedKV)
    assert enc.scale_shape == (4, 2) and enc.total_bytes == len(codec.to_bytes(enc))
    blob = codec.to_bytes(enc)
    assert isinstance(blob, bytes)
    back = codec.from_bytes(blob, expected_hashes=lm.CodecHashes(model_id="llama"))
    k2, v2, s2 = codec.decode(back)
    assert torch.equal(k2.view(k.shape), k)  # LMCache callers reshape with .view
    assert v2.dtype == torch.float8_e4m3fn and s2.shape == (4, 2)
    _, v3, _ = codec.decode(back, out_v_dtype=torch.float16)  # LMCache crashes here; we don't
    assert v3.shape == (64, 2, 32)
    with pytest.raises(lm.CodecMismatchError, match="model_id"):
        codec.from_bytes(blob, expected_hashes=lm.CodecHashes(model_id="mistral"))


def test_defaults_and_e5m2(lm):
    codec = lm.AsymK16V8Codec()
    assert codec.scale_scope == lm.ScaleScope.PER_TENSOR and codec.scale_dtype == torch.float32
    with pytest.raises(lm.UnsupportedConfigError, match="e5m2"):
        lm.AsymK16V8Codec(fp8_dtype=torch.float8_e5m2)
    with pytest.raises(lm.UnsupportedConfigError, match="fp8_dtype must be"):
        lm.AsymK16V8Codec(fp8_dtype=torch.float16)


def test_signatures_match_lmcache():
    sig = inspect.signature
    assert list(sig(compat.AsymK16V8Codec.encode).parameters) == [
        "self", "k", "v", "hashes", "layer_id", "chunk_id", "chunk_size", "page_size",
        "kv_head_count", "head_dim", "head_axis", "page_axis", "precomputed_v_scales",
        "precomputed_v_quant",
    ]  # fmt: skip
    assert list(sig(compat.AsymK16V8Codec.decode).parameters) == [
        "self", "enc", "out_k_dtype", "out_v_dtype", "device",
    ]  # fmt: skip
    assert list(sig(compat.compute_v_scales).parameters) == ["v", "scope", "fp8_dtype", "head_axis", "page_axis"]
    assert list(sig(compat.dequantize_v_fp8).parameters) == [
        "q", "scales", "scope", "out_dtype", "head_axis", "page_axis",
    ]  # fmt: skip
    assert compat.CodecHashes._CHECK_ORDER[0] == "model_id" and len(compat.CodecHashes._CHECK_ORDER) == 6


def test_primitives_any_layout():
    v = torch.randn(3, 8, 4, 16).half()  # [pages, slots, heads, dim]
    s = compat.compute_v_scales(v, compat.ScaleScope.PER_PAGE_HEAD, page_axis=0)
    assert s.shape == (3, 4)
    assert torch.equal(s, v.float().abs().amax(dim=(1, 3)) / 448.0)
    q = compat.quantize_v_fp8(v, s, compat.ScaleScope.PER_PAGE_HEAD, page_axis=0)
    assert q.shape == v.shape and q.dtype == torch.float8_e4m3fn
    ref = (v.float() / s.view(3, 1, 4, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
    dq = compat.dequantize_v_fp8(q, s, compat.ScaleScope.PER_PAGE_HEAD, page_axis=0)
    assert torch.equal(dq, (q.float() * s.view(3, 1, 4, 1)).half())
    # head before page (LMCache's own transposed case)
    vt = v.permute(2, 0, 1, 3)
    st = compat.compute_v_scales(vt, compat.ScaleScope.PER_PAGE_HEAD, head_axis=0, page_axis=1)
    assert torch.equal(st, s)
    sl = compat.compute_v_scales(v, compat.ScaleScope.PER_LAYER_HEAD)
    assert torch.equal(sl, v.float().abs().amax(dim=(0, 1, 3)) / 448.0)
    with pytest.raises(errors.UnsupportedConfigError, match="requires page_axis"):
        compat.compute_v_scales(v, compat.ScaleScope.PER_PAGE_HEAD)
    with pytest.raises(errors.UnsupportedConfigError, match="EXTERNAL"):
        compat.compute_v_scales(v, compat.ScaleScope.EXTERNAL)


def test_header_functions():
    codec = compat.AsymK16V8Codec(scale_scope=compat.ScaleScope.PER_LAYER_HEAD)
    enc = codec.encode(torch.randn(8, 2, 16).half(), torch.randn(8, 2, 16).half())
    assert compat.encoded_kv_header_size(enc) == len(enc.header_bytes) == 221
    hdr = compat.serialize_header(enc)
    assert hdr == enc.header_bytes
    enc.payload = bytes(enc.payload)[:-1]
    with pytest.raises(errors.UnsupportedConfigError, match="does not match declared"):
        compat.serialize_header(enc)
    blob = codec.to_bytes(codec.encode(torch.randn(8, 2, 16).half(), torch.randn(8, 2, 16).half()))
    with pytest.raises(errors.CorruptEncodedKVError):
        compat.deserialize_header(blob[:-3])
    back = compat.deserialize_header(blob)
    assert isinstance(back.payload, memoryview) and back.kv_head_count == 2 and back.head_dim == 16
    assert parse(blob).header.chunk_size == 8


def test_caller_fields_win():
    codec = compat.AsymK16V8Codec()
    k = torch.randn(8, 2, 16).half()
    enc = codec.encode(k, k, chunk_size=256, page_size=16)
    assert (enc.chunk_size, enc.page_size, enc.kv_head_count, enc.head_dim) == (256, 16, 2, 16)
    parse(codec.to_bytes(enc))  # still a valid blob


def test_head_major_layout_keeps_lmcache_semantics():
    """[H, T, D] input: bytes in the caller's layout, so the caller's reshape restores K exactly."""
    codec = compat.AsymK16V8Codec(scale_scope=compat.ScaleScope.PER_LAYER_HEAD)
    k = torch.randn(4, 32, 8).half()  # [heads, tokens, dim]
    v = torch.randn(4, 32, 8).half()
    enc = codec.encode(k, v, head_axis=0)
    assert enc.kv_head_count == -1  # not token-major: fields only as given, like LMCache
    k2, v2, s2 = codec.decode(codec.from_bytes(codec.to_bytes(enc)))
    assert torch.equal(k2.reshape(k.shape), k)
    q_ref = compat.quantize_v_fp8(v, s2, compat.ScaleScope.PER_LAYER_HEAD, head_axis=0)
    assert torch.equal(v2.reshape(v.shape).view(torch.uint8), q_ref.view(torch.uint8))


def test_unset_layout_decodes_flat_like_lmcache():
    from kvcodec.format import Header, assemble

    h = Header(k_dtype=torch.float16, v_dtype=torch.float8_e4m3fn, scale_scope=compat.ScaleScope.PER_TENSOR)
    blob = bytes(assemble(h, bytes(64), bytes(32), torch.tensor([0.5]).numpy().tobytes()))
    codec = compat.AsymK16V8Codec()
    k, v, s = codec.decode(codec.from_bytes(blob), out_v_dtype=torch.float16)
    assert k.shape == (32,) and v.shape == (32,) and s.shape == ()


def test_to_bytes_follows_a_swapped_payload():
    codec = compat.AsymK16V8Codec()
    x = torch.randn(8, 2, 16).half()
    enc = codec.encode(x, x)
    fresh = bytes(len(enc.payload))
    enc.payload = fresh
    assert codec.to_bytes(enc) == enc.header_bytes + fresh


def test_inconsistent_caller_fields_are_a_config_error():
    codec = compat.AsymK16V8Codec()
    x = torch.randn(8, 2, 16).half()
    with pytest.raises(errors.UnsupportedConfigError, match="inconsistent blob"):
        codec.encode(x, x, chunk_size=4)
