"""The torch reference of paged-cache gather/scatter (kvcodec.paged) vs a per-token loop."""

from __future__ import annotations

import pytest
import torch

from kvcodec.errors import UnsupportedConfigError
from kvcodec.paged import LAYOUTS, blocks_needed, gather_chunk, kv_views, scatter_chunk

NB, BS, H, D = 10, 4, 2, 8


def make_cache(layout: str, dtype: torch.dtype = torch.float16, seed: int = 0, physical: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2):
        base = torch.randint(0, 256, (2 * NB * BS * H * D,), generator=g, dtype=torch.uint8)
        base = base[(base & 0x7F) != 0x7F]  # no NaN codes: keeps equality checks simple
        base = torch.cat([base, base])[: 2 * NB * BS * H * D]
        raw = base.view(dtype)
    else:
        raw = torch.randn(2 * NB * BS * H * D, generator=g).to(dtype)
    if layout == "flash_nhd":
        return raw.view(2, NB, BS, H, D)
    if layout == "flash_hnd":
        phys = raw.view(2, NB, H, BS, D)
        return phys if physical else phys.permute(0, 1, 3, 2, 4)
    return raw.view(NB, 2, BS, H, D)


def token_at(cache_kv: torch.Tensor, ids: list[int], t: int) -> torch.Tensor:
    return cache_kv[ids[t // BS], t % BS]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens", [1, 4, 9, 16])
def test_gather_matches_loop(layout: str, num_tokens: int) -> None:
    cache = make_cache(layout, seed=num_tokens)
    ids = torch.randperm(NB, generator=torch.Generator().manual_seed(1))[: blocks_needed(num_tokens, BS)].tolist()
    k, v = gather_chunk(cache, ids, layout=layout, num_tokens=num_tokens, block_size=BS)
    kc, vc = kv_views(cache, layout=layout, block_size=BS)
    assert k.shape == v.shape == (num_tokens, H, D) and k.is_contiguous()
    for t in range(num_tokens):
        assert torch.equal(k[t], token_at(kc, ids, t))
        assert torch.equal(v[t], token_at(vc, ids, t))
    k2, v2 = gather_chunk(cache, torch.tensor(ids, dtype=torch.int32), layout=layout, num_tokens=num_tokens, block_size=BS)
    assert torch.equal(k, k2) and torch.equal(v, v2)


def test_layout_views() -> None:
    nhd = make_cache("flash_nhd")
    kc, vc = kv_views(nhd, layout="flash_nhd", block_size=BS)
    assert kc.shape == (NB, BS, H, D) and torch.equal(vc, nhd[1])
    fi = make_cache("flashinfer")
    kc, vc = kv_views(fi, layout="flashinfer", block_size=BS)
    assert torch.equal(kc, fi[:, 0]) and torch.equal(vc, fi[:, 1])
    logical = make_cache("flash_hnd", seed=3)
    physical = make_cache("flash_hnd", seed=3, physical=True)
    assert physical.shape == (2, NB, H, BS, D)
    a = kv_views(logical, layout="flash_hnd", block_size=BS)
    b = kv_views(physical, layout="flash_hnd", block_size=BS)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[0].shape == (NB, BS, H, D)


def test_hnd_square_told_apart_by_strides() -> None:
    phys = torch.randn(2, NB, BS, BS, D)  # H == block_size: [2, NB, H, BS, D]
    logical = phys.permute(0, 1, 3, 2, 4)
    a = kv_views(logical, layout="flash_hnd", block_size=BS)
    b = kv_views(phys, layout="flash_hnd", block_size=BS)
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[0][1, 2, 3], phys[0, 1, 3, 2])  # block 1, slot 2, head 3


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens", [1, 6, 12])
def test_scatter_matches_loop(layout: str, num_tokens: int) -> None:
    cache = make_cache(layout, seed=5)
    before = cache.clone()
    ids = [7, 2, 9][: blocks_needed(num_tokens, BS)]
    k = torch.randn(num_tokens, H, D).half()
    v = torch.randn(num_tokens, H, D).half()
    scatter_chunk(cache, ids, k, v, layout=layout, block_size=BS)
    expect = before.clone()
    ek, ev = kv_views(expect, layout=layout, block_size=BS)
    for t in range(num_tokens):
        ek[ids[t // BS], t % BS] = k[t]
        ev[ids[t // BS], t % BS] = v[t]
    assert torch.equal(cache, expect)  # slots past T in the last block untouched
    k2, v2 = gather_chunk(cache, ids, layout=layout, num_tokens=num_tokens, block_size=BS)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_scatter_noncontiguous_source() -> None:
    cache = make_cache("flash_nhd")
    src = torch.randn(H, 6, D).half().permute(1, 0, 2)
    scatter_chunk(cache, [3, 1], src, src, layout="flash_nhd", block_size=BS)
    k, _ = gather_chunk(cache, [3, 1], layout="flash_nhd", num_tokens=6, block_size=BS)
    assert torch.equal(k, src)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_fp8_cache(dtype: torch.dtype) -> None:
    cache = make_cache("flash_nhd", dtype=dtype)
    k, v = gather_chunk(cache, [4, 0], layout="flash_nhd", num_tokens=7, block_size=BS)
    assert k.dtype == v.dtype == dtype
    kf, vf = gather_chunk(cache, [4, 0], layout="flash_nhd", num_tokens=7, block_size=BS, fp8_dtype=torch.float8_e4m3fn)
    assert vf.dtype == torch.float8_e4m3fn
    assert torch.equal(vf.view(torch.uint8), v.view(torch.uint8))
    # FP8 sources go into a uint8 cache unchanged.
    other = make_cache("flash_nhd", dtype=dtype, seed=9)
    scatter_chunk(other, [4, 0], kf, vf, layout="flash_nhd", block_size=BS)
    k2, _v2 = gather_chunk(other, [4, 0], layout="flash_nhd", num_tokens=7, block_size=BS)
    assert torch.equal(k2.view(torch.uint8), k.view(torch.uint8))


def test_errors() -> None:
    cache = make_cache("flash_nhd")
    with pytest.raises(UnsupportedConfigError, match="layout"):
        gather_chunk(cache, [0], layout="nhd", num_tokens=1, block_size=BS)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedConfigError, match="block_size"):
        gather_chunk(cache, [0], layout="flash_nhd", num_tokens=1, block_size=BS + 1)
    with pytest.raises(UnsupportedConfigError, match="need 3 block ids"):
        gather_chunk(cache, [0, 1], layout="flash_nhd", num_tokens=9, block_size=BS)
    with pytest.raises(UnsupportedConfigError, match="span"):
        gather_chunk(cache, [0, NB], layout="flash_nhd", num_tokens=8, block_size=BS)
    with pytest.raises(UnsupportedConfigError, match="span"):
        gather_chunk(cache, [-1], layout="flash_nhd", num_tokens=1, block_size=BS)
    with pytest.raises(UnsupportedConfigError, match="int32/int64"):
        gather_chunk(cache, torch.tensor([0.0]), layout="flash_nhd", num_tokens=1, block_size=BS)
    with pytest.raises(UnsupportedConfigError, match="5-D"):
        gather_chunk(cache[0], [0], layout="flash_nhd", num_tokens=1, block_size=BS)
    with pytest.raises(UnsupportedConfigError, match="flashinfer"):
        gather_chunk(cache, [0], layout="flashinfer", num_tokens=1, block_size=BS)
    with pytest.raises(UnsupportedConfigError, match="blocks"):
        gather_chunk(cache, [*list(range(NB)), 0], layout="flash_nhd", num_tokens=NB * BS + 1, block_size=BS)
    with pytest.raises(UnsupportedConfigError, match="backend"):
        gather_chunk(cache, [0], layout="flash_nhd", num_tokens=1, block_size=BS, backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(UnsupportedConfigError, match="dtype"):
        scatter_chunk(cache, [0], torch.zeros(1, H, D), torch.zeros(1, H, D), layout="flash_nhd", block_size=BS)
    with pytest.raises(UnsupportedConfigError, match="heads"):
        scatter_chunk(cache, [0], torch.zeros(1, H, D + 1).half(), torch.zeros(1, H, D + 1).half(),
                      layout="flash_nhd", block_size=BS)  # fmt: skip
    with pytest.raises(UnsupportedConfigError, match="uint8"):
        gather_chunk(cache, [0], layout="flash_nhd", num_tokens=1, block_size=BS, fp8_dtype=torch.float8_e4m3fn)


def test_zero_tokens() -> None:
    cache = make_cache("flashinfer")
    k, v = gather_chunk(cache, [], layout="flashinfer", num_tokens=0, block_size=BS)
    assert k.shape == (0, H, D)
    scatter_chunk(cache, [], k, v, layout="flashinfer", block_size=BS)


# --- connector entry points: paged cache <-> blob ----------------------------------


@pytest.mark.parametrize("layout", ["flash_nhd", "flash_hnd", "flashinfer"])
def test_encode_chunk_and_decode_into_roundtrip(layout):
    import kvcodec.paged as P
    from kvcodec import decode, encode

    g = torch.Generator().manual_seed(1)
    nb, bs, h, d, tokens = 12, 4, 2, 16, 14
    shape = (2, nb, bs, h, d) if layout != "flashinfer" else (nb, 2, bs, h, d)
    cache = torch.randn(*shape, generator=g).half()
    ids = [7, 2, 9, 4]
    blob = P.encode_chunk(cache, ids, layout=layout, num_tokens=tokens, block_size=bs,
                          scope="per_page_head", page_size=8, layer_id=3)
    k, v = P.gather_chunk(cache, ids, layout=layout, num_tokens=tokens, block_size=bs)
    assert blob == encode(k, v, scope="per_page_head", page_size=8, layer_id=3)
    target = torch.zeros_like(cache)
    P.decode_chunk_into(blob, target, [0, 5, 6, 1], layout=layout, block_size=bs)
    k2, v2 = P.gather_chunk(target, [0, 5, 6, 1], layout=layout, num_tokens=tokens, block_size=bs)
    assert torch.equal(k2, k)
    assert torch.equal(v2, decode(blob, out_v_dtype=torch.float16).v)


def test_encode_chunk_fp8_cache_passes_v_through():
    import kvcodec.paged as P
    from kvcodec import decode

    g = torch.Generator().manual_seed(2)
    cache = (torch.randn(2, 6, 4, 2, 8, generator=g) * 50).to(torch.float8_e4m3fn).view(torch.uint8)
    blob = P.encode_chunk(cache, [3, 1], layout="flash_nhd", num_tokens=8, block_size=4,
                          fp8_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.25)
    res = decode(blob)
    _, v8 = P.gather_chunk(cache, [3, 1], layout="flash_nhd", num_tokens=8, block_size=4,
                           fp8_dtype=torch.float8_e4m3fn)
    assert torch.equal(res.v.view(torch.uint8), v8.view(torch.uint8))
    assert res.scales.item() == 0.25 and res.k.dtype == torch.float16
    with pytest.raises(UnsupportedConfigError, match="k_scale and v_scale"):
        P.encode_chunk(cache, [3, 1], layout="flash_nhd", num_tokens=8, block_size=4,
                       fp8_dtype=torch.float8_e4m3fn)
    with pytest.raises(UnsupportedConfigError, match="FP8 cache"):
        P.decode_chunk_into(blob, cache, [3, 1], layout="flash_nhd", block_size=4)


def test_encode_chunk_defaults_page_size_to_block_size_and_scope_names():
    import kvcodec.paged as P
    from kvcodec.format import parse

    cache = torch.randn(2, 6, 4, 2, 8).half()
    blob = P.encode_chunk(cache, [1, 3], layout="flash_nhd", num_tokens=8, block_size=4)
    assert parse(blob).header.page_size == 4 and parse(blob).header.scale_shape == (2, 2)
    c8 = (torch.randn(2, 6, 4, 2, 8) * 9).to(torch.float8_e4m3fn)
    for name in ("PER_TENSOR", "tensor", "per_tensor"):
        P.encode_chunk(c8, [1, 3], layout="flash_nhd", num_tokens=8, block_size=4, k_scale=1.0, v_scale=0.5,
                       scope=name)  # fmt: skip


def test_block_id_validation_and_k_dtype_mismatch():
    import kvcodec.paged as P
    from kvcodec import encode

    cache = torch.randn(2, 6, 4, 2, 8).half()
    for bad, match in (([3.7, 1], "flat sequence of ints"), ([[1, 2]], "flat sequence"), ([2**70, 1], "ints"),
                       ([2, 2], "repeat")):  # fmt: skip
        with pytest.raises(UnsupportedConfigError, match=match):
            P.gather_chunk(cache, bad, layout="flash_nhd", num_tokens=8, block_size=4)
    with pytest.raises(UnsupportedConfigError, match="repeat"):
        P.scatter_chunk(cache, [2, 2], torch.zeros(8, 2, 8).half(), torch.zeros(8, 2, 8).half(),
                        layout="flash_nhd", block_size=4)  # fmt: skip
    blob = encode(torch.randn(8, 2, 8).bfloat16(), torch.randn(8, 2, 8).bfloat16(), scope="per_tensor")
    before = cache.clone()
    with pytest.raises(UnsupportedConfigError, match="K must load bit-exact"):
        P.decode_chunk_into(blob, cache, [1, 3], layout="flash_nhd", block_size=4)
    assert torch.equal(cache, before)
