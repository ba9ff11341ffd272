"""The dequantize kernel of the K16/V8 codec and its unfused launcher, bit-exact with the torch reference.

* ``_dequant_tiles_kernel``: ``float(q) * scale`` to fp16/bf16/fp32 for a
  token tile x one head; also the fused decode of :mod:`.fused_triton`
  (scales read as payload bytes, K copied out of the payload).

:func:`dequantize` shares the reference's semantics
(:mod:`kvcodec.backends.reference`) and the scale groups and argument
checks of the quantize launchers (:mod:`.quant_triton`). Inputs and outputs
are ``[tokens, heads, head_dim]`` tensors of any strides; offsets are int64.
Argument names: see :mod:`kvcodec.kernels.device`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import Reason, UnsupportedConfigError
from ..numerics import ScaleScope
from .configs import pow2
from .device import bf16_bits_rne, fp8_to_f32, layer_off, load_elems, row_off
from .operands import (
    check_device,
    check_fp8,
    check_scope,
    check_tensor3,
    dummy_table,
    fp8_constants,
    hw_bf16,
    hw_fp8,
    out_view,
)
from .quant_triton import prep_scales, scale_strides
from .tiles import launch_tiles, register

__all__ = ["dequantize"]


@triton.jit
def _dequant_tiles_kernel(
    q_ptr,
    s_ptr,
    vo_ptr,
    ko_ptr,
    tbl_ptr,
    q_ltab,
    vo_ltab,
    ko_ltab,
    T,
    H,
    PS,
    s_pg,
    s_hd,
    s_off,
    s_sl,
    BS: tl.constexpr,
    q_off,
    q_st,
    q_sh,
    q_sd,
    q_sl,
    vo_st,
    vo_sh,
    vo_sd,
    vo_sb,
    vo_sl,
    ko_st,
    ko_sh,
    ko_sd,
    ko_sb,
    ko_sl,
    D: tl.constexpr,
    KB: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    OUT_KIND: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    K_ALIGNED: tl.constexpr,
    PAGED: tl.constexpr,
    Q_TAB: tl.constexpr,
    VO_TAB: tl.constexpr,
    KO_TAB: tl.constexpr,
    HW_FP8: tl.constexpr,
    S_ALIGNED: tl.constexpr,
    HW_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``float(q) * scale`` cast to the output dtype for BLOCK_T tokens x one head.

    ``q`` is FP8 bytes (payload V region or any strided tensor); scales are
    fp32 (``SCALE_BYTES``: little-endian bytes at ``q + s_off``); ``q`` starts
    ``q_off`` bytes past ``q_ptr``. With ``KB > 0`` the payload's K bytes at
    ``q_ptr`` are copied out too.
    ``OUT_KIND``: 0 fp32, 1 fp16, 2 bf16 (stored as int16 bits; ``HW_BF16``: rounded by the
    hardware convert, else by integer ops: the same bits for every non-NaN value).
    """
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2)
    p_base = q_ptr + layer_off(layer, q_ltab, q_sl, Q_TAB)
    q_base = p_base + q_off
    vo_base = vo_ptr + layer_off(layer, vo_ltab, vo_sl, VO_TAB)
    t = i * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    d64 = d.to(tl.int64)
    m2 = tm[:, None] & dm[None, :]
    t64 = t.to(tl.int64)
    sidx = (t // PS).to(tl.int64) * s_pg + h * s_hd
    if SCALE_BYTES:
        sb_base = q_base + s_off
        if S_ALIGNED:
            sbits = tl.load(sb_base.to(tl.pointer_type(tl.int32)) + sidx, mask=tm, other=0)
        else:
            sbits = tl.load(sb_base + sidx * 4, mask=tm, other=0).to(tl.int32)
            for j in tl.static_range(1, 4):
                sbits = sbits | (tl.load(sb_base + sidx * 4 + j, mask=tm, other=0).to(tl.int32) << (8 * j))
        sc = sbits.to(tl.float32, bitcast=True)
    else:
        sc = tl.load(s_ptr + layer.to(tl.int64) * s_sl + sidx, mask=tm, other=1.0)
    qb = tl.load(q_base + t64[:, None] * q_st + h * q_sh + d64[None, :] * q_sd, mask=m2, other=0)
    x = fp8_to_f32(qb, MANT, BIAS, HW_FP8) * sc[:, None]
    vrow = row_off(t, tm, tbl_ptr, vo_st, vo_sb, BS, PAGED)
    vo = vo_base + vrow[:, None] + h * vo_sh + d64[None, :] * vo_sd
    if OUT_KIND == 0:
        tl.store(vo, x, mask=m2)
    elif OUT_KIND == 1:
        tl.store(vo, x.to(tl.float16), mask=m2)
    elif HW_BF16:
        tl.store(vo, x.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=m2)
    else:
        tl.store(vo, bf16_bits_rne(x), mask=m2)
    if KB > 0:
        ko_base = ko_ptr + layer_off(layer, ko_ltab, ko_sl, KO_TAB)
        pidx = (t64[:, None] * H + h) * D + d64[None, :]
        kv = load_elems(p_base, pidx, m2, KB, K_ALIGNED)
        krow = row_off(t, tm, tbl_ptr, ko_st, ko_sb, BS, PAGED)
        tl.store(ko_base + krow[:, None] + h * ko_sh + d64[None, :] * ko_sd, kv, mask=m2)


register("_dequant_tiles_kernel", _dequant_tiles_kernel)


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    out_dtype: torch.dtype = torch.float16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``float(q) * scale`` cast to ``out_dtype`` (or written into ``out``, any strides)."""
    check_tensor3("q", q)
    check_fp8(q)
    scope = check_scope(scope, page_size)
    fp = fp8_constants(q.dtype)
    t, h, d = q.shape
    dev = check_device(q)
    if out is None:
        out = torch.empty((t, h, d), dtype=out_dtype, device=dev)
    elif tuple(out.shape) != (t, h, d):
        raise UnsupportedConfigError(
            f"out is {tuple(out.shape)}; expected {(t, h, d)}", reason=Reason.BAD_OUTPUT
        )
    check_device(q, out)
    s = prep_scales(scales, scope, t, h, page_size, dev)
    if q.numel() == 0:
        return out
    ov, kind = out_view(out)
    ps, s_pg, s_hd = scale_strides(scope, t, h, page_size)
    q8 = q.view(torch.uint8)
    dummy = dummy_table(dev)
    qs, vos = q8.stride(), ov.stride()
    kw = {
        "q_ptr": q8,
        "s_ptr": s,
        "vo_ptr": ov,
        "ko_ptr": dummy,
        "tbl_ptr": dummy,
        "q_ltab": dummy,
        "vo_ltab": dummy,
        "ko_ltab": dummy,
        "T": t,
        "H": h,
        "PS": ps,
        "s_pg": s_pg,
        "s_hd": s_hd,
        "s_off": 0,
        "s_sl": 0,
        "BS": 1,
        "q_off": 0,
        "q_st": qs[0],
        "q_sh": qs[1],
        "q_sd": qs[2],
        "q_sl": 0,
        "vo_st": vos[0],
        "vo_sh": vos[1],
        "vo_sd": vos[2],
        "vo_sb": 0,
        "vo_sl": 0,
        "ko_st": 0,
        "ko_sh": 0,
        "ko_sd": 0,
        "ko_sb": 0,
        "ko_sl": 0,
        "D": d,
        "KB": 0,
        "MANT": fp.mant,
        "BIAS": fp.bias,
        "OUT_KIND": kind,
        "SCALE_BYTES": False,
        "K_ALIGNED": False,
        "PAGED": False,
        "Q_TAB": 0,
        "VO_TAB": 0,
        "KO_TAB": 0,
        "HW_FP8": hw_fp8(dev),
        "S_ALIGNED": False,
        "HW_BF16": hw_bf16(dev),
    }
    launch_tiles("_dequant_tiles_kernel", t, pow2(d), h, 1, kw)
    return out
