"""The quantize kernels of the K16/V8 codec and their unfused launchers, bit-exact with the torch reference.

* ``_amax_tiles_kernel``: absmax of a token tile x one head, atomically
  maxed into its scale group (also stage 1 of the fused two-stage encode,
  which copies K on the way);
* ``_quant_tiles_kernel``: FP8 codes of ``V / scale`` (stage 2 of the fused
  encode, writing the scale bytes too);
* ``_quant_1d_kernel``: FP8 codes of a flat tensor with one scale (cast tests).

The launchers (:func:`group_amax`, :func:`compute_scales`, :func:`quantize`,
:func:`quantize_1d`) share the reference's semantics
(:mod:`kvcodec.backends.reference`); the dequantize kernel and launcher are
in :mod:`.dequant_triton`. Inputs are ``[tokens, heads, head_dim]`` tensors
of any strides (never copied to contiguous); offsets are int64, so pools
above 2^31 elements work. Scale groups: whole tensor, one head, or one page
x one head (a partial last page over the tokens it holds).
Argument names: see :mod:`kvcodec.kernels.device`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import triton
import triton.language as tl

from ..errors import Reason, UnsupportedConfigError
from ..numerics import ScaleScope, amax_to_scale, check_finite_amax, fp8_max, scale_shape
from .configs import pow2
from .device import (
    abs_bits,
    div_by_scale,
    f32_to_fp8,
    layer_off,
    row_off,
    store_elems,
    to_f32,
)
from .launch import launch
from .operands import (
    V_DTYPES,
    bits16,
    check_device,
    check_scope,
    check_tensor3,
    dense_rows,
    dummy_table,
    fp8_constants,
    hw_fp8,
    interpreted,
    single,
    sm_count,
)
from .tiles import launch_grid, launch_tiles, register, register_plain

__all__ = [
    "STAGE1_TOKENS",
    "compute_scales",
    "group_amax",
    "launch_amax_tiles",
    "prep_scales",
    "quantize",
    "quantize_1d",
    "scale_strides",
    "stage1_tokens",
]

STAGE1_TOKENS: int | None = None
"""Tokens per stage-1 (absmax) program of two-stage reductions; None picks by GPU size."""


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _amax_tiles_kernel(
    k_ptr,
    v_ptr,
    pay_ptr,
    abits_ptr,
    tbl_ptr,
    k_ltab,
    v_ltab,
    p_ltab,
    T,
    H,
    TT,
    GT,
    n_gt,
    BS: tl.constexpr,
    k_st,
    k_sh,
    k_sd,
    k_sb,
    k_sl,
    v_st,
    v_sh,
    v_sd,
    v_sb,
    v_sl,
    p_sl,
    D: tl.constexpr,
    KB: tl.constexpr,
    V_BF16: tl.constexpr,
    PER_TENSOR: tl.constexpr,
    FINITE_ONLY: tl.constexpr,
    PAGED: tl.constexpr,
    K_TAB: tl.constexpr,
    V_TAB: tl.constexpr,
    P_TAB: tl.constexpr,
    K_ALIGNED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Stage 1: absmax of TT tokens x one head, atomically maxed into its group's int32 bits.

    With ``KB > 0`` it also copies those K rows into the payload.
    """
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2)
    v_base = v_ptr + layer_off(layer, v_ltab, v_sl, V_TAB)
    k_base = k_ptr
    p_base = pay_ptr
    if KB > 0:
        k_base = k_ptr + layer_off(layer, k_ltab, k_sl, K_TAB)
        p_base = pay_ptr + layer_off(layer, p_ltab, p_sl, P_TAB)
    t0 = i * TT
    t1 = tl.minimum(t0 + TT, T)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    d64 = d.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.int32)
    for ts in range(t0, t1, BLOCK_T):
        t = ts + tl.arange(0, BLOCK_T)
        tm = t < t1
        m2 = tm[:, None] & dm[None, :]
        vrow = row_off(t, tm, tbl_ptr, v_st, v_sb, BS, PAGED)
        v = to_f32(tl.load(v_base + vrow[:, None] + h * v_sh + d64[None, :] * v_sd, mask=m2, other=0), V_BF16)
        acc = tl.maximum(acc, abs_bits(v, FINITE_ONLY))
        if KB > 0:
            pidx = (t.to(tl.int64)[:, None] * H + h) * D + d64[None, :]
            krow = row_off(t, tm, tbl_ptr, k_st, k_sb, BS, PAGED)
            kv = tl.load(k_base + krow[:, None] + h * k_sh + d64[None, :] * k_sd, mask=m2, other=0)
            store_elems(p_base, pidx, kv, m2, KB, K_ALIGNED)
    a = tl.max(tl.max(acc, axis=1), axis=0)
    if PER_TENSOR:
        gi = (t0 // GT).to(tl.int64) + layer.to(tl.int64) * n_gt
    else:
        gi = ((t0 // GT).to(tl.int64) + layer.to(tl.int64) * n_gt) * H + h
    tl.atomic_max(abits_ptr + gi, a)


@triton.jit
def _quant_tiles_kernel(
    v_ptr,
    o_ptr,
    s_ptr,
    tbl_ptr,
    v_ltab,
    o_ltab,
    T,
    H,
    PS,
    s_pg,
    s_hd,
    s_sl,
    BS: tl.constexpr,
    o_off,
    v_st,
    v_sh,
    v_sd,
    v_sb,
    v_sl,
    o_st,
    o_sh,
    o_sd,
    o_sl,
    qmax,
    D: tl.constexpr,
    V_BF16: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_BITS: tl.constexpr,
    SAT: tl.constexpr,
    FROM_AMAX: tl.constexpr,
    WRITE_SCALES: tl.constexpr,
    SHARED_HEADS: tl.constexpr,
    PAGED: tl.constexpr,
    V_TAB: tl.constexpr,
    O_TAB: tl.constexpr,
    HW_FP8: tl.constexpr,
    DIV: tl.constexpr,
    FINITE: tl.constexpr,
    S_ALIGNED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """FP8 bytes of ``V / scale`` for BLOCK_T tokens x one head.

    Scales come per token row from ``s_ptr[(t // PS) * s_pg + h * s_hd]``:
    fp32 scales, or (``FROM_AMAX``) int32 absmax bits turned into scales here.
    With ``WRITE_SCALES`` the first tile of each group stores the scale's
    bytes at ``o + o_off + T*H*D + 4 * group`` (``SHARED_HEADS``: head 0 only).
    """
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2)
    v_base = v_ptr + layer_off(layer, v_ltab, v_sl, V_TAB)
    o_base = o_ptr + layer_off(layer, o_ltab, o_sl, O_TAB) + o_off
    s_base = s_ptr + layer.to(tl.int64) * s_sl
    t = i * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    d64 = d.to(tl.int64)
    m2 = tm[:, None] & dm[None, :]
    sidx = (t // PS).to(tl.int64) * s_pg + h * s_hd
    if FROM_AMAX:
        amax = tl.load(s_base + sidx, mask=tm, other=0).to(tl.float32, bitcast=True)
        sc = tl.where(amax > 0, tl.math.div_rn(amax, qmax), 1.0)
    else:
        sc = tl.load(s_base + sidx, mask=tm, other=1.0)
    vrow = row_off(t, tm, tbl_ptr, v_st, v_sb, BS, PAGED)
    v = to_f32(tl.load(v_base + vrow[:, None] + h * v_sh + d64[None, :] * v_sd, mask=m2, other=0), V_BF16)
    q = f32_to_fp8(div_by_scale(v, sc[:, None], DIV), MANT, BIAS, MAX_BITS, SAT, HW_FP8, FINITE)
    t64 = t.to(tl.int64)
    tl.store(o_base + t64[:, None] * o_st + h * o_sh + d64[None, :] * o_sd, q, mask=m2)
    if WRITE_SCALES:
        # A row starting a group (t % PS == 0) and the group's first head column owner writes it.
        first = tm & ((t % PS) == 0)
        if SHARED_HEADS:
            first = first & ((t * 0 + h) == 0)  # vector compare: the interpreter mis-types bool & scalar
        n_el = (layer.to(tl.int64) * 0 + T) * H * D  # T may be the constexpr 1
        sbits = sc.to(tl.int32, bitcast=True)
        s_out = o_base + n_el
        if S_ALIGNED:
            tl.store(s_out.to(tl.pointer_type(tl.int32)) + sidx, sbits, mask=first)
        else:
            for j in tl.static_range(4):
                tl.store(s_out + sidx * 4 + j, ((sbits >> (8 * j)) & 0xFF).to(tl.uint8), mask=first)


@triton.jit
def _quant_1d_kernel(
    x_ptr,
    s_ptr,
    o_ptr,
    N,
    V_BF16: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_BITS: tl.constexpr,
    SAT: tl.constexpr,
    HW_FP8: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """FP8 bytes of ``x / scale`` over a flat contiguous tensor (one fp32 scale)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    x = to_f32(tl.load(x_ptr + i, mask=m, other=0), V_BF16)
    s = tl.load(s_ptr)
    tl.store(o_ptr + i, f32_to_fp8(tl.math.div_rn(x, s), MANT, BIAS, MAX_BITS, SAT, HW_FP8), mask=m)


register("_amax_tiles_kernel", _amax_tiles_kernel)
register("_quant_tiles_kernel", _quant_tiles_kernel)
register_plain("_quant_1d_kernel", _quant_1d_kernel)


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def stage1_tokens(tokens: int, heads: int, layers: int, dev: torch.device) -> int:
    """Tokens per stage-1 program: about 4 programs per SM, each a multiple of 16 tokens."""
    if STAGE1_TOKENS:
        return max(1, min(int(STAGE1_TOKENS), tokens))
    if interpreted(dev):
        return tokens
    want = 4 * sm_count(dev)
    per = max(16, -(-tokens * heads * layers // want))
    return min(tokens, -(-per // 16) * 16)


def launch_amax_tiles(
    kw: dict[str, Any], tokens: int, tt: int, block_d: int, heads: int, layers: int
) -> None:
    """Launch the stage-1 absmax kernel over TT-token tiles."""
    grid = (triton.cdiv(tokens, tt), heads, layers)
    launch_grid("_amax_tiles_kernel", tt, block_d, lambda bt: grid, kw)


def group_amax(
    v: torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    finite_only: bool = False,
) -> torch.Tensor:
    """``amax(|V|)`` per scale group, fp32 of :func:`kvcodec.numerics.scale_shape`.

    NaN propagates (a group holding NaN gives NaN, Inf gives Inf) unless
    ``finite_only`` drops non-finite values.
    """
    check_tensor3("V", v, V_DTYPES)
    scope = check_scope(scope, page_size)
    dev = check_device(v)
    t, h, d = v.shape
    shape = scale_shape(scope, t, h, page_size)
    if t == 0 or h == 0:
        return torch.zeros(shape, dtype=torch.float32, device=dev)
    per_tensor = scope == ScaleScope.PER_TENSOR
    per_page = scope == ScaleScope.PER_PAGE_HEAD
    gt = int(page_size) if per_page else t  # type: ignore[arg-type]
    n_gt = -(-t // gt)
    abits = torch.zeros((1, n_gt, 1 if per_tensor else h), dtype=torch.int32, device=dev)
    if d == 0:
        return abits.view(torch.float32).view(shape)
    block_d = pow2(d)
    tt = gt if per_page else stage1_tokens(t, h, 1, dev)
    dummy = dummy_table(dev)
    vb = bits16(v)
    rows = dense_rows(single(vb))
    kw = {
        "k_ptr": vb,
        "v_ptr": vb,
        "pay_ptr": dummy,
        "abits_ptr": abits,
        "tbl_ptr": dummy,
        "k_ltab": dummy,
        "v_ltab": dummy,
        "p_ltab": dummy,
        "T": t,
        "H": h,
        "TT": tt,
        "GT": gt,
        "n_gt": n_gt,
        "BS": 1,
        **rows.stride_args("k"),
        **rows.stride_args("v"),
        "p_sl": 0,
        "D": d,
        "KB": 0,
        "V_BF16": v.dtype == torch.bfloat16,
        "PER_TENSOR": per_tensor,
        "FINITE_ONLY": bool(finite_only),
        "PAGED": False,
        "K_TAB": 0,
        "V_TAB": 0,
        "P_TAB": 0,
        "K_ALIGNED": False,
    }
    launch_amax_tiles(kw, t, tt, block_d, h, 1)
    return abits.view(torch.float32).view(shape)


def compute_scales(
    v: torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    nonfinite: Literal["error", "saturate"] = "error",
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 scales of ``v`` for a scope, equal to the torch reference's ``compute_scales``.

    ``amax`` (from :func:`group_amax`) skips the reduction. ``nonfinite``
    as in the reference: "error" raises :class:`UnsupportedConfigError` on a
    NaN/Inf group (this syncs with the device), "saturate" scales by the
    finite values only.
    """
    check_tensor3("V", v, V_DTYPES)
    scope = check_scope(scope, page_size)
    qmax = fp8_max(fp8_dtype)
    if nonfinite not in ("error", "saturate"):
        raise UnsupportedConfigError(
            f"nonfinite must be 'error' or 'saturate'; got {nonfinite!r}", reason=Reason.BAD_VALUE
        )
    if amax is None:
        amax = group_amax(v, scope, page_size=page_size)
    if not bool(torch.isfinite(amax).all()):
        if nonfinite == "error":
            check_finite_amax(amax, scope)
        amax = group_amax(v, scope, page_size=page_size, finite_only=True)
    return amax_to_scale(amax.to(torch.float32), qmax)


def scale_strides(scope: ScaleScope, t: int, h: int, page_size: int | None) -> tuple[int, int, int]:
    """(PS, s_pg, s_hd) to index a contiguous scale tensor by (token, head)."""
    if scope == ScaleScope.PER_TENSOR:
        return max(t, 1), 0, 0
    if scope == ScaleScope.PER_LAYER_HEAD:
        return max(t, 1), 0, 1
    return int(page_size), h, 1  # type: ignore[arg-type]


def prep_scales(
    scales: torch.Tensor, scope: ScaleScope, t: int, h: int, page_size: int | None, dev: torch.device
) -> torch.Tensor:
    """The caller's scales as a contiguous fp32 tensor on ``dev`` (shape-checked)."""
    want = scale_shape(scope, t, h, page_size)
    if tuple(scales.shape) != want:
        raise UnsupportedConfigError(
            f"scales of shape {tuple(scales.shape)} do not fit scope {scope.name} over "
            f"{t} tokens x {h} heads (page_size {page_size}); expected {want}",
            reason=Reason.BAD_SCALES,
        )
    return scales.to(device=dev, dtype=torch.float32).contiguous()


def quantize(
    v: torch.Tensor,
    scales: torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 of ``v / scale`` saturated at ±fp8_max, round to nearest even (``out``: any strides)."""
    check_tensor3("V", v, V_DTYPES)
    scope = check_scope(scope, page_size)
    fp = fp8_constants(fp8_dtype)
    t, h, d = v.shape
    dev = check_device(v)
    if out is None:
        out = torch.empty((t, h, d), dtype=fp8_dtype, device=dev)
    elif tuple(out.shape) != (t, h, d) or out.dtype != fp8_dtype:
        raise UnsupportedConfigError(
            f"out is {tuple(out.shape)} {out.dtype}; expected {(t, h, d)} {fp8_dtype}",
            reason=Reason.BAD_OUTPUT,
        )
    check_device(v, out)
    s = prep_scales(scales, scope, t, h, page_size, dev)
    if v.numel() == 0:
        return out
    ps, s_pg, s_hd = scale_strides(scope, t, h, page_size)
    o8 = out.view(torch.uint8)
    dummy = dummy_table(dev)
    vs, os_ = v.stride(), o8.stride()
    kw = {
        "v_ptr": bits16(v),
        "o_ptr": o8,
        "s_ptr": s,
        "tbl_ptr": dummy,
        "v_ltab": dummy,
        "o_ltab": dummy,
        "T": t,
        "H": h,
        "PS": ps,
        "s_pg": s_pg,
        "s_hd": s_hd,
        "s_sl": 0,
        "BS": 1,
        "o_off": 0,
        "v_st": vs[0],
        "v_sh": vs[1],
        "v_sd": vs[2],
        "v_sb": 0,
        "v_sl": 0,
        "o_st": os_[0],
        "o_sh": os_[1],
        "o_sd": os_[2],
        "o_sl": 0,
        "qmax": fp.qmax,
        "D": d,
        "V_BF16": v.dtype == torch.bfloat16,
        **fp.args(),
        "FROM_AMAX": False,
        "WRITE_SCALES": False,
        "SHARED_HEADS": False,
        "PAGED": False,
        "V_TAB": 0,
        "O_TAB": 0,
        "HW_FP8": hw_fp8(dev),
        "DIV": 0,
        "FINITE": False,
        "S_ALIGNED": False,
    }
    launch_tiles("_quant_tiles_kernel", t, pow2(d), h, 1, kw)
    return out


def quantize_1d(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    out: torch.Tensor | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """FP8 of ``clamp(x / scale)`` over a flat contiguous tensor with one scale (cast tests)."""
    fp = fp8_constants(fp8_dtype)
    if x.dtype not in V_DTYPES:
        raise UnsupportedConfigError(
            f"x dtype {x.dtype} unsupported; expected one of {V_DTYPES}", reason=Reason.UNSUPPORTED_DTYPE
        )
    if not x.is_contiguous():
        raise UnsupportedConfigError("quantize_1d needs a contiguous tensor", reason=Reason.BAD_SHAPE)
    dev = check_device(x)
    s = torch.as_tensor(scale, dtype=torch.float32).to(dev).reshape(1)
    if out is None:
        out = torch.empty(x.shape, dtype=fp8_dtype, device=dev)
    elif out.shape != x.shape or out.dtype != fp8_dtype or not out.is_contiguous():
        raise UnsupportedConfigError(
            f"out must be a contiguous {fp8_dtype} tensor of shape {tuple(x.shape)}", reason=Reason.BAD_OUTPUT
        )
    n = x.numel()
    if n == 0:
        return out
    blk = block or (pow2(min(n, 1 << 17)) if interpreted(dev) else 1024)
    kw = {
        "x_ptr": bits16(x),
        "s_ptr": s,
        "o_ptr": out.view(torch.uint8),
        "N": n,
        "V_BF16": x.dtype == torch.bfloat16,
        **fp.args(),
        "HW_FP8": hw_fp8(dev),
        "BLOCK": blk,
    }
    launch(_quant_1d_kernel, (triton.cdiv(n, blk),), kw)
    return out
