"""The ``cpu`` backend (kvcodec._cpu, C): bit-exact with the reference, declines cleanly, only CodecError escapes.

The conformance suite (tests/backends/test_conformance.py) runs every backend against the
naive oracle; this file covers what is particular to the C loops: every SIMD
level, exhaustive inputs, each declined condition, the C side's own argument
checks, and that a call releases the GIL and starts no threads.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcodec import CodecError, UnsupportedConfigError
from kvcodec.backends import cpu, reference
from kvcodec.backends.base import Declined, Groups
from kvcodec.errors import Reason
from kvcodec.numerics import ScaleScope
from tests.backends.conftest import cpu_level

pytestmark = pytest.mark.skipif(not cpu.AVAILABLE, reason=f"kvcodec._cpu is not built: {cpu.REASON}")

S = ScaleScope
C, R = cpu.BACKEND, reference.BACKEND
E4M3 = torch.float8_e4m3fn
FLOATS = [torch.float16, torch.bfloat16, torch.float32]
GROUPS = [
    Groups(S.PER_TENSOR),
    Groups(S.PER_LAYER_HEAD),
    Groups(S.PER_PAGE_HEAD, 16),
    Groups(S.PER_PAGE_HEAD, 3),
]
GID = ["tensor", "layer_head", "page16", "page3"]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(params=[0, 1, 2], ids=["portable", "avx2", "avx512vl"])
def level(request: pytest.FixtureRequest) -> Any:
    """Run the test on the portable C rows, then on the AVX2 + F16C rows, then on those compiled for
    AVX-512VL (each where the CPU has it; else the best level below it runs again): the backend bound
    to that ``kvcodec._cpu.Level``."""
    with cpu_level(simd=request.param) as bound:
        yield bound


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so NaNs compare by payload and -0 differs from +0."""
    return x.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _every(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit float dtype, as one odd-length row (tails of every loop)."""
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    return x[torch.isfinite(x)].view(1, 1, -1)


def _q(shape: Any) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=E4M3)


def _encode(
    be: Any, v: torch.Tensor, g: Groups, sdt: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    out = _q(v.shape)
    return be.encode_v(v, g, scale_dtype=sdt, nonfinite="error", out=out), out


# --- the cast, the division, the widening: exhaustive ---------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 0.75, 3.0e-3, 1.0 / 448, 2.0**-20, 5.0e3, 1.0e-40, 3.0e35])
def test_quantize_every_16bit_value(level: Any, dtype: torch.dtype, scale: float) -> None:
    v = _every(dtype)
    s = torch.tensor(scale)
    assert _same(
        C.quantize(v, s, Groups(S.PER_TENSOR), out=_q(v.shape)),
        R.quantize(v, s, Groups(S.PER_TENSOR), out=_q(v.shape)),
    )


def test_quantize_next_to_every_rounding_boundary(level: Any) -> None:
    """fp32 V within a few steps of midpoint x scale for every e4m3 midpoint (ties included) at 32
    scales: where multiplying by 1 / scale and dividing land on either side of a midpoint, the codes
    must still be the division's."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()  # every finite e4m3 magnitude
    mids = ((grid[1:] + grid[:-1]) / 2).double()
    g = torch.Generator().manual_seed(5)
    for sv in torch.exp2(torch.rand(32, generator=g, dtype=torch.float64) * 40 - 20).tolist():
        base = (mids * sv).float().view(torch.int32)
        steps = torch.arange(-7, 8, dtype=torch.int32)
        x = (base[:, None] + steps[None, :]).view(torch.float32).flatten()
        v = torch.cat([x, -x]).view(1, 1, -1)
        s = torch.tensor(sv, dtype=torch.float32)
        assert _same(
            C.quantize(v, s, Groups(S.PER_TENSOR), out=_q(v.shape)),
            R.quantize(v, s, Groups(S.PER_TENSOR), out=_q(v.shape)),
        ), sv


def test_quantize_random_fp32_bits(level: Any) -> None:
    g = torch.Generator().manual_seed(7)
    x = (
        torch.randint(-(2**31), 2**31 - 1, (1 << 16,), dtype=torch.int64, generator=g)
        .to(torch.int32)
        .view(torch.float32)
    )
    v = x[torch.isfinite(x)].view(1, 1, -1)
    for sv in (1.0, 1.0e-30, 3.0e30, 0.125, 7.0e-3):
        s = torch.tensor(sv)
        assert _same(
            C.quantize(v, s, Groups(S.PER_TENSOR), out=_q(v.shape)),
            R.quantize(v, s, Groups(S.PER_TENSOR), out=_q(v.shape)),
        )


@pytest.mark.parametrize("out_dtype", FLOATS)
def test_dequantize_every_code(level: Any, out_dtype: torch.dtype) -> None:
    """All 254 non-NaN codes x scales that round, overflow to Inf, land subnormal, or are zero/negative."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F] * 3, dtype=torch.uint8)
    q = codes.view(E4M3).view(1, 1, -1)
    for sv in (1.0, 0.3, 1.0e-3, 7.0e-8, 1.0e-40, 3.0e35, 2.0e5, 0.0, -2.5, 65504.0 / 448, 2.0**121):
        s = torch.tensor(sv)
        a = C.dequantize(q, s, Groups(S.PER_TENSOR), out=torch.empty(q.shape, dtype=out_dtype))
        b = R.dequantize(q, s, Groups(S.PER_TENSOR), out=torch.empty(q.shape, dtype=out_dtype))
        assert _same(a, b), sv


@pytest.mark.parametrize("out_dtype", FLOATS, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("g", GROUPS, ids=GID)
@pytest.mark.parametrize("heads,dim", [(1, 8), (3, 72), (16, 64), (17, 32), (40, 128)])
def test_dequantize_tables_at_every_scope_and_head_count(
    level: Any, out_dtype: torch.dtype, g: Groups, heads: int, dim: int
) -> None:
    """The AVX-512 rows look each head's results up in a table rebuilt when its scale changes (a
    table per head up to 16 heads, computed rows beyond): every scope, head count and row length
    (tails), with scales of both signs, zero and too small for the table, is the reference's."""
    gen = torch.Generator().manual_seed(heads * dim)
    tokens = 37
    codes = torch.randint(0, 256, (tokens, heads, dim), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    q = codes.view(E4M3)
    if g.scope == S.PER_PAGE_HEAD:
        shape: tuple[int, ...] = (-(-tokens // g.page_size), heads)
    else:
        shape = () if g.scope == S.PER_TENSOR else (heads,)
    s = (torch.rand(shape, generator=gen) * 4 - 1).float()
    if s.numel() > 1:
        s.view(-1)[::5] = 0.0
        s.view(-1)[1::7] = 1.0e-38  # below 2^-119: the table's 2^-7 product would not be exact
    a = C.dequantize(q, s, g, out=torch.empty(q.shape, dtype=out_dtype))
    b = R.dequantize(q, s, g, out=torch.empty(q.shape, dtype=out_dtype))
    assert _same(a, b)


@pytest.mark.parametrize("sdt", FLOATS, ids=["s16", "sbf16", "s32"])
@pytest.mark.parametrize("g", GROUPS, ids=GID)
def test_encode_v_every_16bit_value(level: Any, encode_pass: int, g: Groups, sdt: torch.dtype) -> None:
    """Every finite fp16 and bf16 value in groups of varied absmax, each scope and stored scale dtype."""
    for dtype in (torch.float16, torch.bfloat16):
        x = _every(dtype).flatten()
        x = x[x.abs() < 60000]  # scales of fp16 V must fit fp16 (a refusal is tested below)
        x = x[: (x.numel() // 96) * 96].view(-1, 3, 32)[
            torch.randperm(x.numel() // 96, generator=torch.Generator().manual_seed(1))
        ]
        if sdt != torch.float32:  # a 100.0 in every row: no scale underflows fp16 (a refusal tested below)
            x = torch.cat([x, torch.full((x.shape[0], 3, 1), 100.0, dtype=dtype)], dim=2)
        sa, qa = _encode(C, x, g, sdt)
        sb, qb = _encode(R, x, g, sdt)
        assert _same(sa, sb) and _same(qa, qb)


# --- whole tensors: scopes, dtypes, odd shapes and strides ------------------------------------------

SHAPES = [(1, 1, 1), (1, 1, 8), (17, 3, 33), (5, 1, 256), (40, 2, 1), (64, 8, 128), (3, 2, 7)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("g", GROUPS, ids=GID)
@pytest.mark.parametrize("dtype", FLOATS)
def test_encode_quantize_dequantize_equal_reference(
    level: Any, encode_pass: int, shape: tuple[int, int, int], g: Groups, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(sum(shape) * 7 + len(GID))
    v = (torch.randn(shape, generator=gen) * 4).to(dtype)
    v[0, 0, 0] = 0.0
    if shape[0] > 4:
        v[2:4] = 0.0  # whole zero groups: scale 1.0
    (sa, qa), (sb, qb) = _encode(C, v, g), _encode(R, v, g)
    assert _same(sa, sb) and _same(qa, qb)
    assert _same(C.quantize(v, sa * 1.5, g, out=_q(shape)), R.quantize(v, sa * 1.5, g, out=_q(shape)))
    odd_scales = (sa.half(), sa.bfloat16(), sa.double(), sa.unsqueeze(-1).expand(*sa.shape, 2)[..., 1])
    for s in (*odd_scales, torch._neg_view(-sa), torch.nn.Parameter(sa.clone())):
        assert _same(C.quantize(v, s, g, out=_q(shape)), R.quantize(v, s, g, out=_q(shape)))
    for od in FLOATS:
        a = C.dequantize(qa, sa, g, out=torch.empty(shape, dtype=od))
        assert _same(a, R.dequantize(qb, sb, g, out=torch.empty(shape, dtype=od)))


def test_strided_inputs_and_outputs(level: Any, encode_pass: int) -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(2, 30, 4, 72, generator=gen).half()
    v = base[1, :, 1:3, :64]  # token and head strides of a bigger tensor, head_dim contiguous
    g = Groups(S.PER_PAGE_HEAD, 4)
    out = torch.empty(30, 2, 100, dtype=E4M3)[:, :, :64]
    s = C.encode_v(v, g, scale_dtype=torch.float32, nonfinite="error", out=out)
    sb, qb = _encode(R, v.contiguous(), g)
    assert _same(s, sb) and _same(out, qb)
    perm = torch.empty(2, 30, 64, dtype=E4M3).permute(1, 0, 2)  # heads outer in memory
    assert _same(
        C.quantize(v[::2], s[::2].contiguous()[:4], Groups(S.PER_PAGE_HEAD, 4), out=perm[:15]),
        R.quantize(v[::2], s[::2].contiguous()[:4], Groups(S.PER_PAGE_HEAD, 4), out=_q((15, 2, 64))),
    )
    dst = torch.zeros(2, 30, 2, 64, dtype=torch.bfloat16)[1]
    C.dequantize(qb, sb, g, out=dst)
    assert _same(dst, R.dequantize(qb, sb, g, out=torch.empty(30, 2, 64, dtype=torch.bfloat16)))
    # an expanded input (stride 0 over tokens) reads fine
    ve = v[:1].expand(30, 2, 64)
    assert _same(_encode(C, ve, g)[1], _encode(R, ve.contiguous(), g)[1])


def test_huge_page_size_allocates_nothing_extra() -> None:
    """The page size only divides: 2**40 tokens a page is one partial page."""
    v = torch.randn(5, 2, 8).half()
    g = Groups(S.PER_PAGE_HEAD, 2**40)
    (sa, qa), (sb, qb) = _encode(C, v, g), _encode(R, v, g)
    assert sa.shape == (1, 2) and _same(sa, sb) and _same(qa, qb)


def test_nan_in_v_for_quantize_and_nan_codes_end_equal_to_the_reference() -> None:
    """Met row by row: C declines, and the reference's run rewrites all of out."""
    from kvcodec.backends import call

    v = torch.randn(40, 2, 48).half()
    v[30, 1, 5] = float("nan")
    s = torch.full((2,), 0.01)
    g = Groups(S.PER_LAYER_HEAD)
    out = _q(v.shape)
    with pytest.raises(Declined, match="NaN"):
        C.quantize(v, s, g, out=out)
    assert _same(call(C, "quantize", v, s, g, out=out), R.quantize(v, s, g, out=_q(v.shape)))
    q = torch.randint(0, 256, (40, 2, 48), dtype=torch.uint8)
    q[35, 0, 40] = 0xFF
    q = q.view(E4M3)
    for od in FLOATS:
        o = torch.empty(q.shape, dtype=od)
        with pytest.raises(Declined, match="NaN"):
            C.dequantize(q, s, g, out=o)
        assert _same(
            call(C, "dequantize", q, s, g, out=o), R.dequantize(q, s, g, out=torch.empty(q.shape, dtype=od))
        )


# --- every declined condition declines, before writing anything -------------------------------------


def _v(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(dtype)


def _misaligned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = int(np.prod(shape))
    size = torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    x = torch.frombuffer(bytearray(1 + size * n), dtype=dtype, offset=1, count=n).view(shape)
    x.copy_(torch.randn(shape))
    return x


def _fp32_huge() -> torch.Tensor:
    v = _v(4, 2, 8, dtype=torch.float32)
    v[1, 1, 1] = 1.0e9  # scale 2.2e6: no fp16 scale holds it
    return v


def _subnormal_absmax() -> torch.Tensor:
    v = torch.zeros(4, 1, 8)
    v[1, 0, 2] = 1.0e-44  # amax / 448 underflows to a zero scale
    return v


def _with(v: torch.Tensor, idx: tuple[int, ...], x: float) -> torch.Tensor:
    v = v.clone()
    v[idx] = x
    return v


ENC = dict(scale_dtype=torch.float32, nonfinite="error")
PT, LH, PH = Groups(S.PER_TENSOR), Groups(S.PER_LAYER_HEAD), Groups(S.PER_PAGE_HEAD, 2)

# name -> (op, input, groups, out, extra keyword arguments or positional scales)
DECLINE_ENCODE: dict[str, tuple[torch.Tensor, Groups, torch.Tensor, dict[str, Any]]] = {
    "saturate": (_v(4, 2, 8), PT, _q((4, 2, 8)), {**ENC, "nonfinite": "saturate"}),
    "scale_dtype_f64": (_v(4, 2, 8), PT, _q((4, 2, 8)), {**ENC, "scale_dtype": torch.float64}),
    "e5m2": (
        _v(4, 2, 8),
        Groups(S.PER_TENSOR, None, torch.float8_e5m2),
        torch.empty(4, 2, 8, dtype=torch.float8_e5m2),
        ENC,
    ),
    "scope_external": (_v(4, 2, 8), Groups(S.EXTERNAL), _q((4, 2, 8)), ENC),
    "page_float": (_v(4, 2, 8), Groups(S.PER_PAGE_HEAD, 2.5), _q((4, 2, 8)), ENC),  # type: ignore[arg-type]
    "page_zero": (_v(4, 2, 8), Groups(S.PER_PAGE_HEAD, 0), _q((4, 2, 8)), ENC),
    "page_none": (_v(4, 2, 8), Groups(S.PER_PAGE_HEAD, None), _q((4, 2, 8)), ENC),
    "page_bool": (_v(4, 2, 8), Groups(S.PER_PAGE_HEAD, True), _q((4, 2, 8)), ENC),
    "v_f64": (_v(4, 2, 8, dtype=torch.float64), PT, _q((4, 2, 8)), ENC),
    "v_int": (torch.ones(4, 2, 8, dtype=torch.int16), PT, _q((4, 2, 8)), ENC),
    "v_2d": (_v(4, 16), PT, _q((4, 16)), ENC),
    "v_empty": (_v(0, 2, 8), PT, _q((0, 2, 8)), ENC),
    "v_meta": (torch.empty(4, 2, 8, dtype=torch.float16, device="meta"), PT, _q((4, 2, 8)), ENC),
    "v_head_dim_strided": (_v(4, 2, 16)[:, :, ::2], PT, _q((4, 2, 8)), ENC),
    "v_transposed": (_v(8, 2, 4).transpose(0, 2), PT, _q((4, 2, 8)), ENC),
    "v_misaligned": (_misaligned((4, 2, 8), torch.float16), PT, _q((4, 2, 8)), ENC),
    "v_neg_view": (torch._neg_view(_v(4, 2, 8)), PT, _q((4, 2, 8)), ENC),
    "v_sparse": (_v(4, 2, 8).to_sparse(), PT, _q((4, 2, 8)), ENC),
    "v_nan": (_with(_v(6, 2, 8), (5, 1, 3), float("nan")), PH, _q((6, 2, 8)), ENC),
    "v_inf": (_with(_v(6, 2, 8), (0, 0, 0), float("-inf")), LH, _q((6, 2, 8)), ENC),
    "zero_scale": (_subnormal_absmax(), PT, _q((4, 1, 8)), ENC),
    "scale_overflows_fp16": (_fp32_huge(), LH, _q((4, 2, 8)), {**ENC, "scale_dtype": torch.float16}),
    "out_f16": (_v(4, 2, 8), PT, torch.empty(4, 2, 8, dtype=torch.float16), ENC),
    "out_shape": (_v(4, 2, 8), PT, _q((4, 2, 9)), ENC),
    "out_expanded": (_v(4, 2, 8), PT, _q((1, 1, 8)).expand(4, 2, 8), ENC),
    "out_requires_grad": (_v(4, 2, 8), PT, torch.zeros(4, 2, 8, requires_grad=True), ENC),
    "out_head_dim_strided": (_v(4, 2, 8), PT, _q((4, 2, 16))[:, :, ::2], ENC),
}


def _overlapping_out() -> tuple[torch.Tensor, torch.Tensor]:
    v = _v(4, 2, 16, dtype=torch.float32)
    out = torch.empty(0, dtype=E4M3).set_(
        v.untyped_storage(), 0, (4, 2, 16), (128, 64, 1)
    )  # inside V's bytes
    return v, out


def _storage(x: torch.Tensor) -> bytes:
    if x.device.type != "cpu" or x.layout != torch.strided:
        return b""
    return bytes(torch.empty(0, dtype=torch.uint8).set_(x.untyped_storage()).numpy())


@pytest.mark.parametrize("name", list(DECLINE_ENCODE))
def test_encode_v_declines_before_writing(encode_pass: int, name: str) -> None:
    """Every decline leaves ``out`` and V as they were (page by page, a NaN in page 0: one met later is
    the next test)."""
    v, g, out, kw = DECLINE_ENCODE[name]
    if encode_pass and name == "v_nan":
        v = _with(_v(6, 2, 8), (1, 1, 3), float("nan"))
    before = _storage(out), _storage(v)
    with pytest.raises(Declined):
        C.encode_v(v, g, out=out, **kw)
    assert (_storage(out), _storage(v)) == before


def _huge(v: torch.Tensor, idx: tuple[int, ...]) -> torch.Tensor:
    return _with(v, idx, 1.0e9)  # bf16 holds it, an fp16 scale (1e9 / 448) does not


@pytest.mark.parametrize("vdtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", ["nan", "inf", "scale_overflow"])
def test_encode_v_page_by_page_stops_at_the_first_bad_page(
    level: Any, encode_pass: int, vdtype: torch.dtype, bad: str
) -> None:
    """Page by page (SIMD levels), a decline met at page 2 leaves pages 0 and 1 coded as the reference
    codes them and the rest of ``out`` as it was; in two passes (or portable C) nothing is written."""
    if bad == "scale_overflow" and vdtype == torch.float16:
        vdtype = torch.bfloat16  # fp16 V always has an fp16 scale
    v = _v(8, 2, 64, dtype=vdtype)
    idx = (5, 1, 7)
    v = _huge(v, idx) if bad == "scale_overflow" else _with(v, idx, float("nan" if bad == "nan" else "inf"))
    sdt = torch.float16 if bad == "scale_overflow" else torch.float32
    out = torch.zeros(8, 2, 64, dtype=torch.uint8).view(E4M3)
    with pytest.raises(Declined):
        C.encode_v(v, PH, out=out, scale_dtype=sdt, nonfinite="error")
    written = 4 if encode_pass and level.simd > 0 else 0  # the level this build and CPU run
    if written:
        _, want = _encode(R, v[:written].contiguous(), PH, sdt)
        assert _same(out[:written], want)
    assert not out[written:].view(torch.uint8).any()


def test_encode_v_declines_an_out_overlapping_v() -> None:
    v, out = _overlapping_out()
    before = _storage(v)
    with pytest.raises(Declined, match="overlaps"):
        C.encode_v(v, PT, out=out, **ENC)
    assert _storage(v) == before


def _fp16_over(codes: torch.Tensor) -> torch.Tensor:
    """An fp16 [4, 2, 4] out over the bytes of e4m3 codes [4, 2, 8]."""
    return torch.empty(0, dtype=torch.float16).set_(codes.untyped_storage(), 0, (4, 2, 4), (8, 4, 1))


def _declines_cases() -> dict[str, tuple[str, torch.Tensor, torch.Tensor, Groups, torch.Tensor]]:
    v, q, s2 = _v(4, 2, 8), _q((4, 2, 8)), torch.full((2,), 0.01)
    codes = torch.randint(
        0, 0x7E, (4, 2, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)
    ).view(E4M3)
    f16 = torch.empty(4, 2, 8, dtype=torch.float16)
    ov, oq = _overlapping_out()
    big = torch.full((16,), 0.01)  # scales at the start, an out over all of its bytes
    return {
        "q_scale_shape": ("quantize", v, torch.ones(3), LH, q),
        "q_scale_zero": ("quantize", v, torch.tensor([0.01, 0.0]), LH, q),
        "q_scale_negative": ("quantize", v, torch.tensor([0.01, -1.0]), LH, q),
        "q_scale_inf": ("quantize", v, torch.tensor([float("inf"), 1.0]), LH, q),
        "q_scale_nan": ("quantize", v, torch.tensor([1.0, float("nan")]), LH, q),
        "q_scale_meta": ("quantize", v, torch.ones(2, device="meta"), LH, q),
        "q_scale_int": ("quantize", v, torch.ones(2, dtype=torch.int32), LH, q),
        "q_scale_complex": ("quantize", v, torch.ones(2, dtype=torch.complex64), LH, q),
        "q_v_misaligned": ("quantize", _misaligned((4, 2, 8), torch.bfloat16), s2, LH, q),
        "q_v_misaligned_f32": ("quantize", _misaligned((4, 2, 8), torch.float32), s2, LH, q),
        "d_out_misaligned": ("dequantize", codes, s2, LH, _misaligned((4, 2, 8), torch.float16)),
        "q_out_overlaps_v": ("quantize", ov, s2, LH, oq),
        "q_out_overlaps_scales": ("quantize", v, big[:2], LH, big.view(E4M3).view(4, 2, 8)),
        "q_e5m2": ("quantize", v, s2, Groups(S.PER_LAYER_HEAD, None, torch.float8_e5m2), q),
        "d_scale_inf": ("dequantize", codes, torch.tensor([float("inf"), 1.0]), LH, f16),
        "d_scale_nan": ("dequantize", codes, torch.tensor([1.0, float("nan")]), LH, f16),
        "d_scale_shape": ("dequantize", codes, torch.ones(2, 2), LH, f16),
        "d_out_f64": ("dequantize", codes, s2, LH, torch.empty(4, 2, 8, dtype=torch.float64)),
        "d_out_int8": ("dequantize", codes, s2, LH, torch.empty(4, 2, 8, dtype=torch.int8)),
        "d_out_expanded": ("dequantize", codes, s2, LH, f16[:1].expand(4, 2, 8)),
        "d_out_overlaps_q": ("dequantize", codes[:, :, :4], s2, LH, _fp16_over(codes)),
        "d_q_not_fp8": ("dequantize", v, s2, LH, f16),
        "d_q_e5m2": (
            "dequantize",
            codes.view(torch.float8_e5m2),
            s2,
            Groups(S.PER_LAYER_HEAD, None, torch.float8_e5m2),
            f16,
        ),
        "d_page_none": ("dequantize", codes, torch.ones(2, 2), Groups(S.PER_PAGE_HEAD), f16),
    }


@pytest.mark.parametrize("name", list(_declines_cases()))
def test_quantize_and_dequantize_decline_before_writing(name: str) -> None:
    op, x, scales, g, out = _declines_cases()[name]
    before = _storage(out), _storage(x)
    with pytest.raises(Declined):
        getattr(C, op)(x, scales, g, out=out)
    assert (_storage(out), _storage(x)) == before


# --- the C module's own checks: every error a CodecError ----------------------------------------------


def _arr(shape: tuple[int, ...], dtype: Any = np.int16) -> np.ndarray:
    return np.zeros(shape, dtype=dtype)


def _strided(
    nbytes: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: Any, offset: int = 0
) -> np.ndarray:
    """A numpy view with any (valid) strides and byte offset inside a fresh buffer of ``nbytes + offset``."""
    return np.ndarray(
        shape, dtype=dtype, buffer=np.zeros(nbytes + offset, np.uint8), offset=offset, strides=strides
    )


def _quant(
    m: Any, v: Any = None, dt: int = 0, scales: Any = None, scope: int = 0, page: int = 1, q: Any = None
) -> Any:
    """``m.quantize`` over a valid [2, 2, 8] call, with one argument replaced."""
    v = _arr((2, 2, 8)) if v is None else v
    scales = np.ones(1, np.float32) if scales is None else scales
    return m.quantize(v, dt, scales, scope, page, _arr((2, 2, 8), np.uint8) if q is None else q)


def _released() -> memoryview:
    mv = memoryview(_arr((2, 2, 8)))
    mv.release()
    return mv


def _enc(m: Any, scales: Any, sdt: int = 2, q: Any = None) -> Any:
    """``m.encode_v`` of a [4, 2, 8] fp16 V per head."""
    return m.encode_v(_arr((4, 2, 8)), 0, 1, 1, sdt, _arr((4, 2, 8), np.uint8) if q is None else q, scales)


_BYTES16 = np.ones(16, np.uint8)  # a dequantize out over the same bytes as its scale
_Q = _arr((4, 2, 8), np.uint8)  # encode_v scales over the codes' bytes

C_ERRORS: dict[str, Callable[[Any], Any]] = {
    "too_few_args": lambda m: m.quantize(_arr((2, 2, 8))),
    "not_a_buffer": lambda m: _quant(m, v="text"),
    "released_view": lambda m: _quant(m, v=_released()),
    "two_dims": lambda m: _quant(m, v=_arr((4, 8))),
    "item_size": lambda m: _quant(m, v=_arr((2, 2, 8), np.int32)),
    "shape_mismatch": lambda m: _quant(m, q=_arr((2, 2, 9), np.uint8)),
    "too_few_scales": lambda m: _quant(m, scales=np.ones(1, np.float32), scope=2, page=1),
    "too_many_scales": lambda m: _quant(m, scales=np.ones(3, np.float32), scope=1),
    "scales_strided": lambda m: _quant(m, scales=np.ones(4, np.float32)[::2], scope=1),
    "dtype_code": lambda m: _quant(m, dt=3),
    "scope_code": lambda m: _quant(m, scope=3),
    "page_zero": lambda m: _quant(m, scales=np.ones(2, np.float32), scope=2, page=0),
    "page_huge": lambda m: _quant(m, scope=2, page=2**63),
    "readonly_out": lambda m: _quant(m, q=memoryview(bytes(32)).cast("B", (2, 2, 8))),
    "encode_scales_bytes": lambda m: _enc(m, np.ones(3, np.float32)),
    "encode_scales_readonly": lambda m: _enc(m, bytes(8)),
    "encode_scale_dtype": lambda m: _enc(m, np.ones(2, np.float32), sdt=9),
    "dequantize_out_dtype": lambda m: m.dequantize(
        _arr((2, 2, 8), np.uint8), np.ones(1, np.float32), 0, 1, _arr((2, 2, 8), np.float64), 2
    ),
    "empty_bytearray_negative": lambda m: m.empty_bytearray(-1),
    "empty_bytearray_text": lambda m: m.empty_bytearray("1"),
    "simd_text": lambda m: m.simd("x"),
    "set_error_not_a_class": lambda m: m.set_error(3),
}

C_DECLINES: dict[str, Callable[[Any], Any]] = {
    "negative_stride": lambda m: _quant(m, v=_arr((2, 2, 8))[::-1]),
    "head_dim_strided": lambda m: _quant(m, v=_arr((2, 2, 16))[:, :, ::2]),
    "misaligned": lambda m: _quant(m, v=_strided(64, (2, 2, 8), (32, 16, 2), np.int16, offset=1)),
    "odd_stride": lambda m: _quant(m, v=_strided(200, (2, 2, 8), (33, 16, 2), np.int16)),
    "scales_misaligned": lambda m: _quant(m, scales=memoryview(bytearray(9))[1:], scope=1),
    "out_self_overlap": lambda m: _quant(m, q=_strided(32, (2, 2, 8), (8, 4, 1), np.uint8)),
    "out_stride_zero": lambda m: _quant(m, q=_strided(16, (2, 2, 8), (0, 8, 1), np.uint8)),
    "out_overlaps_v": lambda m: _quant(m, v=_Q.view(np.int16), q=_Q[:, :, :4]),
    "out_overlaps_scales": lambda m: m.dequantize(
        _arr((2, 2, 2), np.uint8),
        _BYTES16[:4].view(np.float32),
        0,
        1,
        _BYTES16.view(np.int16).reshape(2, 2, 2),
        0,
    ),
    "encode_scales_overlap_q": lambda m: _enc(m, _Q.reshape(-1)[:8].view(np.float32), q=_Q),
}


@pytest.mark.parametrize("name", list(C_DECLINES))
def test_c_declines_layouts_it_does_not_take(name: str) -> None:
    """Odd strides, misalignment and overlaps: a reason string (the reference's turn), nothing written."""
    from kvcodec import _cpu

    reason = C_DECLINES[name](_cpu)
    assert isinstance(reason, str) and reason


@pytest.mark.parametrize("name", list(C_ERRORS))
def test_every_c_error_is_a_codec_error(name: str) -> None:
    from kvcodec import _cpu

    with pytest.raises(UnsupportedConfigError, match=r"kvcodec\._cpu\.") as e:
        C_ERRORS[name](_cpu)
    assert e.value.reason == Reason.BAD_BUFFER


def test_c_accepts_valid_buffers_of_any_exporter() -> None:
    """The same checks let through what is valid: numpy views, memoryviews, empty extents."""
    from kvcodec import _cpu

    v = np.ones((3, 2, 8), np.float16).view(np.int16)
    q = np.zeros((3, 2, 8), np.uint8)
    assert _cpu.quantize(v, 0, np.full(1, 0.5, np.float32), 0, 1, memoryview(q)) is None
    assert (q == 0x40).all()  # 1 / 0.5 = 2.0 is e4m3 0x40
    assert _cpu.quantize(v[:0], 0, np.zeros(0, np.float32), 2, 4, q[:0]) is None
    assert _cpu.dequantize(q, np.full(2, 0.25, np.float32), 1, 1, np.zeros((3, 2, 8), np.float32), 2) is None
    assert len(_cpu.empty_bytearray(3 << 20)) == 3 << 20 and type(_cpu.empty_bytearray(0)) is bytearray
    from kvcodec.hostmem import new_buffer

    assert type(new_buffer(7)) is bytearray and len(new_buffer(7)) == 7


def test_encode_v_copies_k_in_the_same_call_only_when_served() -> None:
    from kvcodec import _cpu
    from kvcodec.errors import UnsupportedConfigError

    v = np.ones((4, 2, 8), np.float16).view(np.int16)
    q = np.zeros((4, 2, 8), np.uint8)
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    assert _cpu.encode_v(v, 0, 0, 1, 2, q, np.zeros(1, np.float32), src, dst) is None
    assert (dst == src).all()
    nan = np.full((4, 2, 8), np.float16("nan")).view(np.int16)
    dst[:] = 0
    assert _cpu.encode_v(nan, 0, 0, 1, 2, q, np.zeros(1, np.float32), src, dst) is not None  # declined
    assert not dst.any()  # K untouched: the reference path copies it
    for bad in ((src, dst[:10]), (src, bytes(64))):
        with pytest.raises(UnsupportedConfigError):
            _cpu.encode_v(v, 0, 0, 1, 2, q, np.zeros(1, np.float32), *bad)
    buf = np.arange(80, dtype=np.uint8)  # source and destination overlap: a memmove
    assert _cpu.encode_v(v, 0, 0, 1, 2, q, np.zeros(1, np.float32), buf[:64], buf[16:]) is None
    assert (buf[16:] == np.arange(64)).all()
    assert _cpu.encode_v(v, 0, 0, 1, 2, q, np.zeros(1, np.float32), buf[:64], buf[:64]) is None
    overlapping = (np.zeros(64, np.uint8), q.reshape(-1)[:64])  # the copy would land on the codes
    assert _cpu.encode_v(v, 0, 0, 1, 2, q, np.zeros(1, np.float32), *overlapping) is not None


# --- fuzz: odd tensors through every entry point -------------------------------------------------------


@st.composite
def odd_tensors(draw: st.DrawFn, dtypes: list[torch.dtype]) -> torch.Tensor:
    """A [T, H, D] tensor with odd extents, strides, offsets and alignment, or an outright wrong one."""
    t, h, d = draw(st.integers(0, 9)), draw(st.integers(0, 3)), draw(st.integers(0, 40))
    dtype = draw(st.sampled_from(dtypes))
    kind = draw(
        st.sampled_from(
            ["dense", "sliced", "heads_outer", "expanded", "misaligned", "transposed", "wrong_dim"]
        )
    )
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    src = torch.randn(t * 2 + 1, h + 2, d + 3, generator=gen) * draw(st.sampled_from([1e-3, 1.0, 300.0]))
    if draw(st.booleans()) and t > 0 and h > 0 and d > 0:
        src[draw(st.integers(0, t - 1)), 0, draw(st.integers(0, d - 1))] = draw(
            st.sampled_from([0.0, float("inf"), float("nan"), 1e30])
        )
    if dtype == E4M3:
        src = torch.randint(0, 256, src.shape, generator=gen, dtype=torch.uint8).view(E4M3)
    else:
        src = src.to(dtype)
    if kind == "sliced":
        return src[1 : 1 + 2 * t : 2, 1 : 1 + h, 2 : 2 + d]
    if kind == "heads_outer":
        return src.transpose(0, 1).contiguous().transpose(0, 1)[:t, :h, :d]
    if kind == "expanded":
        return src[:1, :h, :d].expand(t, h, d)
    if kind == "misaligned":
        return _misaligned((t, h, d), dtype)
    if kind == "transposed":
        return src.transpose(0, 2).contiguous().transpose(0, 2)[:t, :h, :d]
    if kind == "wrong_dim":
        return src[:t, :h]
    return src[:t, :h, :d].contiguous()


def _groups(draw: st.DrawFn) -> Groups:
    scope = draw(st.sampled_from([S.PER_TENSOR, S.PER_LAYER_HEAD, S.PER_PAGE_HEAD, S.EXTERNAL]))
    page = draw(st.sampled_from([1, 2, 3, 16, 2**40, 0, -1, None, 2.5]))
    return Groups(scope, page, draw(st.sampled_from([E4M3, E4M3, torch.float8_e5m2])))


def _run(be: Any, op: str, *args: Any, **kw: Any) -> tuple[str, Any]:
    """("ok", result copy) or ("raised", exception type); the cpu backend may only decline or raise CodecError."""
    try:
        res = getattr(be, op)(*args, **kw)
    except Declined:
        assert be is C
        return "declined", None
    except CodecError as e:
        return "raised", type(e)
    except Exception as e:  # the reference may raise torch's own errors (the codec's checks come first)
        assert be is R, f"the cpu backend let {type(e).__name__} escape: {e}"
        return "raised", type(e)
    return "ok", res.clone()


def _clone(x: Any) -> Any:
    return (
        x.clone()
        if isinstance(x, torch.Tensor) and x.layout == torch.strided and x.device.type == "cpu"
        else x
    )


def _check(op: str, args: tuple[Any, ...], make_out: Callable[[], Any], **kw: Any) -> None:
    """The cpu backend either declines or gives the reference's answer (and raises only CodecError)."""
    out_c = make_out()
    got = _run(C, op, *args, out=out_c, **kw)
    if got[0] == "declined":
        return
    want = _run(R, op, *(_clone(a) for a in args), out=make_out(), **kw)
    if got[0] == "raised":
        assert want[0] == "raised"
        return
    assert want[0] == "ok" and _same(got[1], want[1]), (op, got, want)


@FUZZ
@given(v=odd_tensors([*FLOATS, torch.float64]), data=st.data())
def test_fuzz_encode_v(v: torch.Tensor, data: st.DataObject) -> None:
    g = _groups(data.draw)
    sdt = data.draw(st.sampled_from([*FLOATS, torch.float64]))
    out_kind = data.draw(st.sampled_from(["dense", "dense", "strided", "wrong_shape"]))

    def make_out() -> torch.Tensor:
        shape = tuple(v.shape)
        if out_kind == "strided" and len(shape) == 3:
            return torch.empty(shape[0], shape[1], shape[2] + 5, dtype=E4M3)[:, :, : shape[2]]
        if out_kind == "wrong_shape" and len(shape) == 3:
            return torch.empty(shape[0] + 1, *shape[1:], dtype=E4M3)
        return torch.empty(shape, dtype=E4M3)

    out_c = make_out()
    got = _run(C, "encode_v", v, g, out=out_c, scale_dtype=sdt, nonfinite="error")
    if got[0] != "ok":
        return
    out_r = make_out()
    want = _run(R, "encode_v", v.clone(), g, out=out_r, scale_dtype=sdt, nonfinite="error")
    assert want[0] == "ok" and _same(got[1], want[1]) and _same(out_c, out_r)


@FUZZ
@given(v=odd_tensors([*FLOATS, torch.int32]), data=st.data())
def test_fuzz_quantize(v: torch.Tensor, data: st.DataObject) -> None:
    g = _groups(data.draw)
    shape = tuple(v.shape) + (1,) * (3 - v.dim())
    n_pages = -(-shape[0] // g.page_size) if isinstance(g.page_size, int) and g.page_size > 0 else 1
    sshape = {S.PER_TENSOR: (), S.PER_LAYER_HEAD: (shape[1],)}.get(g.scope, (n_pages, shape[1]))
    scales = torch.rand(sshape) * data.draw(st.sampled_from([1e-3, 1.0, 1e3])) + data.draw(
        st.sampled_from([0.0, 1e-6, -0.5])
    )
    _check("quantize", (v, scales, g), lambda: torch.empty(tuple(v.shape), dtype=E4M3))


@FUZZ
@given(q=odd_tensors([E4M3, torch.uint8, torch.float16]), data=st.data())
def test_fuzz_dequantize(q: torch.Tensor, data: st.DataObject) -> None:
    g = _groups(data.draw)
    shape = tuple(q.shape) + (1,) * (3 - q.dim())
    n_pages = -(-shape[0] // g.page_size) if isinstance(g.page_size, int) and g.page_size > 0 else 1
    sshape = {S.PER_TENSOR: (), S.PER_LAYER_HEAD: (shape[1],)}.get(g.scope, (n_pages, shape[1]))
    scales = torch.randn(sshape) * data.draw(st.sampled_from([1e-3, 1.0, 1e30]))
    od = data.draw(st.sampled_from([*FLOATS, torch.float64]))
    _check("dequantize", (q, scales, g), lambda: torch.empty(tuple(q.shape), dtype=od))


@FUZZ
@given(
    shape=st.tuples(st.integers(0, 5), st.integers(0, 4), st.integers(0, 20)),
    strides=st.tuples(st.integers(-2, 200), st.integers(-2, 60), st.sampled_from([1, 1, 1, 2, 0, -1])),
    item=st.sampled_from([1, 2, 4, 8]),
    offset=st.integers(0, 3),
    op=st.sampled_from(["encode_v", "quantize", "dequantize"]),
    codes=st.tuples(st.integers(-1, 3), st.integers(-1, 3), st.integers(-1, 40), st.integers(-1, 3)),
    n_scales=st.integers(0, 12),
    out_same=st.booleans(),
)
def test_fuzz_c_buffers(
    shape: tuple[int, int, int],
    strides: tuple[int, int, int],
    item: int,
    offset: int,
    op: str,
    codes: tuple[int, int, int, int],
    n_scales: int,
    out_same: bool,
) -> None:
    """Raw buffers of any strides, item sizes and offsets into C: a reason, None, or UnsupportedConfigError.

    The buffers are valid memory (numpy views made big enough), so under
    AddressSanitizer (make test-asan) any read or write outside them is caught.
    """
    from kvcodec import _cpu

    st_bytes = tuple(s * item for s in strides)
    span = item + sum(max(0, (n - 1) * s) for n, s in zip(shape, st_bytes)) if all(shape) else 0
    if any(s < 0 for s in st_bytes) and all(shape):
        lo = sum(min(0, (n - 1) * s) for n, s in zip(shape, st_bytes))
        base = np.zeros(span - lo + offset + 8, np.uint8)
        x = np.ndarray(
            shape, dtype=f"u{item}" if item != 8 else "f8", buffer=base, offset=offset - lo, strides=st_bytes
        )
    else:
        base = np.zeros(span + offset + 8, np.uint8)
        x = np.ndarray(
            shape, dtype=f"u{item}" if item != 8 else "f8", buffer=base, offset=offset, strides=st_bytes
        )
    dt, scope, page, sdt = codes
    scales = np.full(n_scales, 0.5, np.float32)
    other = np.zeros(shape, np.uint8 if op != "dequantize" else np.uint16)
    if out_same:
        other = x
    try:
        if op == "encode_v":
            r = _cpu.encode_v(x, dt, scope, page, sdt, other, scales)
        elif op == "quantize":
            r = _cpu.quantize(x, dt, scales, scope, page, other)
        else:
            r = _cpu.dequantize(x, scales, scope, page, other, dt)
    except UnsupportedConfigError:
        return
    assert r is None or isinstance(r, str)


# --- one thread, no GIL -------------------------------------------------------------------------------


def _tasks() -> int:
    return (
        len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    )


def _python_beside(calls: dict[str, Callable[[], Any]]) -> tuple[dict[str, int], list[int], int]:
    """How far another Python thread's counter moved during each of ``calls`` (8 times each), the OS
    thread counts it saw, and the count before. The switch interval is made huge, so the calling thread
    never hands over the GIL on its own: the counter moves only while a call has released it."""
    count, tasks, stop = [0], [], threading.Event()

    def other() -> None:
        while not stop.is_set():
            count[0] += 1
            tasks.append(_tasks())
            time.sleep(0)  # hands the GIL back to the main thread whenever it waits

    old = sys.getswitchinterval()
    th = threading.Thread(target=other)
    th.start()
    while not tasks:
        time.sleep(0.001)
    baseline = _tasks()
    moved = dict.fromkeys(calls, 0)
    sys.setswitchinterval(1000.0)
    try:
        for _ in range(8):
            for name, call in calls.items():
                before = count[0]
                call()
                moved[name] += count[0] - before
    finally:
        sys.setswitchinterval(old)
        stop.set()
        th.join()
    return moved, tasks, baseline


def test_calls_release_the_gil_and_start_no_threads() -> None:
    """While the main thread is inside a large C call, another thread runs Python; no OS thread appears.
    Held GIL: the other thread's counter stays put and the test fails."""
    from kvcodec import _cpu

    v = np.asarray(np.random.default_rng(0).standard_normal((8192, 8, 128)), np.float32).view(np.int32)
    q = np.empty(v.shape, np.uint8)
    out = np.empty(v.shape, np.float32).view(np.int32)
    s_head, s_page = np.ones(8, np.float32), np.empty(512 * 8, np.float32)
    calls = {
        "encode_v": lambda: _cpu.encode_v(v, 2, 2, 16, 2, q, s_page),
        "quantize": lambda: _cpu.quantize(v, 2, s_head, 1, 1, q),
        "dequantize": lambda: _cpu.dequantize(q, s_head, 1, 1, out, 2),
    }
    moved, tasks, baseline = _python_beside(calls)
    assert all(moved.values()), f"no Python ran beside these C calls (GIL held): {moved}"
    assert max(tasks) == baseline, "a thread appeared during the calls"


def test_small_calls_keep_the_gil() -> None:
    """A call that moves under KV_GIL_FREE_BYTES (1 MiB) keeps the GIL: a release is a hand-over, and a busy
    Python thread beside it would keep the GIL until its switch interval ends. Above it, it releases."""
    from kvcodec import _cpu

    def dequantize(tokens: int) -> Callable[[], Any]:  # codes in, fp32 out: 5 bytes an element
        q = np.zeros((tokens, 4, 64), np.uint8)
        out, s = np.empty(q.shape, np.int32), np.ones(4, np.float32)
        return lambda: _cpu.dequantize(q, s, 1, 1, out, 2)

    data = np.zeros(1 << 19, np.uint8)
    small = {
        "dequantize, 320 KiB": dequantize(256),
        "crc32, 512 KiB": lambda: _cpu.crc32(data),
    }
    moved, _, _ = _python_beside(small)
    assert not any(moved.values()), f"Python ran beside these small C calls (GIL released): {moved}"
    moved, _, _ = _python_beside({"dequantize, 20 MiB": dequantize(16384)})
    assert all(moved.values()), f"no Python ran beside a call over the threshold: {moved}"


def test_pool_of_threads_gets_right_answers() -> None:
    """Several Python threads calling the C loops at once (GIL released) each get the reference's bytes."""
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(12)
    vs = [torch.randn(300, 4, 64, generator=gen).to(FLOATS[i % 3]) for i in range(12)]
    g = Groups(S.PER_PAGE_HEAD, 16)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda v: _encode(C, v, g), vs))
    for v, (s, q) in zip(vs, got):
        sb, qb = _encode(R, v, g)
        assert _same(s, sb) and _same(q, qb)
