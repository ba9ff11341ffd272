"""The fused kernels of the K16/V8 codec: one chunk's payload ``K ‖ FP8(V) ‖ scales`` per layer, in one launch.

Fused encode writes each layer's LMCKV payload straight into a caller's
uint8 buffer: K copied as token-major bytes of its dtype, V as FP8 bytes,
the fp32 scales little-endian. per_page_head (and per_layer_head when there
are enough groups to fill the GPU) takes one pass per group
(``_encode_groups_kernel``: absmax → scale → cast); per_tensor (and
per_layer_head otherwise) a two-stage reduction (the quantize kernels of
:mod:`.quant_triton`: atomic absmax with the K copy, then scale + cast). The
group absmax is returned so the caller can refuse NaN/Inf groups without a
device sync here. Fused decode is the dequantize kernel of
:mod:`.dequant_triton` reading the payload (scales as bytes) and copying K
out too.

:func:`encode_rows` / :func:`decode_rows` take operands as
:class:`~.operands.Rows` (dense, or paged through a block table), so the
vLLM-view launchers (:mod:`.vllm_triton`) share them. Configs come from
:func:`kvcodec.kernels.configs.choose`; on sm_89+ the FP8 conversions use
the hardware converters (bit-exact, see :mod:`.device`). Argument names: see
:mod:`.device`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import triton
import triton.language as tl

from ..errors import Reason, UnsupportedConfigError
from ..numerics import ScaleScope, scale_shape
from . import dequant_triton  # noqa: F401  (registers _dequant_tiles_kernel: the fused decode)
from .configs import pow2
from .device import abs_bits, div_by_scale, f32_to_fp8, layer_off, row_off, store_elems, to_f32
from .operands import (
    Layers,
    Rows,
    as_layers,
    bits16,
    check_device,
    check_kv_meta,
    check_payload,
    check_scope,
    check_tensor3,
    dense_rows,
    div_mode,
    dummy_table,
    fp8_constants,
    hw_bf16,
    hw_fp8,
    int_view,
    interpreted,
    k_aligned,
    out_kind,
    out_view,
    payload_aligned,
    payload_bytes,
    payload_layers,
    single,
    sm_count,
    table_args,
)
from .quant_triton import launch_amax_tiles, scale_strides, stage1_tokens
from .tiles import launch_grid, launch_tiles, register

__all__ = [
    "STRATEGIES",
    "ChunkGeometry",
    "Strategy",
    "decode_fused",
    "decode_fused_layers",
    "decode_rows",
    "encode_fused",
    "encode_fused_layers",
    "encode_rows",
]

Strategy = Literal["auto", "single", "two_stage"]
"""How encode reduces a scale group: one pass per group, or atomic absmax then cast."""
STRATEGIES = ("auto", "single", "two_stage")

GROUPS_MAXNREG = 32
"""Register cap of the one-pass encode of fp16 V (compiled CUDA): 16 programs of 4 warps per SM instead
of 12 at its natural 38-40, without spills (the kernel audit checks); bf16 V (pre-scaled division) would spill."""


# ----------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------


@triton.jit
def _encode_groups_kernel(
    k_ptr,
    v_ptr,
    pay_ptr,
    amax_ptr,
    tbl_ptr,
    k_ltab,
    v_ltab,
    p_ltab,
    T,
    H,
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
    qmax,
    D: tl.constexpr,
    KB: tl.constexpr,
    V_BF16: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_BITS: tl.constexpr,
    SAT: tl.constexpr,
    PAGED: tl.constexpr,
    K_TAB: tl.constexpr,
    V_TAB: tl.constexpr,
    P_TAB: tl.constexpr,
    K_ALIGNED: tl.constexpr,
    ONE_TILE: tl.constexpr,
    HW_FP8: tl.constexpr,
    DIV: tl.constexpr,
    S_ALIGNED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per scale group (GT tokens x one head x one layer): absmax → scale → FP8.

    Also copies the group's K rows into the payload and writes the group's
    scale bytes and absmax. ``DIV``: how ``V / scale`` is rounded
    (:func:`.device.div_by_scale`); the FP8 cast skips the NaN fix-up, since a
    group holding NaN/Inf is refused on the host (its absmax says so).
    """
    g = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2)
    k_base = k_ptr + layer_off(layer, k_ltab, k_sl, K_TAB)
    v_base = v_ptr + layer_off(layer, v_ltab, v_sl, V_TAB)
    p_base = pay_ptr + layer_off(layer, p_ltab, p_sl, P_TAB)
    n_el = (layer.to(tl.int64) * 0 + T) * H * D  # T may be the constexpr 1
    q_base = p_base + n_el * KB
    s_base = q_base + n_el
    t0 = g * GT
    t1 = tl.minimum(t0 + GT, T)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    d64 = d.to(tl.int64)
    if ONE_TILE:
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < t1
        m2 = tm[:, None] & dm[None, :]
        vrow = row_off(t, tm, tbl_ptr, v_st, v_sb, BS, PAGED)
        v = to_f32(tl.load(v_base + vrow[:, None] + h * v_sh + d64[None, :] * v_sd, mask=m2, other=0), V_BF16)
        pidx = (t.to(tl.int64)[:, None] * H + h) * D + d64[None, :]
        if KB > 0:
            krow = row_off(t, tm, tbl_ptr, k_st, k_sb, BS, PAGED)
            kv = tl.load(k_base + krow[:, None] + h * k_sh + d64[None, :] * k_sd, mask=m2, other=0)
            store_elems(p_base, pidx, kv, m2, KB, K_ALIGNED)
        amax = tl.max(tl.max(abs_bits(v, False), axis=1), axis=0).to(tl.float32, bitcast=True)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, qmax), 1.0)
        q = f32_to_fp8(div_by_scale(v, scale, DIV), MANT, BIAS, MAX_BITS, SAT, HW_FP8, True)
        tl.store(q_base + pidx, q, mask=m2)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.int32)
        for ts in range(t0, t1, BLOCK_T):
            t = ts + tl.arange(0, BLOCK_T)
            tm = t < t1
            m2 = tm[:, None] & dm[None, :]
            vrow = row_off(t, tm, tbl_ptr, v_st, v_sb, BS, PAGED)
            v = to_f32(
                tl.load(v_base + vrow[:, None] + h * v_sh + d64[None, :] * v_sd, mask=m2, other=0), V_BF16
            )
            acc = tl.maximum(acc, abs_bits(v, False))
            if KB > 0:
                pidx = (t.to(tl.int64)[:, None] * H + h) * D + d64[None, :]
                krow = row_off(t, tm, tbl_ptr, k_st, k_sb, BS, PAGED)
                kv = tl.load(k_base + krow[:, None] + h * k_sh + d64[None, :] * k_sd, mask=m2, other=0)
                store_elems(p_base, pidx, kv, m2, KB, K_ALIGNED)
        amax = tl.max(tl.max(acc, axis=1), axis=0).to(tl.float32, bitcast=True)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, qmax), 1.0)
        for ts in range(t0, t1, BLOCK_T):
            t = ts + tl.arange(0, BLOCK_T)
            tm = t < t1
            m2 = tm[:, None] & dm[None, :]
            vrow = row_off(t, tm, tbl_ptr, v_st, v_sb, BS, PAGED)
            v = to_f32(
                tl.load(v_base + vrow[:, None] + h * v_sh + d64[None, :] * v_sd, mask=m2, other=0), V_BF16
            )
            q = f32_to_fp8(div_by_scale(v, scale, DIV), MANT, BIAS, MAX_BITS, SAT, HW_FP8, True)
            pidx = (t.to(tl.int64)[:, None] * H + h) * D + d64[None, :]
            tl.store(q_base + pidx, q, mask=m2)
    gi = g * H + h
    tl.store(amax_ptr + layer.to(tl.int64) * n_gt * H + gi, amax)
    sb = scale.to(tl.int32, bitcast=True)
    if S_ALIGNED:
        tl.store(s_base.to(tl.pointer_type(tl.int32)) + gi, sb)
    else:
        j = tl.arange(0, 4)
        tl.store(s_base + gi * 4 + j, ((sb >> (j * 8)) & 0xFF).to(tl.uint8))


def _one_tile(args: dict[str, Any]) -> bool:
    return args["GT"] <= args["BLOCK_T"]


register("_encode_groups_kernel", triton.heuristics({"ONE_TILE": _one_tile})(_encode_groups_kernel))


# ----------------------------------------------------------------------------
# Launchers over rows (dense or paged)
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkGeometry:
    """What a fused launch needs besides its operands: the chunk's shape, scale groups, FP8 format, block table."""

    tokens: int
    heads: int
    dim: int
    k_bytes: int
    """Bytes per K element (the payload's K region is ``tokens * heads * dim * k_bytes`` bytes)."""
    scope: ScaleScope
    page_size: int | None
    fp8_dtype: torch.dtype
    table: torch.Tensor | None = None
    """Block ids on the device when the rows are paged (token ``t`` in block ``table[t // block_size]``)."""
    block_size: int = 1

    @property
    def payload_len(self) -> int:
        """Bytes of one layer's payload."""
        return payload_bytes(self.tokens, self.heads, self.dim, self.k_bytes, self.scope, self.page_size)


def _one_pass(g: ChunkGeometry, strategy: Strategy, layers: int, dev: torch.device) -> bool:
    """Whether the encode reduces each scale group in one program (else two stages)."""
    if g.scope == ScaleScope.PER_LAYER_HEAD:
        if strategy == "auto":
            return interpreted(dev) or (layers * g.heads >= 2 * sm_count(dev) and g.tokens <= 1024)
        return strategy == "single"
    return g.scope == ScaleScope.PER_PAGE_HEAD and strategy != "two_stage"


def encode_rows(
    k: Rows, v: Rows, pay: Layers, g: ChunkGeometry, *, v_bf16: bool, strategy: Strategy
) -> torch.Tensor:
    """Launch the fused encode over ``pay.count`` layers; return the absmax ``[L, *scale_shape]``.

    ``k`` and ``v`` must already be the kernels' views (K as same-width
    integers, bf16 V as int16 bits with ``v_bf16``).
    """
    fp = fp8_constants(g.fp8_dtype)
    layers, dev = pay.count, pay.base.device
    shape = scale_shape(g.scope, g.tokens, g.heads, g.page_size)
    if strategy not in STRATEGIES:
        raise UnsupportedConfigError(
            f"strategy must be 'auto', 'single' or 'two_stage'; got {strategy!r}", reason=Reason.BAD_VALUE
        )
    if g.tokens == 0 or g.heads == 0:
        return torch.zeros((layers, *shape), dtype=torch.float32, device=dev)
    block_d = pow2(g.dim)
    dummy = dummy_table(dev)
    tbl = dummy if g.table is None else g.table
    k_tab, k_has = table_args(k.layers, dummy)
    v_tab, v_has = table_args(v.layers, dummy)
    p_tab, p_has = table_args(pay, dummy)
    common = {
        "k_ptr": k.layers.base,
        "v_ptr": v.layers.base,
        "pay_ptr": pay.base,
        "tbl_ptr": tbl,
        "k_ltab": k_tab,
        "v_ltab": v_tab,
        "p_ltab": p_tab,
        "T": g.tokens,
        "H": g.heads,
        "BS": g.block_size,
        **k.stride_args("k"),
        **v.stride_args("v"),
        "p_sl": pay.stride,
        "D": g.dim,
        "KB": g.k_bytes,
        "V_BF16": v_bf16,
        "PAGED": g.table is not None,
        "K_TAB": k_has,
        "V_TAB": v_has,
        "P_TAB": p_has,
        "K_ALIGNED": k_aligned(pay, g.k_bytes),
    }
    n_el = g.tokens * g.heads * g.dim
    div = div_mode(torch.bfloat16 if v_bf16 else v.layers.base.dtype)
    s_aligned = payload_aligned(pay, n_el * (g.k_bytes + 1), 4)
    per_page = g.scope == ScaleScope.PER_PAGE_HEAD
    gt = int(g.page_size) if per_page else g.tokens  # type: ignore[arg-type]
    n_gt = -(-g.tokens // gt)
    if _one_pass(g, strategy, layers, dev):
        amax = torch.empty((layers, n_gt, g.heads), dtype=torch.float32, device=dev)
        common.update(
            amax_ptr=amax,
            GT=gt,
            n_gt=n_gt,
            qmax=fp.qmax,
            **fp.args(),
            HW_FP8=hw_fp8(dev),
            DIV=div,
            S_ALIGNED=s_aligned,
        )
        if div == 1 and not interpreted(dev):
            common["maxnreg"] = GROUPS_MAXNREG
        launch_grid(
            "_encode_groups_kernel", min(gt, 256), block_d, lambda bt: (n_gt, g.heads, layers), common
        )
        return amax.view(layers, *shape)

    # Two stages: atomic absmax per group (with the K copy), then scale + cast.
    per_tensor = g.scope == ScaleScope.PER_TENSOR
    hh = 1 if per_tensor else g.heads
    abits = torch.zeros((layers, n_gt, hh), dtype=torch.int32, device=dev)
    tt = gt if per_page else stage1_tokens(g.tokens, g.heads, layers, dev)
    common.update(abits_ptr=abits, TT=tt, GT=gt, n_gt=n_gt, PER_TENSOR=per_tensor, FINITE_ONLY=False)
    launch_amax_tiles(common, g.tokens, tt, block_d, g.heads, layers)
    s_pg, s_hd = (0, 0) if per_tensor else ((g.heads, 1) if per_page else (0, 1))
    kw2 = {
        "v_ptr": v.layers.base,
        "o_ptr": pay.base,
        "s_ptr": abits,
        "tbl_ptr": tbl,
        "v_ltab": v_tab,
        "o_ltab": p_tab,
        "T": g.tokens,
        "H": g.heads,
        "PS": gt,
        "s_pg": s_pg,
        "s_hd": s_hd,
        "s_sl": n_gt * hh,
        "BS": g.block_size,
        "o_off": g.tokens * g.heads * g.dim * g.k_bytes,
        **v.stride_args("v"),
        "o_st": g.heads * g.dim,
        "o_sh": g.dim,
        "o_sd": 1,
        "o_sl": pay.stride,
        "qmax": fp.qmax,
        "D": g.dim,
        "V_BF16": v_bf16,
        **fp.args(),
        "FROM_AMAX": True,
        "WRITE_SCALES": True,
        "SHARED_HEADS": per_tensor,
        "PAGED": g.table is not None,
        "V_TAB": v_has,
        "O_TAB": p_has,
        "HW_FP8": hw_fp8(dev),
        "DIV": div,
        "FINITE": True,
        "S_ALIGNED": s_aligned,
    }
    launch_tiles("_quant_tiles_kernel", g.tokens, block_d, g.heads, layers, kw2)
    return abits.view(torch.float32).view(layers, *shape)


def decode_rows(pay: Layers, ko: Rows, vo: Rows, g: ChunkGeometry, *, out_kind: int) -> None:
    """Launch the fused decode over ``pay.count`` layers (outputs already in the kernels' views)."""
    fp = fp8_constants(g.fp8_dtype)
    if g.tokens == 0 or g.heads == 0 or g.dim == 0:
        return
    dev = pay.base.device
    ps, s_pg, s_hd = scale_strides(g.scope, g.tokens, g.heads, g.page_size)
    n_el = g.tokens * g.heads * g.dim
    dummy = dummy_table(dev)
    q_tab, q_has = table_args(pay, dummy)
    vo_tab, vo_has = table_args(vo.layers, dummy)
    ko_tab, ko_has = table_args(ko.layers, dummy)
    kw = {
        "q_ptr": pay.base,
        "s_ptr": dummy,
        "vo_ptr": vo.layers.base,
        "ko_ptr": ko.layers.base,
        "tbl_ptr": dummy if g.table is None else g.table,
        "q_ltab": q_tab,
        "vo_ltab": vo_tab,
        "ko_ltab": ko_tab,
        "T": g.tokens,
        "H": g.heads,
        "PS": ps,
        "s_pg": s_pg,
        "s_hd": s_hd,
        "s_off": n_el,
        "s_sl": 0,
        "BS": g.block_size,
        "q_off": n_el * g.k_bytes,
        "q_st": g.heads * g.dim,
        "q_sh": g.dim,
        "q_sd": 1,
        "q_sl": pay.stride,
        **vo.stride_args("vo"),
        **ko.stride_args("ko"),
        "D": g.dim,
        "KB": g.k_bytes,
        "MANT": fp.mant,
        "BIAS": fp.bias,
        "OUT_KIND": out_kind,
        "SCALE_BYTES": True,
        "K_ALIGNED": k_aligned(pay, g.k_bytes),
        "PAGED": g.table is not None,
        "Q_TAB": q_has,
        "VO_TAB": vo_has,
        "KO_TAB": ko_has,
        "HW_FP8": hw_fp8(dev),
        "S_ALIGNED": payload_aligned(pay, n_el * (g.k_bytes + 1), 4),
        "HW_BF16": hw_bf16(dev),
    }
    launch_tiles("_dequant_tiles_kernel", g.tokens, pow2(g.dim), g.heads, pay.count, kw)


# ----------------------------------------------------------------------------
# Public launchers over [T, H, D] tensors
# ----------------------------------------------------------------------------


def encode_fused(
    k: torch.Tensor,
    v: torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    payload: torch.Tensor,
    strategy: Strategy = "auto",
) -> torch.Tensor:
    """Write one chunk's payload ``K ‖ FP8(V) ‖ scales`` into ``payload``; return the group absmax.

    ``payload`` is a 1-D uint8 tensor of exactly :func:`~.operands.payload_nbytes` bytes
    (any alignment). The returned fp32 absmax has the scale shape; NaN/Inf
    there means the group holds NaN/Inf (its scale is then not meaningful).
    Nothing here syncs with the device.
    """
    check_kv_meta(tuple(k.shape), tuple(v.shape), k.dtype, v.dtype)
    scope = check_scope(scope, page_size)
    check_device(k, v, payload)
    g = ChunkGeometry(*v.shape, k.element_size(), scope, page_size, fp8_dtype)
    check_payload(payload, g.payload_len)
    amax = encode_rows(
        dense_rows(single(int_view(k))),
        dense_rows(single(bits16(v))),
        single(payload),
        g,
        v_bf16=v.dtype == torch.bfloat16,
        strategy=strategy,
    )
    return amax[0]


def encode_fused_layers(
    ks: Sequence[torch.Tensor] | torch.Tensor,
    vs: Sequence[torch.Tensor] | torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    payloads: Sequence[torch.Tensor] | torch.Tensor,
    strategy: Strategy = "auto",
) -> torch.Tensor:
    """:func:`encode_fused` over L layers in one launch (two for two-stage scopes).

    ``ks``/``vs``: lists of same-shaped ``[T, H, D]`` tensors or stacked
    ``[L, T, H, D]``; ``payloads``: one 1-D uint8 tensor per layer (or a
    stacked ``[L, nbytes]``). Stacked tensors (or evenly spaced layers) cost
    no host work per layer; other separate allocations are addressed through
    a small device offset table. Returns the absmax as ``[L, *scale_shape]``.
    """
    kl, kshape, kst, kdt, _ = as_layers(ks, "K layers", "k")
    vl, vshape, vst, vdt, _ = as_layers(vs, "V layers", "v")
    check_kv_meta(kshape, vshape, kdt, vdt)
    scope = check_scope(scope, page_size)
    g = ChunkGeometry(*vshape, kdt.itemsize, scope, page_size, fp8_dtype)
    pl = payload_layers(payloads, g.payload_len)
    check_device(kl.base, vl.base, pl.base)
    if not kl.count == vl.count == pl.count:
        raise UnsupportedConfigError(
            f"{kl.count} K, {vl.count} V and {pl.count} payloads: counts differ", reason=Reason.BAD_OUTPUT
        )
    return encode_rows(
        dense_rows(kl, kst), dense_rows(vl, vst), pl, g, v_bf16=vdt == torch.bfloat16, strategy=strategy
    )


def decode_fused(
    payload: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> None:
    """Decode one chunk's payload into ``k_out`` (K's dtype) and ``v_out`` (fp16/bf16/fp32).

    Shapes ``[T, H, D]``, any strides; the payload layout is :func:`encode_fused`'s.
    """
    check_tensor3("k_out", k_out)
    check_tensor3("v_out", v_out)
    if k_out.shape != v_out.shape:
        raise UnsupportedConfigError(
            f"k_out {tuple(k_out.shape)} and v_out {tuple(v_out.shape)} differ", reason=Reason.BAD_OUTPUT
        )
    scope = check_scope(scope, page_size)
    check_device(payload, k_out, v_out)
    g = ChunkGeometry(*v_out.shape, k_out.element_size(), scope, page_size, fp8_dtype)
    check_payload(payload, g.payload_len)
    vov, kind = out_view(v_out)
    decode_rows(
        single(payload), dense_rows(single(int_view(k_out))), dense_rows(single(vov)), g, out_kind=kind
    )


def decode_fused_layers(
    payloads: Sequence[torch.Tensor] | torch.Tensor,
    k_outs: Sequence[torch.Tensor] | torch.Tensor,
    v_outs: Sequence[torch.Tensor] | torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> None:
    """:func:`decode_fused` over L layers in one launch (lists or stacked tensors)."""
    kl, kshape, kst, kdt, _ = as_layers(k_outs, "K outputs", "k")
    vl, vshape, vst, vdt, _ = as_layers(v_outs, "V outputs", "v")
    if len(kshape) != 3 or kshape != vshape:
        raise UnsupportedConfigError(
            f"k_out {kshape} and v_out {vshape} must be same-shaped [T, H, D]", reason=Reason.BAD_OUTPUT
        )
    kind = out_kind(vdt)
    scope = check_scope(scope, page_size)
    g = ChunkGeometry(*vshape, kdt.itemsize, scope, page_size, fp8_dtype)
    pl = payload_layers(payloads, g.payload_len)
    check_device(pl.base, kl.base, vl.base)
    if not kl.count == vl.count == pl.count:
        raise UnsupportedConfigError(
            f"{pl.count} payloads, {kl.count} K and {vl.count} V outputs: counts differ",
            reason=Reason.BAD_OUTPUT,
        )
    decode_rows(pl, dense_rows(kl, kst), dense_rows(vl, vst), g, out_kind=kind)
