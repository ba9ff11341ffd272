"""Triton quantize and fused kernels vs the torch reference (kvcodec.backends.reference), byte for byte.

Without a GPU these run in Triton's CPU interpreter (TRITON_INTERPRET=1 is
set before Triton is imported); with one they run on CUDA tensors. Sizes are
kept small: the interpreter pays ~10 ms per program.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, KERNEL_MARKS, reference_ops, require_kernels

require_kernels()

from kvcodec.kernels import configs, dequant_triton, fused_triton, operands, quant_triton, tiles  # noqa: E402

from kvcodec.errors import UnsupportedConfigError  # noqa: E402
from kvcodec.format import ScaleScope  # noqa: E402

Q = reference_ops()
pytestmark = KERNEL_MARKS

PT = ScaleScope.PER_TENSOR
LH = ScaleScope.PER_LAYER_HEAD
PH = ScaleScope.PER_PAGE_HEAD
E4 = torch.float8_e4m3fn
E5 = torch.float8_e5m2

SCOPES = [
    pytest.param(PT, None, id="per_tensor"),
    pytest.param(LH, None, id="per_layer_head"),
    pytest.param(PH, 4, id="per_page_head4"),
    pytest.param(PH, 5, id="per_page_head5_partial"),
]


def u8(x: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor (any dtype), on the CPU."""
    return x.detach().reshape(-1).contiguous().view(torch.uint8).cpu()


def assert_bytes_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    ua, ub = u8(a), u8(b)
    assert ua.shape == ub.shape
    if not torch.equal(ua, ub):
        bad = (ua != ub).nonzero()
        i = int(bad[0, 0])
        raise AssertionError(f"{bad.shape[0]} bytes differ; first at byte {i}: {int(ua[i])} vs {int(ub[i])}")


def rand_v(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    # Heavy tails so that some groups saturate differently from others.
    x[..., :1] *= 40
    return x.to(dtype).to(DEVICE)


def ref_amax(
    v: torch.Tensor, scope: ScaleScope, page_size: int | None, finite_only: bool = False
) -> torch.Tensor:
    return Q.reduce_groups(Q.token_head_amax(v.cpu(), finite_only=finite_only), scope, page_size)


def ref_payload(
    k: torch.Tensor, v: torch.Tensor, scope: ScaleScope, ps: int | None, fp8: torch.dtype = E4
) -> torch.Tensor:
    vc = v.cpu()
    s = Q.compute_scales(vc, scope, page_size=ps, fp8_dtype=fp8)
    q = Q.quantize(vc, s, scope, page_size=ps, fp8_dtype=fp8)
    return torch.cat([u8(k).reshape(-1), u8(q).reshape(-1), u8(s).reshape(-1)])


def new_payload(n: int, offset: int = 0) -> torch.Tensor:
    """An n-byte payload starting ``offset`` bytes into an allocation (offset 1 = misaligned)."""
    return torch.full((n + offset,), 0xAB, dtype=torch.uint8, device=DEVICE)[offset:]


# ----------------------------------------------------------------------------
# The FP8 cast, exhaustively
# ----------------------------------------------------------------------------


def _all_patterns(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def _cast_scales(dtype: torch.dtype, fp8: torch.dtype) -> list[float]:
    qmax = Q.fp8_max(fp8)
    big = float(torch.finfo(dtype).max)
    return [
        1.0,  # fp16/bf16 values land on every tie between FP8 grid points, and past ±max
        2.0**-8,  # pushes the small values into FP8 subnormals and past max
        2.0**8,
        3.0,  # division produces exact ties (3 * midpoint is representable)
        1.0 / 3.0,  # inexact quotients close to ties
        big / qmax,  # the scale of a group whose amax is the dtype's max
        448.0 / qmax * 0.999,
        2.0**-20,  # fp16 subnormals (2^-24..) land on the FP8 grid
        2.0**-126,  # bf16 subnormals (fp32 denormals) land on the FP8 grid
        2.0**-133,  # a denormal scale: exact IEEE division of denormals
    ]


@pytest.mark.parametrize("fp8", [E4, E5], ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cast_exhaustive(dtype: torch.dtype, fp8: torch.dtype) -> None:
    """Every 16-bit pattern (all finite values, ±Inf and NaNs) / several scales → the reference byte."""
    x = _all_patterns(dtype)
    xd = x.to(DEVICE)
    for s in _cast_scales(dtype, fp8):
        st = torch.tensor(s, dtype=torch.float32)
        ref = Q.quantize(x.view(-1, 1, 1), st, PT, fp8_dtype=fp8).view(-1)
        got = quant_triton.quantize_1d(xd, st, fp8_dtype=fp8)
        assert_bytes_equal(got, ref)


def test_cast_exhaustive_3d_path() -> None:
    """The same patterns through the tiled [T, H, D] quantize kernel (per-head scales)."""
    x = _all_patterns(torch.float16).view(256, 2, 128)
    s = torch.tensor([1.0, 3.0])
    ref = Q.quantize(x, s, LH)
    got = quant_triton.quantize(x.to(DEVICE), s.to(DEVICE), LH)
    assert_bytes_equal(got, ref)


def test_cast_fp32_edges() -> None:
    """fp32 inputs around the FP8 rounding boundaries, subnormals and fp32 denormals."""
    grid = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(E4).float()
    grid = grid[torch.isfinite(grid)]
    mids = (grid[:-1] + grid[1:]) / 2
    eps = torch.tensor([0.0, 1e-7, -1e-7])
    vals = torch.cat(
        [
            grid,
            mids,
            (mids[:, None] * (1 + eps)).reshape(-1),
            torch.tensor([1e-40, -1e-45, 464.0, 479.9, 480.0, 1e30]),
        ]
    )
    vals = torch.cat([vals, -vals])
    for fp8 in (E4, E5):
        ref = Q.quantize(vals.view(-1, 1, 1), torch.tensor(1.0), PT, fp8_dtype=fp8).view(-1)
        assert_bytes_equal(quant_triton.quantize_1d(vals.to(DEVICE), 1.0, fp8_dtype=fp8), ref)


# ----------------------------------------------------------------------------
# Scales, quantize, dequantize
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("scope,ps", SCOPES)
@pytest.mark.parametrize(
    "vdtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
def test_scales_quantize_dequantize(scope: ScaleScope, ps: int | None, vdtype: torch.dtype) -> None:
    v = rand_v((13, 3, 48), vdtype, seed=1)
    vc = v.cpu()
    assert torch.equal(quant_triton.group_amax(v, scope, page_size=ps).cpu(), ref_amax(v, scope, ps))
    s_ref = Q.compute_scales(vc, scope, page_size=ps)
    s = quant_triton.compute_scales(v, scope, page_size=ps)
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    assert_bytes_equal(s, s_ref)
    q_ref = Q.quantize(vc, s_ref, scope, page_size=ps)
    q = quant_triton.quantize(v, s, scope, page_size=ps)
    assert q.dtype == E4
    assert_bytes_equal(q, q_ref)
    for od in (torch.float16, torch.bfloat16, torch.float32):
        d_ref = Q.dequantize(q_ref, s_ref, scope, page_size=ps, out_dtype=od)
        d = dequant_triton.dequantize(q, s, scope, page_size=ps, out_dtype=od)
        assert d.dtype == od
        assert_bytes_equal(d, d_ref)


@pytest.mark.parametrize(
    "shape,scope,ps",
    [
        ((1, 1, 48), PT, None),
        ((1, 1, 96), PH, 1),
        ((5, 1, 256), PH, 1),
        ((3, 2, 96), LH, None),
        ((7, 1, 256), PH, 16),
        ((9, 4, 8), PH, 2),
    ],
)
def test_odd_shapes(shape: tuple[int, int, int], scope: ScaleScope, ps: int | None) -> None:
    v = rand_v(shape, torch.bfloat16, seed=2)
    k = rand_v(shape, torch.float16, seed=3)
    vc = v.cpu()
    s_ref = Q.compute_scales(vc, scope, page_size=ps)
    assert_bytes_equal(quant_triton.compute_scales(v, scope, page_size=ps), s_ref)
    assert_bytes_equal(
        quant_triton.quantize(v, s_ref.to(DEVICE), scope, page_size=ps),
        Q.quantize(vc, s_ref, scope, page_size=ps),
    )
    pay = new_payload(operands.payload_nbytes(k, v, scope, ps))
    fused_triton.encode_fused(k, v, scope, page_size=ps, payload=pay)
    assert_bytes_equal(pay, ref_payload(k, v, scope, ps))


def test_noncontiguous_inputs_and_outputs() -> None:
    t, h, d = 11, 3, 48
    kv = rand_v((2, t, h, d), torch.float16, seed=4)
    v = kv[1]  # offset view
    hv = rand_v((h, t, d), torch.bfloat16, seed=5).permute(1, 0, 2)  # head-major storage
    sv = rand_v((t, h, 2 * d), torch.float32, seed=6)[..., ::2]  # strided head_dim
    for x in (v, hv, sv):
        xc = x.cpu()
        for scope, ps in ((PT, None), (LH, None), (PH, 4)):
            s_ref = Q.compute_scales(xc, scope, page_size=ps)
            assert_bytes_equal(quant_triton.compute_scales(x, scope, page_size=ps), s_ref)
            q_ref = Q.quantize(xc, s_ref, scope, page_size=ps)
            out = torch.empty((h, t, d), dtype=E4, device=DEVICE).permute(1, 0, 2)
            q = quant_triton.quantize(x, s_ref.to(DEVICE), scope, page_size=ps, out=out)
            assert q is out
            assert_bytes_equal(out, q_ref)
            d_ref = Q.dequantize(q_ref, s_ref, scope, page_size=ps, out_dtype=torch.bfloat16)
            dout = torch.empty((t, 2 * h, d), dtype=torch.bfloat16, device=DEVICE)[:, ::2]
            dequant_triton.dequantize(out, s_ref.to(DEVICE), scope, page_size=ps, out=dout)
            assert_bytes_equal(dout, d_ref)


@pytest.mark.parametrize("scope,ps", SCOPES)
def test_e5m2(scope: ScaleScope, ps: int | None) -> None:
    v = rand_v((10, 2, 96), torch.float16, seed=7, scale=100.0)
    k = rand_v((10, 2, 96), torch.bfloat16, seed=8)
    vc = v.cpu()
    s_ref = Q.compute_scales(vc, scope, page_size=ps, fp8_dtype=E5)
    assert_bytes_equal(quant_triton.compute_scales(v, scope, page_size=ps, fp8_dtype=E5), s_ref)
    q_ref = Q.quantize(vc, s_ref, scope, page_size=ps, fp8_dtype=E5)
    q = quant_triton.quantize(v, s_ref.to(DEVICE), scope, page_size=ps, fp8_dtype=E5)
    assert q.dtype == E5
    assert_bytes_equal(q, q_ref)
    assert_bytes_equal(
        dequant_triton.dequantize(q, s_ref.to(DEVICE), scope, page_size=ps),
        Q.dequantize(q_ref, s_ref, scope, page_size=ps),
    )
    pay = new_payload(operands.payload_nbytes(k, v, scope, ps))
    fused_triton.encode_fused(k, v, scope, page_size=ps, fp8_dtype=E5, payload=pay)
    assert_bytes_equal(pay, ref_payload(k, v, scope, ps, E5))


def test_zero_groups_get_unit_scale() -> None:
    v = torch.zeros((6, 2, 48), dtype=torch.float16)
    v[3:, 1] = 2.0
    for scope, ps in ((PT, None), (LH, None), (PH, 3)):
        ref = Q.compute_scales(v, scope, page_size=ps)
        assert_bytes_equal(quant_triton.compute_scales(v.to(DEVICE), scope, page_size=ps), ref)
    assert quant_triton.compute_scales(v.to(DEVICE), PH, page_size=3)[0, 0].item() == 1.0


# ----------------------------------------------------------------------------
# Non-finite values
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_nonfinite(bad: float) -> None:
    v = rand_v((8, 2, 48), torch.float16, seed=9)
    v[5, 1, 7] = bad
    vc = v.cpu()
    am = quant_triton.group_amax(v, PH, page_size=4).cpu()
    ref = ref_amax(v, PH, 4)
    assert torch.equal(torch.isnan(am), torch.isnan(ref))
    assert torch.equal(am.nan_to_num(0.0), ref.nan_to_num(0.0))
    assert not torch.isfinite(am[1, 1]) and torch.isfinite(am[0]).all() and torch.isfinite(am[1, 0])
    for scope, ps in ((PT, None), (LH, None), (PH, 4)):
        with pytest.raises(UnsupportedConfigError, match="NaN or Inf"):
            quant_triton.compute_scales(v, scope, page_size=ps)
        s_ref = Q.compute_scales(vc, scope, page_size=ps, nonfinite="saturate")
        s = quant_triton.compute_scales(v, scope, page_size=ps, nonfinite="saturate")
        assert_bytes_equal(s, s_ref)
        assert_bytes_equal(
            quant_triton.quantize(v, s, scope, page_size=ps), Q.quantize(vc, s_ref, scope, page_size=ps)
        )
        k = rand_v((8, 2, 48), torch.float16, seed=10)
        pay = new_payload(operands.payload_nbytes(k, v, scope, ps))
        amax = fused_triton.encode_fused(k, v, scope, page_size=ps, payload=pay).cpu()
        assert not bool(torch.isfinite(amax).all())  # the caller refuses the blob from this


def test_compute_scales_takes_amax() -> None:
    v = rand_v((9, 2, 48), torch.float16, seed=11)
    am = quant_triton.group_amax(v, LH)
    assert_bytes_equal(quant_triton.compute_scales(v, LH, amax=am), Q.compute_scales(v.cpu(), LH))
    assert_bytes_equal(Q.amax_to_scale(am.cpu(), 448.0), Q.compute_scales(v.cpu(), LH))


def test_group_amax_finite_only() -> None:
    v = rand_v((8, 2, 48), torch.float32, seed=12)
    v[0, 0, 0] = float("nan")
    v[6, 1, 3] = float("inf")
    for scope, ps in ((PT, None), (LH, None), (PH, 4)):
        got = quant_triton.group_amax(v, scope, page_size=ps, finite_only=True).cpu()
        assert torch.equal(got, ref_amax(v, scope, ps, finite_only=True))


# ----------------------------------------------------------------------------
# Fused encode / decode
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["single", "two_stage"])
@pytest.mark.parametrize("scope,ps", SCOPES)
@pytest.mark.parametrize(
    "kdtype,vdtype,offset",
    [
        (torch.float16, torch.float16, 0),
        (torch.bfloat16, torch.bfloat16, 1),  # misaligned payload: byte-wise K path
        (torch.float16, torch.float32, 0),
    ],
    ids=["fp16", "bf16-misaligned", "k16-v32"],
)
def test_encode_fused_matches_reference(
    kdtype: torch.dtype, vdtype: torch.dtype, offset: int, scope: ScaleScope, ps: int | None, strategy: str
) -> None:
    k = rand_v((13, 2, 48), kdtype, seed=13)
    v = rand_v((13, 2, 48), vdtype, seed=14)
    pay = new_payload(operands.payload_nbytes(k, v, scope, ps), offset)
    amax = fused_triton.encode_fused(k, v, scope, page_size=ps, payload=pay, strategy=strategy)  # type: ignore[arg-type]
    assert_bytes_equal(pay, ref_payload(k, v, scope, ps))
    assert torch.equal(amax.cpu(), ref_amax(v, scope, ps))


@pytest.mark.parametrize("scope,ps", SCOPES)
def test_encode_two_stage_many_tiles(
    monkeypatch: pytest.MonkeyPatch, scope: ScaleScope, ps: int | None
) -> None:
    """Stage 1 split over several programs per group (atomic absmax)."""
    monkeypatch.setattr(quant_triton, "STAGE1_TOKENS", 3)
    k = rand_v((14, 2, 48), torch.float16, seed=15)
    v = rand_v((14, 2, 48), torch.float16, seed=16)
    pay = new_payload(operands.payload_nbytes(k, v, scope, ps))
    fused_triton.encode_fused(k, v, scope, page_size=ps, payload=pay, strategy="two_stage")
    assert_bytes_equal(pay, ref_payload(k, v, scope, ps))
    assert_bytes_equal(quant_triton.group_amax(v, scope, page_size=ps), ref_amax(v, scope, ps))


def test_encode_fused_noncontiguous() -> None:
    t, h, d = 9, 2, 96
    kv = rand_v((2, h, t, d), torch.float16, seed=17).permute(0, 2, 1, 3)
    k, v = kv[0], kv[1]
    for scope, ps in ((PT, None), (LH, None), (PH, 4)):
        pay = new_payload(operands.payload_nbytes(k, v, scope, ps))
        fused_triton.encode_fused(k, v, scope, page_size=ps, payload=pay)
        assert_bytes_equal(pay, ref_payload(k, v, scope, ps))


@pytest.mark.parametrize("scope,ps", SCOPES)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_fused(scope: ScaleScope, ps: int | None, out_dtype: torch.dtype) -> None:
    k = rand_v((11, 2, 48), out_dtype, seed=18)
    v = rand_v((11, 2, 48), out_dtype, seed=19)
    for offset in (0, 1):
        pay = new_payload(operands.payload_nbytes(k, v, scope, ps), offset)
        fused_triton.encode_fused(k, v, scope, page_size=ps, payload=pay)
        ko = torch.empty((2, 11, 48), dtype=out_dtype, device=DEVICE).permute(1, 0, 2)
        vo = torch.empty_like(v)
        fused_triton.decode_fused(pay, ko, vo, scope, page_size=ps)
        vc = v.cpu()
        s = Q.compute_scales(vc, scope, page_size=ps)
        ref = Q.dequantize(
            Q.quantize(vc, s, scope, page_size=ps), s, scope, page_size=ps, out_dtype=out_dtype
        )
        assert torch.equal(ko.cpu(), k.cpu())
        assert_bytes_equal(vo, ref)


@pytest.mark.parametrize("form", ["lists", "stacked"])
@pytest.mark.parametrize(
    "scope,ps", [(PT, None), (LH, None), (PH, 4)], ids=["per_tensor", "per_layer_head", "per_page_head"]
)
def test_layers_one_launch(form: str, scope: ScaleScope, ps: int | None) -> None:
    n_layers, t, h, d = 3, 7, 2, 48
    ks_st = rand_v((n_layers, t, h, d), torch.float16, seed=20)
    vs_st = rand_v((n_layers, t, h, d), torch.float16, seed=21)
    nbytes = operands.payload_nbytes(ks_st[0], vs_st[0], scope, ps)
    if form == "lists":
        # Separate allocations: addressed through a device offset table.
        ks = [ks_st[i].clone() for i in range(n_layers)]
        vs = [vs_st[i].clone() for i in range(n_layers)]
        pays = [new_payload(nbytes, offset=i) for i in range(n_layers)]
        kv_in: tuple[object, object] = (ks, vs)
        pay_in: object = pays
    else:
        pays_st = torch.zeros((n_layers, nbytes), dtype=torch.uint8, device=DEVICE)
        pays = [pays_st[i] for i in range(n_layers)]
        kv_in = (ks_st, vs_st)
        pay_in = pays_st
    amax = fused_triton.encode_fused_layers(*kv_in, scope, page_size=ps, payloads=pay_in)  # type: ignore[arg-type]
    assert amax.shape == (n_layers, *Q.scale_shape(scope, t, h, ps))
    for i in range(n_layers):
        assert_bytes_equal(pays[i], ref_payload(ks_st[i], vs_st[i], scope, ps))
        assert torch.equal(amax[i].cpu(), ref_amax(vs_st[i], scope, ps))
    ko = torch.empty_like(ks_st)
    vo = torch.empty((n_layers, t, h, d), dtype=torch.bfloat16, device=DEVICE)
    if form == "lists":
        fused_triton.decode_fused_layers(pays, list(ko), list(vo), scope, page_size=ps)
    else:
        fused_triton.decode_fused_layers(pay_in, ko, vo, scope, page_size=ps)  # type: ignore[arg-type]
    for i in range(n_layers):
        vc = vs_st[i].cpu()
        s = Q.compute_scales(vc, scope, page_size=ps)
        ref = Q.dequantize(
            Q.quantize(vc, s, scope, page_size=ps), s, scope, page_size=ps, out_dtype=torch.bfloat16
        )
        assert torch.equal(ko[i], ks_st[i])
        assert_bytes_equal(vo[i], ref)


def _as_planned_for_cuda(fn: object) -> object:
    """Run ``fn``'s launches as planned for an sm_80-class CUDA GPU (132 SMs), executed here.

    Under the interpreter this covers the branches CUDA takes (two-stage
    reductions over several stage-1 tiles, CUDA tile sizes and warps, aligned
    K, aligned offset tables) instead of the interpreter's own planning.
    """
    from kvcodec.kernels import launch

    with launch.recording(launch.Target(False, 132, (8, 0), "planned sm_80")) as launches:
        out = fn()  # type: ignore[operator]
    for ln in launches:
        launch.launch(ln.kernel, ln.grid, ln.kwargs)
    return out, launches


@pytest.mark.skipif(DEVICE == "cuda", reason="replays CUDA planning in the interpreter")
@pytest.mark.parametrize("form", ["lists", "stacked"])
@pytest.mark.parametrize(
    "scope,ps", [(PT, None), (LH, None), (PH, 16)], ids=["per_tensor", "per_layer_head", "per_page_head"]
)
def test_cuda_planning_replayed(form: str, scope: ScaleScope, ps: int | None) -> None:
    n_layers, t, h, d = 3, 40, 2, 64
    ks_st = rand_v((n_layers, t, h, d), torch.float16, seed=30)
    vs_st = rand_v((n_layers, t, h, d), torch.float16, seed=31)
    nbytes = operands.payload_nbytes(ks_st[0], vs_st[0], scope, ps)
    pays_st = operands.empty_payloads(n_layers, nbytes, DEVICE)
    if form == "lists":  # uneven 16-byte aligned allocations: an aligned offset table
        buf = torch.zeros(n_layers * (t * h * d + 64) * 2, dtype=torch.float16)
        ks = [buf[i * (t * h * d + 8 * (i + 1)) :][: t * h * d].view(t, h, d) for i in range(n_layers)]
        for i in range(n_layers):
            ks[i].copy_(ks_st[i])
        kv_in: tuple[object, object] = (ks, [vs_st[i].clone() for i in range(n_layers)])
    else:
        kv_in = (ks_st, vs_st)
    _, launches = _as_planned_for_cuda(
        lambda: fused_triton.encode_fused_layers(*kv_in, scope, page_size=ps, payloads=pays_st)
    )  # type: ignore[arg-type]
    kw = launches[0].kwargs
    assert kw["K_ALIGNED"] and kw["num_warps"] > 1
    if form == "lists":
        assert kw["K_TAB"] == 8
    if scope != PH:
        assert len(launches) == 2 and kw["TT"] == 16 < t  # two stages, several stage-1 tiles per group
    for i in range(n_layers):
        assert_bytes_equal(pays_st[i], ref_payload(ks_st[i], vs_st[i], scope, ps))
    ko, vo = torch.zeros_like(ks_st), torch.zeros_like(vs_st)
    _as_planned_for_cuda(lambda: fused_triton.decode_fused_layers(pays_st, ko, vo, scope, page_size=ps))
    for i in range(n_layers):
        s = Q.compute_scales(vs_st[i], scope, page_size=ps)
        ref = Q.dequantize(
            Q.quantize(vs_st[i], s, scope, page_size=ps), s, scope, page_size=ps, out_dtype=torch.float16
        )
        assert torch.equal(ko[i], ks_st[i])
        assert_bytes_equal(vo[i], ref)


def test_empty_chunk() -> None:
    k = torch.empty((0, 2, 48), dtype=torch.float16, device=DEVICE)
    pay = torch.empty(operands.payload_nbytes(k, k, PT), dtype=torch.uint8, device=DEVICE)
    assert pay.numel() == 4
    amax = fused_triton.encode_fused(k, k, PT, payload=pay)
    assert amax.shape == ()
    assert quant_triton.quantize(k, torch.tensor(1.0), PT).shape == (0, 2, 48)


# ----------------------------------------------------------------------------
# Validation and configuration
# ----------------------------------------------------------------------------


def test_validation_errors() -> None:
    v = rand_v((4, 2, 48), torch.float16)
    with pytest.raises(UnsupportedConfigError):
        quant_triton.compute_scales(v[0], PT)
    with pytest.raises(UnsupportedConfigError, match="page_size"):
        quant_triton.compute_scales(v, PH)
    with pytest.raises(UnsupportedConfigError, match="no computed scales"):
        quant_triton.group_amax(v, ScaleScope.EXTERNAL)
    with pytest.raises(UnsupportedConfigError, match="FP8"):
        quant_triton.quantize(v, torch.tensor(1.0), PT, fp8_dtype=torch.float16)
    with pytest.raises(UnsupportedConfigError, match="do not fit"):
        quant_triton.quantize(v, torch.ones(3), LH)
    with pytest.raises(UnsupportedConfigError, match="exactly"):
        fused_triton.encode_fused(v, v, PT, payload=new_payload(10))
    with pytest.raises(UnsupportedConfigError, match="1-D uint8"):
        fused_triton.encode_fused(
            v, v, PT, payload=torch.empty(operands.payload_nbytes(v, v, PT), dtype=torch.int8)
        )
    with pytest.raises(UnsupportedConfigError, match="strategy"):
        fused_triton.encode_fused(
            v, v, LH, payload=new_payload(operands.payload_nbytes(v, v, LH)), strategy="fast"
        )  # type: ignore[arg-type]
    with pytest.raises(UnsupportedConfigError, match="differ"):
        fused_triton.encode_fused(v, v[:3], PT, payload=new_payload(10))
    with pytest.raises(UnsupportedConfigError, match="not FP8"):
        dequant_triton.dequantize(v, torch.tensor(1.0), PT)
    with pytest.raises(UnsupportedConfigError, match="nonfinite"):
        quant_triton.compute_scales(v, PT, nonfinite="ignore")  # type: ignore[arg-type]


def test_autotune_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(configs, "AUTOTUNE", None)
    monkeypatch.setenv("KVCODEC_AUTOTUNE", "0")
    assert not configs.autotune_enabled()
    monkeypatch.setenv("KVCODEC_AUTOTUNE", "1")
    assert configs.autotune_enabled()
    monkeypatch.delenv("KVCODEC_AUTOTUNE")
    assert not configs.autotune_enabled()  # never by default (first-call latency in a server)
    monkeypatch.setattr(configs, "AUTOTUNE", True)
    assert configs.autotune_enabled()


@pytest.mark.parametrize("rows", [1, 5, 16, 256, 4096])
@pytest.mark.parametrize("bd", [16, 64, 128, 256])
def test_config_space_has_no_masked_or_spilling_tiles(rows: int, bd: int) -> None:
    C = configs
    candidates = tiles.tile_configs()
    for args in ({"T": rows}, {"GT": rows, "T": 4 * rows}, {"TT": rows, "GT": 8 * rows, "T": 8 * rows}):
        kept = tiles.prune_tiles(candidates, args, kernel="_encode_groups_kernel", BLOCK_D=bd)
        assert kept
        for c in kept:
            bt = c.kwargs["BLOCK_T"]
            assert bt <= C.pow2(rows), (args, bt)
            assert bt * bd <= C.MAX_PER_THREAD * 32 * c.num_warps
            assert bt * bd >= C.MIN_PER_THREAD * 32 * c.num_warps or C.TileConfig(
                bt, c.num_warps
            ) == C.heuristic(rows, bd)
    h = C.heuristic(rows, bd)
    assert h in C.config_space(rows, bd)
    assert h.block_t <= C.pow2(rows) and h.per_thread(bd) <= C.MAX_PER_THREAD


def test_kernels_package_does_not_import_triton() -> None:
    import subprocess
    import sys

    code = "import sys, kvcodec.kernels, kvcodec; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_subnormal_values() -> None:
    """bf16 subnormal V: fp32-denormal absmax and scales, divided exactly (no flush to zero)."""
    bits = torch.arange(4 * 2 * 64, dtype=torch.int32)
    bits = (bits % 127 + 1) | ((bits % 3 == 0).to(torch.int32) << 15)
    v = bits.to(torch.int16).view(torch.bfloat16).view(4, 2, 64)
    k = torch.zeros_like(v)
    for scope, ps in ((PT, None), (LH, None), (PH, 3)):
        s = Q.compute_scales(v, scope, page_size=ps)
        assert_bytes_equal(quant_triton.compute_scales(v.to(DEVICE), scope, page_size=ps), s)
        pay = new_payload(operands.payload_nbytes(k, v, scope, ps))
        fused_triton.encode_fused(k.to(DEVICE), v.to(DEVICE), scope, page_size=ps, payload=pay)
        assert_bytes_equal(pay, ref_payload(k, v, scope, ps))
        q = Q.quantize(v, s, scope, page_size=ps)
        assert_bytes_equal(
            dequant_triton.dequantize(
                q.to(DEVICE), s.to(DEVICE), scope, page_size=ps, out_dtype=torch.bfloat16
            ),
            Q.dequantize(q, s, scope, page_size=ps, out_dtype=torch.bfloat16),
        )
