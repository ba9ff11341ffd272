"""C rows into a paged cache view: scatter_rows, scatter_dequantize, scatter_blob_rows.

Each must write what the reference dequantize plus a plain indexed copy writes, only into the runs'
slots and columns, decline (writing nothing) what C does not take, and raise on runs outside the
view or the rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec import UnsupportedConfigError
from kvcodec.backends import Declined, Groups, Served, reference
from kvcodec.backends.cpu import AVAILABLE, BACKEND, BlobRows, scatter_blob_rows, scatter_dequantize
from kvcodec.numerics import ScaleScope
from tests.backends.conftest import cpu_level

scatter_rows = BACKEND.scatter_rows

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="kvcodec._cpu is not built")

T, H, D, N, S = 24, 3, 16, 10, 8
RUNS = np.array([[7, 0, 0, 8], [2, 3, 8, 5], [5, 0, 13, 8], [0, 6, 21, 2], [9, 0, 23, 1]], dtype=np.int64)
"""(block, slot, token, count): 24 tokens over five blocks, some starting mid-block."""


def _cache(dtype=torch.bfloat16, seed=0, c=2 * D) -> torch.Tensor:
    """A [N, H, S, C] view whose memory is ordered [S, N, H, C] (strided, not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, N, H, c, generator=g).to(dtype).permute(1, 2, 0, 3)


def _expect(cache: torch.Tensor, rows: torch.Tensor, col: int) -> torch.Tensor:
    out = cache.clone()
    for b, s, t, n in RUNS.tolist():
        out[b, :, s : s + n, col : col + rows.shape[2]] = rows[t : t + n].transpose(0, 1)
    return out


def _codes(seed=1) -> tuple[torch.Tensor, torch.Tensor, Groups]:
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randint(0, 256, (T, H, D), generator=g, dtype=torch.uint8) & 0x7E).view(
        torch.float8_e4m3fn
    )
    scales = torch.rand(3, H, generator=g) + 0.1
    return codes, scales, Groups(ScaleScope.PER_PAGE_HEAD, 8, torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scatter_rows_is_an_indexed_copy(dtype):
    cache = _cache(dtype)
    rows = torch.randn(T, H, D).to(dtype)
    want = _expect(cache, rows, D)
    assert scatter_rows(rows, cache, D, RUNS) == Served()
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scatter_dequantize_is_the_reference_then_a_copy(dtype):
    codes, scales, groups = _codes()
    v = torch.empty(T, H, D, dtype=dtype)
    reference.BACKEND.dequantize(codes, scales, groups, out=v)
    cache = _cache(dtype)
    want = _expect(cache, v, D)
    assert scatter_dequantize(codes, scales, groups, cache, D, RUNS) == Served()
    assert torch.equal(cache, want)


def test_blob_rows_write_k_and_v_in_one_pass_from_unaligned_bytes():
    codes, scales, groups = _codes(2)
    k = torch.randn(T, H, D).to(torch.bfloat16)
    raw = bytearray(1 + k.numel() * 2)  # K at an odd address
    kb = np.frombuffer(raw, np.uint8, k.numel() * 2, 1).reshape(T, H, 2 * D)
    kb[...] = k.view(torch.uint8).numpy().reshape(T, H, 2 * D)
    v = torch.empty(T, H, D, dtype=torch.bfloat16)
    reference.BACKEND.dequantize(codes, scales, groups, out=v)
    cache = _cache()
    want = _expect(_expect(cache, k, 0), v, D)
    rows = BlobRows(kb, codes.view(torch.uint8).numpy(), scales.numpy().copy(), groups)
    assert scatter_blob_rows(rows, cache, D, RUNS) == Served()
    assert torch.equal(cache, want)


def test_nan_codes_decline_with_nothing_written():
    codes, scales, groups = _codes(3)
    codes.view(torch.uint8)[20, 1, 3] = 0x7F
    cache = _cache()
    before = cache.clone()
    with pytest.raises(Declined, match="NaN"):
        scatter_dequantize(codes, scales, groups, cache, D, RUNS)
    k = np.zeros((T, H, 2 * D), np.uint8)
    rows = BlobRows(k, codes.view(torch.uint8).numpy(), scales.numpy().copy(), groups)
    with pytest.raises(Declined, match="NaN"):
        scatter_blob_rows(rows, cache, D, RUNS)
    assert torch.equal(cache, before)


def test_layouts_c_does_not_take_decline():
    codes, scales, groups = _codes(4)
    cache = _cache()
    before = cache.clone()
    # K's columns overlapping V's.
    rows = BlobRows(
        np.zeros((T, H, 2 * D), np.uint8), codes.view(torch.uint8).numpy(), scales.numpy().copy(), groups
    )
    with pytest.raises(Declined, match="overlap"):
        scatter_blob_rows(rows, cache, D // 2, RUNS)
    # A cache whose width is not contiguous.
    rows16 = torch.randn(T, H, D).to(torch.bfloat16)
    with pytest.raises(Declined, match="contiguous"):
        scatter_rows(rows16, cache[..., ::2], 0, RUNS)
    # Rows that live inside the cache they are written to.
    base = cache.permute(2, 0, 1, 3)  # the [S, N, H, C] memory
    inside = base.reshape(-1)[: T * H * D].view(T, H, D)
    with pytest.raises(Declined, match="overlaps"):
        scatter_rows(inside, cache, D, RUNS)
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    "bad",
    [
        [[N, 0, 0, 1]],  # block past the view
        [[0, 7, 0, 2]],  # slots past the block
        [[0, 0, T - 1, 2]],  # tokens past the rows
        [[-1, 0, 0, 1]],
        [[0, 0, 0, -1]],
    ],
)
def test_runs_outside_raise_before_writing(bad):
    cache = _cache()
    before = cache.clone()
    runs = np.array([[1, 0, 0, 8], *bad], dtype=np.int64)
    with pytest.raises(UnsupportedConfigError, match="run"):
        scatter_rows(torch.randn(T, H, D).to(torch.bfloat16), cache, D, runs)
    codes, scales, groups = _codes(5)
    with pytest.raises(UnsupportedConfigError, match="run"):
        scatter_dequantize(codes, scales, groups, cache, D, runs)
    assert torch.equal(cache, before)


def test_bad_arguments_raise():
    cache = _cache()
    rows = torch.randn(T, H, D).to(torch.bfloat16)
    with pytest.raises(UnsupportedConfigError, match="int64"):
        scatter_rows(rows, cache, 0, RUNS.astype(np.int32))
    with pytest.raises(UnsupportedConfigError, match="columns"):
        scatter_rows(rows, cache, D + 1, RUNS)
    with pytest.raises(UnsupportedConfigError, match="heads"):
        scatter_rows(torch.randn(T, H + 1, D).to(torch.bfloat16), cache, 0, RUNS)
    with pytest.raises(Declined):  # another dtype
        scatter_rows(rows.float(), cache, 0, RUNS)


@pytest.fixture(params=[0, 1, 2], ids=["portable", "avx2", "avx512"])
def level(request: pytest.FixtureRequest):
    """Each SIMD level of the C rows (where the CPU has it; else the best below runs again): the
    backend bound to that ``kvcodec._cpu.Level``."""
    with cpu_level(simd=request.param) as bound:
        yield bound


@pytest.mark.parametrize("d", [16, 32, 48, 64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["vllm", "strided"])
def test_blob_rows_at_every_head_dim_and_level(level, d, dtype, contiguous):
    """K rows of whole 64-byte lines go by inline vector moves, others by memcpy; V's rows by the
    level's loops and tails: every head_dim writes what the reference dequantize and a copy write."""
    g = torch.Generator().manual_seed(d)
    codes = (torch.randint(0, 256, (T, H, d), generator=g, dtype=torch.uint8) & 0x7E).view(
        torch.float8_e4m3fn
    )
    scales = torch.rand(3, H, generator=g) + 0.1
    groups = Groups(ScaleScope.PER_PAGE_HEAD, 8, torch.float8_e4m3fn)
    k = torch.randn(T, H, d, generator=g).to(dtype)
    v = torch.empty(T, H, d, dtype=dtype)
    reference.BACKEND.dequantize(codes, scales, groups, out=v)
    cache = torch.randn(N, H, S, 2 * d, generator=g).to(dtype) if contiguous else _cache(dtype, d, 2 * d)
    want = _expect(_expect(cache, k, 0), v, d)
    kb = k.view(torch.uint8).numpy().reshape(T, H, 2 * d)
    rows = BlobRows(kb, codes.view(torch.uint8).numpy(), scales.numpy().copy(), groups)
    assert scatter_blob_rows(rows, cache, d, RUNS) == Served()
    assert torch.equal(cache.view(torch.int16), want.view(torch.int16))


def test_many_writes_each_layer_as_its_own_call_would():
    """A chunk's layers in one scatter_blob_rows_many: each result and cache is what its own
    scatter_blob_rows gives, a declined layer (NaN codes) included, with nothing written there."""
    scatter_blob_rows_many = BACKEND.scatter_blob_rows_many

    layers = []
    for seed in range(3):
        codes, scales, groups = _codes(seed + 5)
        if seed == 1:
            codes.view(torch.uint8)[4, 1, 3] = 0x7F  # a NaN code: C declines this layer
        k = torch.randn(T, H, D, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        kb = k.view(torch.uint8).numpy().reshape(T, H, 2 * D)
        layers.append(BlobRows(kb, codes.view(torch.uint8).numpy(), scales.numpy().copy(), groups))
    one = [_cache(seed=s) for s in range(3)]
    many = [c.clone() for c in one]
    want = []
    for r, c in zip(layers, one):
        try:
            want.append(scatter_blob_rows(r, c, D, RUNS))
        except Declined as e:
            want.append(str(e))
    got = scatter_blob_rows_many([(r, c, None) for r, c in zip(layers, many)], D, RUNS)
    assert [str(g) if isinstance(g, Declined) else g for g in got] == want
    assert isinstance(got[1], Declined) and got[0] == Served() and got[2] == Served()
    assert all(torch.equal(a, b) for a, b in zip(one, many))
    assert torch.equal(many[1], _cache(seed=1))  # the declined layer: untouched
