"""Triton paged-cache kernels vs the torch reference (kvcodec.paged + kvcodec.backends.reference), byte for byte.

Interpreter on CPU (TRITON_INTERPRET=1 set before Triton is imported), CUDA when present.
"""

from __future__ import annotations

import os

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KVCODEC_AUTOTUNE", "0")

pytest.importorskip("triton")

from kvcodec.kernels import paged_triton as PT  # noqa: E402
from kvcodec.kernels import quant_triton as QT  # noqa: E402

from kvcodec import paged as P  # noqa: E402
from kvcodec.backends import reference as Q  # noqa: E402
from kvcodec.errors import UnsupportedConfigError  # noqa: E402
from kvcodec.format import ScaleScope  # noqa: E402

DEVICE = "cuda" if _CUDA else "cpu"
pytestmark = [pytest.mark.cuda if _CUDA else pytest.mark.interpreter]
if not _CUDA and not QT.INTERPRET:
    pytest.skip(
        "kvcodec.kernels was imported before TRITON_INTERPRET=1 was set and there is no GPU",
        allow_module_level=True,
    )

NB, BS, H, D = 9, 4, 2, 48
PTS = ScaleScope.PER_TENSOR
LH = ScaleScope.PER_LAYER_HEAD
PH = ScaleScope.PER_PAGE_HEAD


def u8(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).contiguous().view(torch.uint8).cpu()


def make_cache(layout: str, dtype: torch.dtype = torch.float16, seed: int = 0, nb: int = NB, bs: int = BS) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 2 * nb * bs * H * D
    if dtype.itemsize == 1:
        raw = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype)
    else:
        raw = (torch.randn(n, generator=g) * 4).to(dtype)
    if layout == "flash_nhd":
        c = raw.view(2, nb, bs, H, D)
    elif layout == "flash_hnd":
        c = raw.view(2, nb, H, bs, D).permute(0, 1, 3, 2, 4)
    else:
        c = raw.view(nb, 2, bs, H, D)
    return c.to(DEVICE)


def shuffled_ids(num_tokens: int, seed: int, bs: int = BS, nb: int = NB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(nb, generator=g)[: P.blocks_needed(num_tokens, bs)].to(DEVICE)


def ref_payload(k: torch.Tensor, v: torch.Tensor, scope: ScaleScope, ps: int | None) -> torch.Tensor:
    vc = v.cpu()
    s = Q.compute_scales(vc, scope, page_size=ps)
    q = Q.quantize(vc, s, scope, page_size=ps)
    return torch.cat([u8(k), u8(q), u8(s)])


@pytest.mark.parametrize("layout", P.LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.uint8, torch.float8_e4m3fn],
                         ids=["fp16", "bf16", "u8", "fp8"])  # fmt: skip
def test_gather_scatter_match_reference(layout: str, dtype: torch.dtype) -> None:
    for num_tokens, seed in ((1, 1), (10, 2), (NB * BS, 3)):
        cache = make_cache(layout, dtype, seed)
        ids = shuffled_ids(num_tokens, seed)
        k_ref, v_ref = P.gather_chunk(cache, ids, layout=layout, num_tokens=num_tokens, block_size=BS)
        k, v = PT.gather_chunk(cache, ids, layout=layout, num_tokens=num_tokens, block_size=BS)
        assert k.dtype == dtype and k.shape == (num_tokens, H, D)
        assert torch.equal(u8(k), u8(k_ref)) and torch.equal(u8(v), u8(v_ref))
        src = make_cache("flash_nhd", dtype, seed + 10)[0].reshape(-1, H, D)[:num_tokens]
        a, b = cache.clone(), cache.clone()
        P.scatter_chunk(a, ids, src, src.flip(0), layout=layout, block_size=BS)
        PT.scatter_chunk(b, ids, src, src.flip(0), layout=layout, block_size=BS)
        assert torch.equal(u8(a), u8(b))


def test_public_api_dispatch() -> None:
    cache = make_cache("flash_hnd", seed=4)
    ids = shuffled_ids(7, 4).tolist()
    k_ref, v_ref = P.gather_chunk(cache, ids, layout="flash_hnd", num_tokens=7, block_size=BS)
    k, v = P.gather_chunk(cache, ids, layout="flash_hnd", num_tokens=7, block_size=BS, backend="triton")
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    a, b = cache.clone(), cache.clone()
    P.scatter_chunk(a, ids, v_ref, k_ref, layout="flash_hnd", block_size=BS)
    P.scatter_chunk(b, ids, v_ref, k_ref, layout="flash_hnd", block_size=BS, backend="triton")
    assert torch.equal(a, b)


def test_gather_into_payload_views() -> None:
    """An FP8 cache's chunk copied raw straight into a (misaligned) payload."""
    cache = make_cache("flashinfer", torch.uint8, seed=5)
    t = 11
    ids = shuffled_ids(t, 5)
    n = t * H * D
    pay = torch.zeros(2 * n + 1, dtype=torch.uint8, device=DEVICE)[1:]
    PT.gather_chunk(cache, ids, layout="flashinfer", num_tokens=t, block_size=BS,
                    out_k=pay[:n].view(t, H, D), out_v=pay[n:].view(t, H, D))  # fmt: skip
    k_ref, v_ref = P.gather_chunk(cache, ids, layout="flashinfer", num_tokens=t, block_size=BS)
    assert torch.equal(pay.cpu(), torch.cat([u8(k_ref), u8(v_ref)]))
    # Different output strides for K and V: two launches, same result.
    ko = torch.empty((H, t, D), dtype=torch.float8_e4m3fn, device=DEVICE).permute(1, 0, 2)
    vo = torch.empty((t, H, D), dtype=torch.float8_e4m3fn, device=DEVICE)
    PT.gather_chunk(cache, ids, layout="flashinfer", num_tokens=t, block_size=BS, out_k=ko, out_v=vo)
    assert torch.equal(u8(ko), u8(k_ref)) and torch.equal(u8(vo), u8(v_ref))


@pytest.mark.parametrize("layout", P.LAYOUTS)
@pytest.mark.parametrize(
    "scope,ps",
    [(PTS, None), (LH, None), (PH, 3), (PH, 8), (PH, 2)],
    ids=["per_tensor", "per_layer_head", "page3_block4", "page8_block4", "page2_block4"],
)
def test_encode_paged_matches_reference(layout: str, scope: ScaleScope, ps: int | None) -> None:
    t = 13
    cache = make_cache(layout, torch.bfloat16, seed=6)
    ids = shuffled_ids(t, 6)
    k, v = P.gather_chunk(cache, ids, layout=layout, num_tokens=t, block_size=BS)
    want = ref_payload(k, v, scope, ps)
    pay = torch.zeros(want.numel() + 1, dtype=torch.uint8, device=DEVICE)[1:]
    amax = PT.encode_paged(cache, ids, scope, layout=layout, num_tokens=t, block_size=BS, page_size=ps, payload=pay)
    assert torch.equal(pay.cpu(), want)
    assert torch.equal(amax.cpu(), Q.reduce_groups(Q.token_head_amax(v.cpu()), scope, ps))
    # Decode straight into other blocks of a cache == decode + torch scatter.
    dst_ids = shuffled_ids(t, 60)
    a, b = cache.clone(), cache.clone()
    ko = torch.empty_like(k)
    vo = torch.empty_like(v)
    QT.decode_fused(pay, ko, vo, scope, page_size=ps)
    P.scatter_chunk(a, dst_ids, ko, vo, layout=layout, block_size=BS)
    PT.decode_paged(pay, b, dst_ids, scope, layout=layout, num_tokens=t, block_size=BS, page_size=ps)
    assert torch.equal(u8(a), u8(b))


@pytest.mark.parametrize("scope,ps", [(PTS, None), (LH, None), (PH, 8)], ids=["per_tensor", "per_layer_head", "page8"])
def test_encode_paged_two_stage_and_big_blocks(monkeypatch: pytest.MonkeyPatch, scope: ScaleScope, ps: int | None) -> None:
    """block_size 16 > page_size, several stage-1 programs per group."""
    monkeypatch.setattr(QT, "STAGE1_TOKENS", 5)
    t, bs, nb = 21, 16, 4
    cache = make_cache("flash_nhd", torch.float16, seed=7, nb=nb, bs=bs)
    ids = shuffled_ids(t, 7, bs=bs, nb=nb)
    k, v = P.gather_chunk(cache, ids, layout="flash_nhd", num_tokens=t, block_size=bs)
    want = ref_payload(k, v, scope, ps)
    for strategy in ("single", "two_stage"):
        pay = torch.zeros(want.numel(), dtype=torch.uint8, device=DEVICE)
        PT.encode_paged(cache, ids, scope, layout="flash_nhd", num_tokens=t, block_size=bs, page_size=ps,
                        payload=pay, strategy=strategy)  # fmt: skip
        assert torch.equal(pay.cpu(), want), strategy


@pytest.mark.parametrize("stacked", [False, True], ids=["separate", "stacked"])
def test_paged_layers_one_launch(stacked: bool) -> None:
    n_layers, t = 3, 10
    if stacked:
        big = make_cache("flash_nhd", seed=8).new_empty((n_layers, 2, NB, BS, H, D))
        for i in range(n_layers):
            big[i] = make_cache("flash_nhd", seed=80 + i)
        caches = [big[i] for i in range(n_layers)]
    else:
        caches = [make_cache("flash_nhd", seed=80 + i) for i in range(n_layers)]
    ids = shuffled_ids(t, 8)
    want = []
    for c in caches:
        k, v = P.gather_chunk(c, ids, layout="flash_nhd", num_tokens=t, block_size=BS)
        want.append(ref_payload(k, v, PH, 4))
    pays = torch.zeros((n_layers, want[0].numel()), dtype=torch.uint8, device=DEVICE)
    amax = PT.encode_paged_layers(caches, ids, PH, layout="flash_nhd", num_tokens=t, block_size=BS, page_size=4,
                                  payloads=pays)  # fmt: skip
    assert amax.shape == (n_layers, 3, H)
    for i in range(n_layers):
        assert torch.equal(pays[i].cpu(), want[i])
    outs = [c.clone() for c in caches]
    refs = [c.clone() for c in caches]
    dst = shuffled_ids(t, 9)
    PT.decode_paged_layers(list(pays), outs, dst, PH, layout="flash_nhd", num_tokens=t, block_size=BS, page_size=4)
    for i in range(n_layers):
        ko = torch.empty((t, H, D), dtype=torch.float16, device=DEVICE)
        vo = torch.empty_like(ko)
        QT.decode_fused(pays[i], ko, vo, PH, page_size=4)
        P.scatter_chunk(refs[i], dst, ko, vo, layout="flash_nhd", block_size=BS)
        assert torch.equal(outs[i], refs[i])


def test_paged_errors() -> None:
    fp8 = make_cache("flash_nhd", torch.uint8)
    pay = torch.zeros(100, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(UnsupportedConfigError, match="FP8 cache"):
        PT.encode_paged(fp8, [0], PTS, layout="flash_nhd", num_tokens=1, block_size=BS, payload=pay)
    cache = make_cache("flash_nhd")
    with pytest.raises(UnsupportedConfigError, match="span"):
        PT.gather_chunk(cache, [NB], layout="flash_nhd", num_tokens=1, block_size=BS)
    with pytest.raises(UnsupportedConfigError, match="span"):
        PT.encode_paged(cache, torch.tensor([NB], device=DEVICE), PTS, layout="flash_nhd", num_tokens=1,
                        block_size=BS, payload=pay)  # fmt: skip
    with pytest.raises(UnsupportedConfigError, match="exactly"):
        PT.encode_paged(cache, [0], PTS, layout="flash_nhd", num_tokens=1, block_size=BS, payload=pay)
    with pytest.raises(UnsupportedConfigError, match="both"):
        PT.gather_chunk(cache, [0], layout="flash_nhd", num_tokens=1, block_size=BS, out_k=torch.empty(1, H, D))
    good = torch.zeros(QT.payload_nbytes(cache[0, 0, :1], cache[0, 0, :1], PTS), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(UnsupportedConfigError, match="payloads"):
        PT.encode_paged_layers([cache, cache], [0], PTS, layout="flash_nhd", num_tokens=1, block_size=BS,
                               payloads=[good])  # fmt: skip


@pytest.mark.parametrize("layout", ["flash_nhd", "flashinfer"])
def test_decode_chunk_into_with_triton_equals_torch(layout: str) -> None:
    """decode_chunk_into(backend="triton") from a blob whose K sits at the header's odd offset."""
    shape = (2, NB, BS, H, D) if layout == "flash_nhd" else (NB, 2, BS, H, D)
    cache = torch.randn(shape, device=DEVICE).half()
    blob = P.encode_chunk(cache, [3, 1, 7], layout=layout, num_tokens=10, block_size=BS, scope="per_page_head")
    want = torch.zeros_like(cache)
    got = torch.zeros_like(cache)
    P.decode_chunk_into(blob, want, [0, 2, 5], layout=layout, block_size=BS, backend="torch")
    P.decode_chunk_into(bytes(blob), got, [0, 2, 5], layout=layout, block_size=BS, backend="triton")
    assert want.abs().sum() > 0 and torch.equal(got, want)
