"""The fused encode's ``V / scale`` with one reciprocal per group equals IEEE division, proven by enumeration.

The kernels (:func:`kvcodec.kernels.device.div_by_scale`, ``DIV`` 1 for
fp16 V and 2 for bf16 V) compute ``r = 1/s`` once per group and each
quotient as ``q = v*r`` corrected once, ``q - fma(q, s, -v) * r``. Part one
models that arithmetic in numpy (fp32 products and sums, an exact fp32 FMA)
and checks it against numpy's IEEE fp32 division over every fp16/bf16 value
and the scales the codec makes, ``s = amax / fp8_max`` rounded to fp32:

* fp16: all 63488 finite values against every scale of an amax in [1, 2)
  (every significand a scale can have: fp16 scales never leave fp32's
  normal range, so the significand and the exponent difference decide the
  quotient), the extremes (smallest subnormal, smallest normal, largest
  amax) and every subnormal amax. The quotient is bit-identical, ``-0``
  included.
* bf16: every value a group can hold (``|v| <= amax``) for the amax of a
  whole binade, the top binade, every amax below 2^-100 (scales down to
  fp32's smallest subnormal: there the kernel scales ``v`` and ``s`` by
  2^64 first) and one amax per binade in between. The FP8 byte is always
  identical; the fp32 quotient is identical whenever ``|v/s| >= 2^-24``
  (below that a value under 2^-100 may leave a residual in fp32's subnormal
  range, which rounds; such quotients are far below FP8's smallest step,
  2^-16, so both give the same signed zero).

Part two runs the kernels themselves (interpreter, or CUDA) on groups made of
every value below chosen amaxes and compares the payload with the oracle.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from kvcodec.format import ScaleScope
from tests.kernels.conftest import DEVICE, KERNEL_MARKS, require_kernels
from tests.oracle import oracle_encode

F32, F64 = np.float32, np.float64
FP8 = {448.0: torch.float8_e4m3fn, 57344.0: torch.float8_e5m2}
PRESCALE_BELOW = F32(2.0**-64)
"""div_by_scale's DIV=2 threshold: scales below it are multiplied by 2^64 (with their group's values)."""
TINY_QUOTIENT = 2.0**-24
"""Below this a quotient is far under FP8's smallest step (2^-16, e5m2): both roundings give a signed zero."""


def fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Exact fp32 ``x * y + z`` with one rounding (round to nearest even), for finite inputs.

    The product of two fp32 values is exact in fp64; the sum is taken in fp64
    with its error (TwoSum) and rounded to odd, which makes the final
    fp64 -> fp32 rounding the single correct one (fp64 has >= 24 + 2 bits).
    """
    p = x.astype(F64) * y.astype(F64)
    z64 = z.astype(F64)
    s = p + z64
    bp = s - z64
    err = (p - bp) + (z64 - (s - bp))
    bits = s.view(np.int64)
    step = np.where((err != 0) & ((bits & 1) == 0), np.where((err > 0) == (s > 0), 1, -1), 0)
    return (bits + step).view(F64).astype(F32)


def kernel_quotient(v: np.ndarray, s: F32, prescale: bool) -> np.ndarray:
    """div_by_scale (DIV 1, or 2 with ``prescale``) in numpy, step by step as the kernel does it."""
    if prescale and s < PRESCALE_BELOW:
        f = F32(2.0**64)
        s, v = F32(s * f), (v * f).astype(F32)
    r = F32(F32(1.0) / s)
    q0 = (v * r).astype(F32)
    sv = np.full(v.shape, s, dtype=F32)
    return fma32(-fma32(q0, sv, -v), np.full(v.shape, r, dtype=F32), q0)


def finite_values(kind: str) -> np.ndarray:
    """Every finite fp16 or bf16 value, as fp32."""
    if kind == "fp16":
        v = np.arange(65536, dtype=np.uint16).view(np.float16).astype(F32)
    else:
        v = (np.arange(65536, dtype=np.uint32) << 16).view(F32)
    return v[np.isfinite(v)]


def fp8_bytes(q: np.ndarray, qmax: float) -> torch.Tensor:
    return torch.from_numpy(q).clamp(-qmax, qmax).to(FP8[qmax]).view(torch.uint8)


def check_scales(kind: str, qmax: float, amaxes: np.ndarray, all_values: bool) -> tuple[int, int]:
    """(pairs checked, quotient mismatches) of the kernel's division against IEEE over ``amaxes``' scales.

    Asserts identical FP8 bytes for every pair, and identical quotients for
    every pair whose quotient is at least 2^-24 in magnitude.
    """
    vals = finite_values(kind)
    pairs = mismatches = 0
    with np.errstate(over="ignore", under="ignore"):
        for amax in amaxes:
            s = F32(F32(amax) / F32(qmax))
            v = vals if all_values else vals[np.abs(vals) <= amax]
            want = (v / s).astype(F32)
            got = kernel_quotient(v, s, prescale=kind == "bf16")
            diff = want.view(np.int32) != got.view(np.int32)
            pairs += v.size
            if diff.any():
                mismatches += int(diff.sum())
                big = diff & (np.abs(want) >= TINY_QUOTIENT)
                assert not big.any(), (
                    f"{kind} s={s!r}: v={v[big][:4]} want {want[big][:4]} got {got[big][:4]}"
                )
                wb, gb = fp8_bytes(want[diff], qmax), fp8_bytes(got[diff], qmax)
                assert torch.equal(wb, gb), f"{kind} s={s!r}: FP8 bytes differ for v={v[diff][:4]}"
    return pairs, mismatches


def positive(kind: str) -> np.ndarray:
    v = finite_values(kind)
    return v[v > 0]


def _round_f32(x: Fraction) -> F32:
    """The fp32 nearest to an exact rational (ties to even), by exact comparison of the neighbours."""
    c = F32(float(x))
    cands = [np.nextafter(c, F32(-np.inf)), c, np.nextafter(c, F32(np.inf))]
    return min(cands, key=lambda f: (abs(Fraction(float(f)) - x), int(np.array(f).view(np.int32)) & 1))


def test_fma_model_is_exact() -> None:
    """The numpy FMA model against exact rational arithmetic, on near-cancelling and random triples."""
    g = np.random.default_rng(7)
    n = 1500
    x = (g.standard_normal(n) * 1e3).astype(F32)
    y = g.standard_normal(n).astype(F32)
    z = -(x.astype(F64) * y).astype(F32)  # the residual case: x*y + z nearly cancels
    for zz in (z, (z * F32(1 + 2**-20)).astype(F32), g.standard_normal(n).astype(F32)):
        got = fma32(x, y, zz)
        for i in range(n):
            want = _round_f32(Fraction(float(x[i])) * Fraction(float(y[i])) + Fraction(float(zz[i])))
            assert np.array(got[i]).view(np.int32) == np.array(want).view(np.int32), (x[i], y[i], zz[i])


@pytest.mark.parametrize("qmax", [448.0, 57344.0], ids=["e4m3fn", "e5m2"])
def test_fp16_every_value_every_scale_significand(qmax: float) -> None:
    am = positive("fp16")
    binade = am[(am >= 1) & (am < 2)]
    extremes = np.array([am.min(), F32(2.0**-14), F32(1.5 * 2.0**-14), am.max(), am[-2]], dtype=F32)
    pairs, bad = check_scales("fp16", qmax, np.concatenate([binade, extremes]), all_values=True)
    assert pairs == (binade.size + extremes.size) * 63488
    assert bad == 0
    sub_pairs, sub_bad = check_scales("fp16", qmax, am[am < 2.0**-14], all_values=False)
    assert sub_pairs > 0 and sub_bad == 0


@pytest.mark.parametrize("qmax", [448.0, 57344.0], ids=["e4m3fn", "e5m2"])
def test_bf16_every_group_value_representative_scales(qmax: float) -> None:
    am = positive("bf16")
    binade = am[(am >= 1) & (am < 2)]
    top = am[am >= 2.0**127]
    tiny = am[am < 2.0**-100]  # scales from 2^-149 up: the pre-scaled path and around its threshold
    exps = np.frexp(am)[1]
    between = np.array([am[exps == e][37] for e in range(-98, 127, 3) if (exps == e).sum() > 37], dtype=F32)
    for group in (binade, top, tiny, between):
        pairs, _ = check_scales("bf16", qmax, group, all_values=False)
        assert pairs > 0


def test_prescale_threshold_reaches_the_smallest_scale() -> None:
    """bf16's smallest scale needs the pre-scaling, and with it the reciprocal stays finite; v * 2^64 cannot overflow."""
    smallest = F32(F32(2.0**-133) / F32(57344.0))
    with np.errstate(over="ignore"):
        assert smallest > 0 and np.isinf(F32(1.0) / smallest)
    assert np.isfinite(F32(1.0) / F32(smallest * F32(2.0**64)))
    largest_prescaled_amax = F32(PRESCALE_BELOW * F32(448.0))  # |v| <= amax = scale * fp8_max < 2^-64 * 448
    assert np.isfinite(F32(largest_prescaled_amax * F32(2.0**64)))


# ----------------------------------------------------------------------------
# The kernels themselves
# ----------------------------------------------------------------------------


def _groups_below(amax: float, dtype: torch.dtype, group: int) -> torch.Tensor:
    """Every finite value of ``dtype`` with ``|v| <= amax``, in groups of ``group`` that each hold ``amax``."""
    kind = "fp16" if dtype == torch.float16 else "bf16"
    v = finite_values(kind)
    v = v[np.abs(v) <= amax]
    per = group - 1
    n = -(-v.size // per)
    body = np.full(n * per, F32(amax), dtype=F32)
    body[: v.size] = v
    rows = np.concatenate([np.full((n, 1), F32(amax), dtype=F32), body.reshape(n, per)], axis=1)
    return torch.from_numpy(rows.reshape(-1)).to(dtype)


def _oracle_payload(
    k: torch.Tensor, v: torch.Tensor, scope: ScaleScope, ps: int | None, fp8: torch.dtype
) -> torch.Tensor:
    scales, q = oracle_encode(v, scope.name.lower(), ps, fp8, torch.float32)
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in (k, q, scales)])


def _encode(v: torch.Tensor, scope: ScaleScope, ps: int | None, fp8: torch.dtype, strategy: str) -> None:
    """Fused encode of ``v`` (K all zeros) on the test device; assert its payload is the oracle's byte for byte."""
    require_kernels()
    from kvcodec.kernels import fused_triton, operands

    k = torch.zeros_like(v)
    pay = torch.empty(operands.payload_nbytes(k, v, scope, ps), dtype=torch.uint8, device=DEVICE)
    fused_triton.encode_fused(
        k.to(DEVICE), v.to(DEVICE), scope, page_size=ps, payload=pay, fp8_dtype=fp8, strategy=strategy
    )  # type: ignore[arg-type]
    want, got = _oracle_payload(k, v, scope, ps, fp8), pay.cpu()
    assert torch.equal(got, want), f"{int((got != want).sum())} payload bytes differ"


AMAXES = {
    torch.float16: [2.0**-24, 1.5 * 2.0**-14, 1.0, 1.3330078125, 448.0, 65504.0],
    torch.bfloat16: [2.0**-133, 2.0**-126, 1.5 * 2.0**-70, 1.0, 3.0, 2.0**127 * 1.9921875],
}


@KERNEL_MARKS[0]
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fused_encode_every_value_below_amax(dtype: torch.dtype, fp8: torch.dtype) -> None:
    """One pass per group (per_page_head): each group holds its amax and values below it; payload = oracle's."""
    d, ps = 64, 4
    v = torch.cat([_groups_below(a, dtype, ps * d) for a in AMAXES[dtype]]).view(-1, 1, d)
    _encode(v, ScaleScope.PER_PAGE_HEAD, ps, fp8, "single")


@KERNEL_MARKS[0]
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_two_stage_encode_every_value_below_amax(dtype: torch.dtype) -> None:
    """The two-stage path (per_tensor: atomic absmax, then the quantize kernel) on the same kind of groups."""
    for amax in (AMAXES[dtype][0], AMAXES[dtype][-1]):
        v = _groups_below(amax, dtype, 16 * 64).view(-1, 1, 64)
        _encode(v, ScaleScope.PER_TENSOR, None, torch.float8_e4m3fn, "two_stage")
