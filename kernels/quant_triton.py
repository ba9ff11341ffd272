"""Triton kernels of the K16/V8 codec, bit-exact with :mod:`kvcodec.quant`.

Launchers sit beside their kernels and share the reference's semantics and
signatures. Inputs are ``[tokens, heads, head_dim]`` tensors of any strides
(never copied to contiguous); offsets are int64, so pools above 2^31 elements
work. Scale groups: whole tensor, one head, or one page x one head (a partial
last page over the tokens it holds).

Fused encode writes a chunk's LMCKV payload ``K ‖ V ‖ scales`` straight into
a caller's uint8 buffer: K copied as token-major bytes of its dtype, V as FP8
bytes, the fp32 scales little-endian. per_page_head (and per_layer_head when
there are enough groups to fill the GPU) takes one pass per group (absmax →
scale → cast); per_tensor (and per_layer_head otherwise) a two-stage
reduction (atomic absmax, then scale + cast). The group absmax is returned
so the caller can refuse NaN/Inf groups without a device sync here.

Launch configs come from the tuning file ``kvcodec tune`` writes (for this
GPU, Triton version, kernel and shape), else from a heuristic; launchers
autotune only when asked (``KVCODEC_AUTOTUNE=1`` or :data:`AUTOTUNE` = True),
never by default in a serving process. On sm_89+ the FP8 conversions use the
hardware converters (bit-exact, see :mod:`kvcodec.kernels._tl`); the integer
emulation serves sm_80 and the interpreter. Every CUDA launch pins
``enable_fp_fusion=False``.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import triton
import triton.language as tl

from ..errors import UnsupportedConfigError
from ..format import ScaleScope
from ..numerics import FP8_DTYPES, fp8_max, scale_shape
from . import _configs
from ._configs import TileConfig, pow2
from ._launch import INTERPRET, current_target, is_recording, launch
from ._tl import (
    abs_bits,
    bf16_bits_rne,
    f32_to_fp8,
    fp8_to_f32,
    layer_off,
    load_elems,
    row_off,
    store_elems,
    to_f32,
)

__all__ = [
    "AUTOTUNE",
    "INTERPRET",
    "Strategy",
    "compute_scales",
    "decode_fused",
    "decode_fused_layers",
    "dequantize",
    "empty_payloads",
    "encode_fused",
    "encode_fused_layers",
    "group_amax",
    "payload_nbytes",
    "payload_stride",
    "quantize",
    "quantize_1d",
    "scales_from_amax",
]

AUTOTUNE: bool | None = None
"""Autotune launch configs: None reads ``KVCODEC_AUTOTUNE`` (default off: tuning file or heuristic)."""

STAGE1_TOKENS: int | None = None
"""Tokens per stage-1 (absmax) program of two-stage reductions; None picks by GPU size."""

Strategy = Literal["auto", "single", "two_stage"]
"""How encode reduces a scale group: one pass per group, or atomic absmax then cast."""

V_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
K_ELEM_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_SCOPES = (ScaleScope.PER_TENSOR, ScaleScope.PER_LAYER_HEAD, ScaleScope.PER_PAGE_HEAD)
PAYLOAD_ALIGN = 16
"""Bytes a stacked payload row is padded to (:func:`empty_payloads`): 128-bit accesses in every layer."""


# ----------------------------------------------------------------------------
# Host-side helpers
# ----------------------------------------------------------------------------


def _autotune_enabled() -> bool:
    if AUTOTUNE is not None:
        return bool(AUTOTUNE)
    env = os.environ.get("KVCODEC_AUTOTUNE")
    if env is not None and env.strip() != "":
        return env.strip().lower() not in ("0", "false", "no", "off")
    return False


@dataclass(frozen=True)
class _Fp8:
    """FP8 format constants the kernels take as constexprs."""

    mant: int
    bias: int
    max_bits: int
    sat: int
    qmax: float


@functools.lru_cache(maxsize=8)
def _fp8_params(dtype: torch.dtype) -> _Fp8:
    qmax = fp8_max(dtype)  # raises on a non-FP8 dtype
    max_bits = struct.unpack("<i", struct.pack("<f", qmax))[0]
    if dtype == torch.float8_e4m3fn:
        return _Fp8(3, 7, max_bits, 0x7E, qmax)
    return _Fp8(2, 15, max_bits, 0x7B, qmax)


def _check_scope(scope: ScaleScope, page_size: int | None) -> ScaleScope:
    try:
        scope = ScaleScope(scope)
    except ValueError:
        raise UnsupportedConfigError(f"unknown scale scope {scope!r}") from None
    if scope not in _SCOPES:
        raise UnsupportedConfigError(f"scope {scope.name} has no computed scales")
    if scope == ScaleScope.PER_PAGE_HEAD and (not page_size or page_size < 1):
        raise UnsupportedConfigError(f"per_page_head needs page_size >= 1; got {page_size}")
    return scope


def _check_device(*ts: torch.Tensor) -> torch.device:
    dev = ts[0].device
    for t in ts[1:]:
        if t.device != dev:
            raise UnsupportedConfigError(f"tensors on different devices: {dev} and {t.device}")
    if dev.type == "cpu" and not INTERPRET and not is_recording():
        raise UnsupportedConfigError(
            "Triton kernels need GPU tensors; for CPU tensors set TRITON_INTERPRET=1 "
            "before kvcodec.kernels is imported"
        )
    return dev


def _check_tensor3(name: str, x: torch.Tensor, dtypes: Sequence[torch.dtype] | None = None) -> None:
    if x.dim() != 3:
        raise UnsupportedConfigError(f"expected {name} as [tokens, heads, head_dim]; got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise UnsupportedConfigError(f"{name} dtype {x.dtype} unsupported; expected one of {tuple(dtypes)}")


def _sm_count(dev: torch.device) -> int:
    return current_target(dev).sm_count


def _interp(dev: torch.device) -> bool:
    """True when launches on ``dev`` are planned for the interpreter."""
    return current_target(dev).interpret


def _hw_fp8(dev: torch.device) -> bool:
    """Use the hardware FP8 converters (sm_89+; ``KVCODEC_HW_FP8=0`` turns them off)."""
    return current_target(dev).hw_fp8


_pow2 = pow2
_run = launch


_DUMMY: dict[torch.device, torch.Tensor] = {}


def _dummy_table(dev: torch.device) -> torch.Tensor:
    """A tiny int64 tensor standing in for unused pointer arguments (cached per device)."""
    t = _DUMMY.get(dev)
    if t is None:
        t = _DUMMY[dev] = torch.zeros(1, dtype=torch.int64, device=dev)
    return t


def _bits16(x: torch.Tensor) -> torch.Tensor:
    """bf16 as its int16 bits (kernels widen it by a shift); other dtypes unchanged."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _int_view(x: torch.Tensor) -> torch.Tensor:
    """Same-width integer view of ``x`` (bits move unchanged through kernels)."""
    try:
        return x.view(K_ELEM_VIEW[x.element_size()])
    except KeyError:
        raise UnsupportedConfigError(f"dtype {x.dtype} of {x.element_size()} bytes unsupported") from None


@dataclass
class _Layers:
    """Per-layer addressing of same-shaped tensors: base tensor plus stride or offset table."""

    base: torch.Tensor
    stride: int
    table: torch.Tensor | None
    count: int
    offsets: tuple[int, ...] = ()
    """Host copy of the table's element offsets (no device sync to inspect them)."""
    mult: int = 1
    """Every table offset is a multiple of this many elements (16 bytes' worth when possible)."""


def _stacked(x: torch.Tensor, view: torch.dtype | None = None) -> _Layers:
    """Addressing of a stacked ``[L, ...]`` tensor (layer = dim 0; the tensor itself is the pointer)."""
    base = x if view is None else x.view(view)
    return _Layers(base, x.stride(0) if x.shape[0] > 1 else 0, None, x.shape[0])


def _listed(xs: Sequence[torch.Tensor], view: torch.dtype | None = None) -> _Layers:
    """Addressing of separate same-shaped tensors: uniform stride if possible, else an offset table."""
    base = xs[0] if view is None else xs[0].view(view)
    es = base.element_size()
    p0 = base.data_ptr()
    offs = []
    for x in xs:
        d = x.data_ptr() - p0
        if d % es:
            raise UnsupportedConfigError("layer tensors are not aligned to their element size")
        offs.append(d // es)
    if len(offs) == 1:
        return _Layers(base, 0, None, 1)
    step = offs[1]
    if all(o == i * step for i, o in enumerate(offs)):
        return _Layers(base, step, None, len(offs))
    table = torch.tensor(offs, dtype=torch.int64).to(base.device, non_blocking=True)
    vec = max(1, PAYLOAD_ALIGN // es)
    mult = vec if all(o % vec == 0 for o in offs) else 1
    return _Layers(base, 0, table, len(offs), tuple(offs), mult)


def _same_layout(xs: Sequence[torch.Tensor], what: str) -> None:
    x0 = xs[0]
    for x in xs[1:]:
        if x.shape != x0.shape or x.stride() != x0.stride() or x.dtype != x0.dtype or x.device != x0.device:
            raise UnsupportedConfigError(
                f"all {what} must share shape, strides, dtype and device; got {tuple(x0.shape)}/"
                f"{x0.stride()}/{x0.dtype} and {tuple(x.shape)}/{x.stride()}/{x.dtype}"
            )


def payload_nbytes(k: torch.Tensor, v: torch.Tensor, scope: ScaleScope, page_size: int | None = None) -> int:
    """Bytes of the LMCKV payload ``K ‖ V(FP8) ‖ scales(fp32)`` of one ``[T, H, D]`` chunk."""
    t, h, _ = v.shape
    return k.numel() * k.element_size() + v.numel() + 4 * _n_scales(scope, t, h, page_size)


def empty_payloads(layers: int, nbytes: int, device: torch.device | str) -> torch.Tensor:
    """Uninitialised stacked payloads ``[layers, nbytes]`` whose rows start 16 bytes apart.

    The rows of a plain ``torch.empty((layers, nbytes))`` are only as aligned
    as ``nbytes`` (per_tensor payloads end in 4 scale bytes), which forces
    byte-wide accesses in every layer after the first; padding each row to
    :data:`PAYLOAD_ALIGN` bytes keeps the fused kernels' 128-bit accesses.
    """
    stride = payload_stride(nbytes)
    return torch.empty((int(layers), stride), dtype=torch.uint8, device=device)[:, : int(nbytes)]


def payload_stride(nbytes: int) -> int:
    """Bytes between stacked payload rows of ``nbytes``: rounded up to :data:`PAYLOAD_ALIGN`."""
    return -(-max(int(nbytes), 1) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def scales_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """``amax / fp8_max`` in fp32 (IEEE division), 1.0 where ``amax`` is 0 (or NaN)."""
    qmax = fp8_max(fp8_dtype)
    amax = amax.to(torch.float32)
    scale = torch.div(amax, torch.tensor(qmax, dtype=torch.float32, device=amax.device))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _encode_groups_kernel(
    k_ptr, v_ptr, pay_ptr, amax_ptr, tbl_ptr, k_ltab, v_ltab, p_ltab,
    T, H, GT, n_gt, BS,
    k_st, k_sh, k_sd, k_sb, k_sl,
    v_st, v_sh, v_sd, v_sb, v_sl,
    p_sl,
    qmax,
    D: tl.constexpr, KB: tl.constexpr, V_BF16: tl.constexpr,
    MANT: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr, SAT: tl.constexpr,
    PAGED: tl.constexpr, K_TAB: tl.constexpr, V_TAB: tl.constexpr, P_TAB: tl.constexpr,
    K_ALIGNED: tl.constexpr, ONE_TILE: tl.constexpr, HW_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per scale group (GT tokens x one head x one layer): absmax → scale → FP8.

    Also copies the group's K rows into the payload and writes the group's
    scale bytes and absmax.
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
        q = f32_to_fp8(tl.math.div_rn(v, scale), MANT, BIAS, MAX_BITS, SAT, HW_FP8)
        tl.store(q_base + pidx, q, mask=m2)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.int32)
        for ts in range(t0, t1, BLOCK_T):
            t = ts + tl.arange(0, BLOCK_T)
            tm = t < t1
            m2 = tm[:, None] & dm[None, :]
            vrow = row_off(t, tm, tbl_ptr, v_st, v_sb, BS, PAGED)
            v = to_f32(tl.load(v_base + vrow[:, None] + h * v_sh + d64[None, :] * v_sd, mask=m2, other=0), V_BF16)
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
            v = to_f32(tl.load(v_base + vrow[:, None] + h * v_sh + d64[None, :] * v_sd, mask=m2, other=0), V_BF16)
            q = f32_to_fp8(tl.math.div_rn(v, scale), MANT, BIAS, MAX_BITS, SAT, HW_FP8)
            pidx = (t.to(tl.int64)[:, None] * H + h) * D + d64[None, :]
            tl.store(q_base + pidx, q, mask=m2)
    gi = g * H + h
    tl.store(amax_ptr + layer.to(tl.int64) * n_gt * H + gi, amax)
    j = tl.arange(0, 4)
    sb = scale.to(tl.int32, bitcast=True)
    tl.store(s_base + gi * 4 + j, ((sb >> (j * 8)) & 0xFF).to(tl.uint8))


@triton.jit
def _amax_tiles_kernel(
    k_ptr, v_ptr, pay_ptr, abits_ptr, tbl_ptr, k_ltab, v_ltab, p_ltab,
    T, H, TT, GT, n_gt, BS,
    k_st, k_sh, k_sd, k_sb, k_sl,
    v_st, v_sh, v_sd, v_sb, v_sl,
    p_sl,
    D: tl.constexpr, KB: tl.constexpr, V_BF16: tl.constexpr, PER_TENSOR: tl.constexpr,
    FINITE_ONLY: tl.constexpr,
    PAGED: tl.constexpr, K_TAB: tl.constexpr, V_TAB: tl.constexpr, P_TAB: tl.constexpr,
    K_ALIGNED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
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
    v_ptr, o_ptr, s_ptr, tbl_ptr, v_ltab, o_ltab,
    T, H, PS, s_pg, s_hd, s_sl, BS, o_off,
    v_st, v_sh, v_sd, v_sb, v_sl,
    o_st, o_sh, o_sd, o_sl,
    qmax,
    D: tl.constexpr, V_BF16: tl.constexpr,
    MANT: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr, SAT: tl.constexpr,
    FROM_AMAX: tl.constexpr, WRITE_SCALES: tl.constexpr, SHARED_HEADS: tl.constexpr,
    PAGED: tl.constexpr, V_TAB: tl.constexpr, O_TAB: tl.constexpr, HW_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
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
    q = f32_to_fp8(tl.math.div_rn(v, sc[:, None]), MANT, BIAS, MAX_BITS, SAT, HW_FP8)
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
        for j in tl.static_range(4):
            tl.store(s_out + sidx * 4 + j, ((sbits >> (8 * j)) & 0xFF).to(tl.uint8), mask=first)


@triton.jit
def _dequant_tiles_kernel(
    q_ptr, s_ptr, vo_ptr, ko_ptr, tbl_ptr, q_ltab, vo_ltab, ko_ltab,
    T, H, PS, s_pg, s_hd, s_off, s_sl, BS, q_off,
    q_st, q_sh, q_sd, q_sl,
    vo_st, vo_sh, vo_sd, vo_sb, vo_sl,
    ko_st, ko_sh, ko_sd, ko_sb, ko_sl,
    D: tl.constexpr, KB: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    OUT_KIND: tl.constexpr, SCALE_BYTES: tl.constexpr, K_ALIGNED: tl.constexpr,
    PAGED: tl.constexpr, Q_TAB: tl.constexpr, VO_TAB: tl.constexpr, KO_TAB: tl.constexpr,
    HW_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``float(q) * scale`` cast to the output dtype for BLOCK_T tokens x one head.

    ``q`` is FP8 bytes (payload V region or any strided tensor); scales are
    fp32 (``SCALE_BYTES``: little-endian bytes at ``q + s_off``); ``q`` starts
    ``q_off`` bytes past ``q_ptr``. With ``KB > 0`` the payload's K bytes at
    ``q_ptr`` are copied out too.
    ``OUT_KIND``: 0 fp32, 1 fp16, 2 bf16 (stored as int16 bits).
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
    else:
        tl.store(vo, bf16_bits_rne(x), mask=m2)
    if KB > 0:
        ko_base = ko_ptr + layer_off(layer, ko_ltab, ko_sl, KO_TAB)
        pidx = (t64[:, None] * H + h) * D + d64[None, :]
        kv = load_elems(p_base, pidx, m2, KB, K_ALIGNED)
        krow = row_off(t, tm, tbl_ptr, ko_st, ko_sb, BS, PAGED)
        tl.store(ko_base + krow[:, None] + h * ko_sh + d64[None, :] * ko_sd, kv, mask=m2)


@triton.jit
def _quant_1d_kernel(
    x_ptr, s_ptr, o_ptr, N,
    V_BF16: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr, SAT: tl.constexpr,
    HW_FP8: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """FP8 bytes of ``x / scale`` over a flat contiguous tensor (one fp32 scale)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    x = to_f32(tl.load(x_ptr + i, mask=m, other=0), V_BF16)
    s = tl.load(s_ptr)
    tl.store(o_ptr + i, f32_to_fp8(tl.math.div_rn(x, s), MANT, BIAS, MAX_BITS, SAT, HW_FP8), mask=m)


# ----------------------------------------------------------------------------
# Autotuning wrappers
# ----------------------------------------------------------------------------


def _tile_configs(max_bt: int = 256) -> list[triton.Config]:
    """Every (BLOCK_T, num_warps) the autotuner may see; :func:`_prune_tiles` keeps the worthwhile ones."""
    return [
        triton.Config({"BLOCK_T": bt}, num_warps=nw)
        for bt in _configs.BLOCK_TS
        if bt <= max_bt
        for nw in _configs.WARPS
    ]


def _rows_of(args: dict[str, Any]) -> int:
    """Token rows one program covers: TT (stage-1 absmax), GT (one group), else all T."""
    for name in ("TT", "GT", "T"):
        if name in args:
            return int(args[name])
    return 1


def _prune_tiles(
    configs: list[triton.Config], named_args: dict[str, Any], kernel: str = "", **kwargs: Any
) -> list[triton.Config]:
    """Keep :func:`kvcodec.kernels._configs.config_space` (no mostly-masked or spilling tiles)."""
    args = {**named_args, **kwargs}
    bd = int(args.get("BLOCK_D", 128))
    allowed = set(_configs.config_space(_rows_of(args), bd, kernel))
    keep = [c for c in configs if TileConfig(c.kwargs["BLOCK_T"], c.num_warps) in allowed]
    if keep:
        return keep
    h = _configs.heuristic(_rows_of(args), bd)
    return [triton.Config({"BLOCK_T": h.block_t}, num_warps=h.num_warps)]


def _one_tile(args: dict[str, Any]) -> bool:
    return args["GT"] <= args["BLOCK_T"]


def _tuned(fn: Any, name: str) -> Any:
    """``fn`` autotuned over :func:`_tile_configs`, pruned to ``name``'s config space."""
    prune = functools.partial(_prune_tiles, kernel=name)
    key = list(_configs.KEY_FIELDS[name])
    return triton.autotune(configs=_tile_configs(), key=key, prune_configs_by={"early_config_prune": prune})(fn)


_encode_groups_heur = triton.heuristics({"ONE_TILE": _one_tile})(_encode_groups_kernel)
_encode_groups_tuned = _tuned(_encode_groups_heur, "_encode_groups_kernel")
_amax_tiles_tuned = _tuned(_amax_tiles_kernel, "_amax_tiles_kernel")
_quant_tiles_tuned = _tuned(_quant_tiles_kernel, "_quant_tiles_kernel")
_dequant_tiles_tuned = _tuned(_dequant_tiles_kernel, "_dequant_tiles_kernel")

KERNELS: dict[str, tuple[Any, Any]] = {
    "_encode_groups_kernel": (_encode_groups_heur, _encode_groups_tuned),
    "_amax_tiles_kernel": (_amax_tiles_kernel, _amax_tiles_tuned),
    "_quant_tiles_kernel": (_quant_tiles_kernel, _quant_tiles_tuned),
    "_dequant_tiles_kernel": (_dequant_tiles_kernel, _dequant_tiles_tuned),
}
"""Tile kernels by name: (launched with a fixed config, autotuned). paged_triton adds its copy kernel."""


def _kw_device(kw: dict[str, Any]) -> torch.device:
    return next(v.device for v in kw.values() if isinstance(v, torch.Tensor))


def pick_config(name: str, kw: dict[str, Any], rows: int, block_d: int, dev: torch.device) -> TileConfig:
    """The launch config: the tuning file's winner for this GPU and shape, else the heuristic."""
    tgt = current_target(dev)
    cfg = _configs.overridden(name)
    if cfg is None and not tgt.interpret and tgt.name:
        cfg = _configs.tuned_config(tgt.name, name, _configs.shape_key(name, kw, rows), block_d)
    return cfg or _configs.heuristic(rows, block_d, tgt.interpret)


def _launch_cfg(name: str, rows: int, block_d: int, grid: Any, kw: dict[str, Any]) -> None:
    """Launch kernel ``name`` with ``grid(BLOCK_T)``: autotuned if asked, else :func:`pick_config`'s config."""
    raw, tuned = KERNELS[name]
    kw["BLOCK_D"] = block_d
    if _autotune_enabled():
        _run(tuned, lambda m: grid(m["BLOCK_T"]), kw)
        return
    cfg = pick_config(name, kw, rows, block_d, _kw_device(kw))
    kw.update(BLOCK_T=cfg.block_t, num_warps=cfg.num_warps)
    _run(raw, grid(cfg.block_t), kw)


def _launch_tiles(name: str, ntok: int, block_d: int, heads: int, layers: int, /, **kw: Any) -> None:
    """Launch a (token-tile, head, layer) kernel over ``ntok`` rows."""
    _launch_cfg(name, ntok, block_d, lambda bt: (triton.cdiv(ntok, bt), heads, layers), kw)


# ----------------------------------------------------------------------------
# Token-row operands
# ----------------------------------------------------------------------------


@dataclass
class _Rows:
    """A [tokens, heads, head_dim] operand per layer: dense strides, or paged through a block table."""

    layers: _Layers
    s_tok: int
    s_h: int
    s_d: int
    s_blk: int = 0

    def kw(self, prefix: str) -> dict[str, Any]:
        return {
            f"{prefix}_st": self.s_tok,
            f"{prefix}_sh": self.s_h,
            f"{prefix}_sd": self.s_d,
            f"{prefix}_sb": self.s_blk,
            f"{prefix}_sl": self.layers.stride,
        }


def _dense_rows(layers: _Layers, strides: Sequence[int] | None = None) -> _Rows:
    st = strides if strides is not None else layers.base.stride()
    return _Rows(layers, st[0], st[1], st[2])


def _tab(lay: _Layers) -> tuple[torch.Tensor | None, int]:
    """(offset table, its TABLE constexpr): 0 without a table, else the offsets' common multiple."""
    return lay.table, (0 if lay.table is None else lay.mult)


def _view_for(dt: torch.dtype, kind: str) -> torch.dtype | None:
    """The dtype kernels see an operand as: same-width ints for K bits, int16 for bf16 V/outputs."""
    if kind == "k":
        view = K_ELEM_VIEW.get(dt.itemsize)
        if view is None:
            raise UnsupportedConfigError(f"dtype {dt} of {dt.itemsize} bytes unsupported")
        return view
    if kind == "v" and dt == torch.bfloat16:
        return torch.int16
    return None


def _as_layers(
    xs: Sequence[torch.Tensor] | torch.Tensor, what: str, kind: str = ""
) -> tuple[_Layers, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]:
    """Layers of a stacked ``[L, ...]`` tensor or a list: (addressing, per-layer shape, strides, dtype, device)."""
    if isinstance(xs, torch.Tensor):
        if xs.dim() < 2 or xs.shape[0] == 0:
            raise UnsupportedConfigError(f"stacked {what} need a non-empty leading layer dim; got {tuple(xs.shape)}")
        dt = xs.dtype
        return _stacked(xs, _view_for(dt, kind)), tuple(xs.shape[1:]), xs.stride()[1:], dt, xs.device
    xs = list(xs)
    if not xs:
        raise UnsupportedConfigError(f"no {what} given")
    _same_layout(xs, what)
    x0 = xs[0]
    return _listed(xs, _view_for(x0.dtype, kind)), tuple(x0.shape), x0.stride(), x0.dtype, x0.device


# ----------------------------------------------------------------------------
# Encode (shared by dense and paged callers)
# ----------------------------------------------------------------------------


def _encode_core(
    k: _Rows,
    v: _Rows,
    pay: _Layers,
    *,
    tokens: int,
    heads: int,
    dim: int,
    kb: int,
    v_bf16: bool,
    scope: ScaleScope,
    page_size: int | None,
    fp8_dtype: torch.dtype,
    strategy: Strategy,
    table: torch.Tensor | None,
    block_size: int,
) -> torch.Tensor:
    """Launch the fused encode over ``pay.count`` layers; return amax [L, *scale_shape].

    ``v`` must already be the kernels' view (int16 bits for bf16, ``v_bf16``).
    """
    fp = _fp8_params(fp8_dtype)
    layers = pay.count
    dev = pay.base.device
    shape = scale_shape(scope, tokens, heads, page_size)
    if strategy not in ("auto", "single", "two_stage"):
        raise UnsupportedConfigError(f"strategy must be 'auto', 'single' or 'two_stage'; got {strategy!r}")
    if tokens == 0 or heads == 0:
        return torch.zeros((layers, *shape), dtype=torch.float32, device=dev)
    block_d = _pow2(dim)
    paged = table is not None
    dummy = _dummy_table(dev)
    tbl = table if paged else dummy
    k_aligned = pay.base.data_ptr() % kb == 0 and pay.stride % kb == 0
    if pay.table is not None and k_aligned and kb > 1:
        k_aligned = all(o % kb == 0 for o in pay.offsets)
    k_tab, k_has = _tab(k.layers)
    v_tab, v_has = _tab(v.layers)
    p_tab, p_has = _tab(pay)
    common = {
        "k_ptr": k.layers.base, "v_ptr": v.layers.base, "pay_ptr": pay.base, "tbl_ptr": tbl,
        "k_ltab": k_tab if k_has else dummy, "v_ltab": v_tab if v_has else dummy,
        "p_ltab": p_tab if p_has else dummy,
        "T": tokens, "H": heads, "BS": block_size, **k.kw("k"), **v.kw("v"), "p_sl": pay.stride,
        "D": dim, "KB": kb, "V_BF16": v_bf16, "PAGED": paged,
        "K_TAB": k_has, "V_TAB": v_has, "P_TAB": p_has, "K_ALIGNED": k_aligned,
    }  # fmt: skip

    per_page = scope == ScaleScope.PER_PAGE_HEAD
    single = per_page
    if scope == ScaleScope.PER_LAYER_HEAD:
        if strategy == "auto":
            single = _interp(dev) or (layers * heads >= 2 * _sm_count(dev) and tokens <= 1024)
        else:
            single = strategy == "single"
    elif per_page and strategy == "two_stage":
        single = False
    gt = int(page_size) if per_page else tokens  # type: ignore[arg-type]
    n_gt = -(-tokens // gt)

    if single:
        amax = torch.empty((layers, n_gt, heads), dtype=torch.float32, device=dev)
        common.update(amax_ptr=amax, GT=gt, n_gt=n_gt, qmax=fp.qmax, MANT=fp.mant, BIAS=fp.bias,
                      MAX_BITS=fp.max_bits, SAT=fp.sat, HW_FP8=_hw_fp8(dev))  # fmt: skip
        _launch_cfg("_encode_groups_kernel", min(gt, 256), block_d, lambda bt: (n_gt, heads, layers), common)
        return amax.view(layers, *shape)

    # Two stages: atomic absmax per group (with the K copy), then scale + cast.
    per_tensor = scope == ScaleScope.PER_TENSOR
    hh = 1 if per_tensor else heads
    abits = torch.zeros((layers, n_gt, hh), dtype=torch.int32, device=dev)
    tt = gt if per_page else _stage1_tokens(tokens, heads, layers, dev)
    common.update(abits_ptr=abits, TT=tt, GT=gt, n_gt=n_gt, PER_TENSOR=per_tensor, FINITE_ONLY=False)
    _launch_amax_tiles(common, tokens, tt, block_d, heads, layers)
    s_pg, s_hd = (0, 0) if per_tensor else ((heads, 1) if per_page else (0, 1))
    kw2 = {
        "v_ptr": v.layers.base, "o_ptr": pay.base, "s_ptr": abits, "tbl_ptr": tbl,
        "v_ltab": v_tab if v_has else dummy, "o_ltab": p_tab if p_has else dummy,
        "T": tokens, "H": heads, "PS": gt, "s_pg": s_pg, "s_hd": s_hd, "s_sl": n_gt * hh,
        "BS": block_size, "o_off": tokens * heads * dim * kb,
        **v.kw("v"), "o_st": heads * dim, "o_sh": dim, "o_sd": 1, "o_sl": pay.stride,
        "qmax": fp.qmax, "D": dim, "V_BF16": v_bf16, "MANT": fp.mant, "BIAS": fp.bias,
        "MAX_BITS": fp.max_bits, "SAT": fp.sat, "FROM_AMAX": True, "WRITE_SCALES": True,
        "SHARED_HEADS": per_tensor, "PAGED": paged, "V_TAB": v_has, "O_TAB": p_has, "HW_FP8": _hw_fp8(dev),
    }  # fmt: skip
    _launch_tiles("_quant_tiles_kernel", tokens, block_d, heads, layers, **kw2)
    return abits.view(torch.float32).view(layers, *shape)


def _stage1_tokens(tokens: int, heads: int, layers: int, dev: torch.device) -> int:
    """Tokens per stage-1 program: about 4 programs per SM, each a multiple of 16 tokens."""
    if STAGE1_TOKENS:
        return max(1, min(int(STAGE1_TOKENS), tokens))
    if _interp(dev):
        return tokens
    want = 4 * _sm_count(dev)
    per = max(16, -(-tokens * heads * layers // want))
    return min(tokens, -(-per // 16) * 16)


def _launch_amax_tiles(kw: dict[str, Any], tokens: int, tt: int, block_d: int, heads: int, layers: int) -> None:
    """Launch the stage-1 absmax kernel over TT-token tiles."""
    grid = (triton.cdiv(tokens, tt), heads, layers)
    _launch_cfg("_amax_tiles_kernel", tt, block_d, lambda bt: grid, kw)


# ----------------------------------------------------------------------------
# Public launchers
# ----------------------------------------------------------------------------


def group_amax(
    v: torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    finite_only: bool = False,
) -> torch.Tensor:
    """``amax(|V|)`` per scale group, fp32 of :func:`kvcodec.quant.scale_shape`.

    NaN propagates (a group holding NaN gives NaN, Inf gives Inf) unless
    ``finite_only`` drops non-finite values.
    """
    _check_tensor3("V", v, V_DTYPES)
    scope = _check_scope(scope, page_size)
    dev = _check_device(v)
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
    block_d = _pow2(d)
    tt = gt if per_page else _stage1_tokens(t, h, 1, dev)
    dummy = _dummy_table(dev)
    vb = _bits16(v)
    rows = _dense_rows(_Layers(vb, 0, None, 1))
    kw = {
        "k_ptr": vb, "v_ptr": vb, "pay_ptr": dummy, "abits_ptr": abits, "tbl_ptr": dummy,
        "k_ltab": dummy, "v_ltab": dummy, "p_ltab": dummy,
        "T": t, "H": h, "TT": tt, "GT": gt, "n_gt": n_gt, "BS": 1,
        **rows.kw("k"), **rows.kw("v"), "p_sl": 0,
        "D": d, "KB": 0, "V_BF16": v.dtype == torch.bfloat16, "PER_TENSOR": per_tensor,
        "FINITE_ONLY": bool(finite_only),
        "PAGED": False, "K_TAB": 0, "V_TAB": 0, "P_TAB": 0, "K_ALIGNED": False,
    }  # fmt: skip
    _launch_amax_tiles(kw, t, tt, block_d, h, 1)
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
    """fp32 scales of ``v`` for a scope, equal to :func:`kvcodec.quant.compute_scales`.

    ``amax`` (from :func:`group_amax`) skips the reduction. ``nonfinite``
    as in the reference: "error" raises :class:`UnsupportedConfigError` on a
    NaN/Inf group (this syncs with the device), "saturate" scales by the
    finite values only.
    """
    _check_tensor3("V", v, V_DTYPES)
    scope = _check_scope(scope, page_size)
    fp8_max(fp8_dtype)
    if nonfinite not in ("error", "saturate"):
        raise UnsupportedConfigError(f"nonfinite must be 'error' or 'saturate'; got {nonfinite!r}")
    if amax is None:
        amax = group_amax(v, scope, page_size=page_size)
    bad = ~torch.isfinite(amax)
    if bool(bad.any()):
        if nonfinite == "error":
            idx = tuple(int(i) for i in bad.nonzero()[0]) if amax.dim() else ()
            where = (
                "the whole tensor"
                if scope == ScaleScope.PER_TENSOR
                else f"head {idx[0]}"
                if scope == ScaleScope.PER_LAYER_HEAD
                else f"page {idx[0]}, head {idx[1]}"
            )
            raise UnsupportedConfigError(
                f"V holds NaN or Inf in {where} ({scope.name}); refusing to write a blob with a "
                "meaningless scale (pass nonfinite='saturate' to scale by the finite values)"
            )
        amax = group_amax(v, scope, page_size=page_size, finite_only=True)
    return scales_from_amax(amax, fp8_dtype)


def _scale_strides(scope: ScaleScope, t: int, h: int, page_size: int | None) -> tuple[int, int, int]:
    """(PS, s_pg, s_hd) to index a contiguous scale tensor by (token, head)."""
    if scope == ScaleScope.PER_TENSOR:
        return max(t, 1), 0, 0
    if scope == ScaleScope.PER_LAYER_HEAD:
        return max(t, 1), 0, 1
    return int(page_size), h, 1  # type: ignore[arg-type]


def _prep_scales(scales: torch.Tensor, scope: ScaleScope, t: int, h: int, page_size: int | None,
                 dev: torch.device) -> torch.Tensor:  # fmt: skip
    want = scale_shape(scope, t, h, page_size)
    if tuple(scales.shape) != want:
        raise UnsupportedConfigError(
            f"scales of shape {tuple(scales.shape)} do not fit scope {scope.name} over "
            f"{t} tokens x {h} heads (page_size {page_size}); expected {want}"
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
    _check_tensor3("V", v, V_DTYPES)
    scope = _check_scope(scope, page_size)
    fp = _fp8_params(fp8_dtype)
    t, h, d = v.shape
    dev = _check_device(v)
    if out is None:
        out = torch.empty((t, h, d), dtype=fp8_dtype, device=dev)
    elif tuple(out.shape) != (t, h, d) or out.dtype != fp8_dtype:
        raise UnsupportedConfigError(f"out is {tuple(out.shape)} {out.dtype}; expected {(t, h, d)} {fp8_dtype}")
    _check_device(v, out)
    s = _prep_scales(scales, scope, t, h, page_size, dev)
    if v.numel() == 0:
        return out
    ps, s_pg, s_hd = _scale_strides(scope, t, h, page_size)
    o8 = out.view(torch.uint8)
    dummy = _dummy_table(dev)
    vs, os_ = v.stride(), o8.stride()
    kw = {
        "v_ptr": _bits16(v), "o_ptr": o8, "s_ptr": s, "tbl_ptr": dummy, "v_ltab": dummy, "o_ltab": dummy,
        "T": t, "H": h, "PS": ps, "s_pg": s_pg, "s_hd": s_hd, "s_sl": 0, "BS": 1, "o_off": 0,
        "v_st": vs[0], "v_sh": vs[1], "v_sd": vs[2], "v_sb": 0, "v_sl": 0,
        "o_st": os_[0], "o_sh": os_[1], "o_sd": os_[2], "o_sl": 0,
        "qmax": fp.qmax, "D": d, "V_BF16": v.dtype == torch.bfloat16, "MANT": fp.mant, "BIAS": fp.bias,
        "MAX_BITS": fp.max_bits, "SAT": fp.sat, "FROM_AMAX": False, "WRITE_SCALES": False,
        "SHARED_HEADS": False, "PAGED": False, "V_TAB": 0, "O_TAB": 0, "HW_FP8": _hw_fp8(dev),
    }  # fmt: skip
    _launch_tiles("_quant_tiles_kernel", t, _pow2(d), h, 1, **kw)
    return out


_OUT_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _out_view(out: torch.Tensor) -> tuple[torch.Tensor, int]:
    try:
        kind = _OUT_KIND[out.dtype]
    except KeyError:
        raise UnsupportedConfigError(f"output dtype {out.dtype} unsupported; expected fp32, fp16 or bf16") from None
    return (out.view(torch.int16) if kind == 2 else out), kind


def _out_kind(dt: torch.dtype) -> int:
    try:
        return _OUT_KIND[dt]
    except KeyError:
        raise UnsupportedConfigError(f"output dtype {dt} unsupported; expected fp32, fp16 or bf16") from None


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
    if q.dim() != 3:
        raise UnsupportedConfigError(f"expected q as [tokens, heads, head_dim]; got shape {tuple(q.shape)}")
    if q.dtype not in FP8_DTYPES:
        raise UnsupportedConfigError(f"q dtype {q.dtype} is not FP8; expected one of {FP8_DTYPES}")
    scope = _check_scope(scope, page_size)
    fp = _fp8_params(q.dtype)
    t, h, d = q.shape
    dev = _check_device(q)
    if out is None:
        out = torch.empty((t, h, d), dtype=out_dtype, device=dev)
    elif tuple(out.shape) != (t, h, d):
        raise UnsupportedConfigError(f"out is {tuple(out.shape)}; expected {(t, h, d)}")
    _check_device(q, out)
    s = _prep_scales(scales, scope, t, h, page_size, dev)
    if q.numel() == 0:
        return out
    ov, kind = _out_view(out)
    ps, s_pg, s_hd = _scale_strides(scope, t, h, page_size)
    q8 = q.view(torch.uint8)
    dummy = _dummy_table(dev)
    qs, vos = q8.stride(), ov.stride()
    kw = {
        "q_ptr": q8, "s_ptr": s, "vo_ptr": ov, "ko_ptr": dummy, "tbl_ptr": dummy,
        "q_ltab": dummy, "vo_ltab": dummy, "ko_ltab": dummy,
        "T": t, "H": h, "PS": ps, "s_pg": s_pg, "s_hd": s_hd, "s_off": 0, "s_sl": 0, "BS": 1, "q_off": 0,
        "q_st": qs[0], "q_sh": qs[1], "q_sd": qs[2], "q_sl": 0,
        "vo_st": vos[0], "vo_sh": vos[1], "vo_sd": vos[2], "vo_sb": 0, "vo_sl": 0,
        "ko_st": 0, "ko_sh": 0, "ko_sd": 0, "ko_sb": 0, "ko_sl": 0,
        "D": d, "KB": 0, "MANT": fp.mant, "BIAS": fp.bias, "OUT_KIND": kind,
        "SCALE_BYTES": False, "K_ALIGNED": False, "PAGED": False,
        "Q_TAB": 0, "VO_TAB": 0, "KO_TAB": 0, "HW_FP8": _hw_fp8(dev),
    }  # fmt: skip
    _launch_tiles("_dequant_tiles_kernel", t, _pow2(d), h, 1, **kw)
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
    fp = _fp8_params(fp8_dtype)
    if x.dtype not in V_DTYPES:
        raise UnsupportedConfigError(f"x dtype {x.dtype} unsupported; expected one of {V_DTYPES}")
    if not x.is_contiguous():
        raise UnsupportedConfigError("quantize_1d needs a contiguous tensor")
    dev = _check_device(x)
    s = torch.as_tensor(scale, dtype=torch.float32).to(dev).reshape(1)
    if out is None:
        out = torch.empty(x.shape, dtype=fp8_dtype, device=dev)
    elif out.shape != x.shape or out.dtype != fp8_dtype or not out.is_contiguous():
        raise UnsupportedConfigError(f"out must be a contiguous {fp8_dtype} tensor of shape {tuple(x.shape)}")
    n = x.numel()
    if n == 0:
        return out
    blk = block or (_pow2(min(n, 1 << 17)) if _interp(dev) else 1024)
    kw = {"x_ptr": _bits16(x), "s_ptr": s, "o_ptr": out.view(torch.uint8), "N": n,
          "V_BF16": x.dtype == torch.bfloat16, "MANT": fp.mant, "BIAS": fp.bias,
          "MAX_BITS": fp.max_bits, "SAT": fp.sat, "HW_FP8": _hw_fp8(dev), "BLOCK": blk}  # fmt: skip
    _run(_quant_1d_kernel, (triton.cdiv(n, blk),), kw)
    return out


# ----------------------------------------------------------------------------
# Fused encode / decode
# ----------------------------------------------------------------------------


def _check_kv_meta(kshape: tuple[int, ...], vshape: tuple[int, ...], kdt: torch.dtype, vdt: torch.dtype) -> None:
    if len(kshape) != 3 or len(vshape) != 3:
        raise UnsupportedConfigError(f"expected K and V as [tokens, heads, head_dim]; got {kshape} and {vshape}")
    if kshape != vshape:
        raise UnsupportedConfigError(f"K {kshape} and V {vshape} differ in shape")
    if vdt not in V_DTYPES:
        raise UnsupportedConfigError(f"V dtype {vdt} unsupported; expected one of {V_DTYPES}")
    if kdt.itemsize not in K_ELEM_VIEW or not (kdt.is_floating_point or kdt == torch.uint8):
        raise UnsupportedConfigError(f"K dtype {kdt} unsupported")


def _check_payload(p: torch.Tensor, want: int) -> None:
    if p.dtype != torch.uint8 or p.dim() != 1:
        raise UnsupportedConfigError(f"payload must be a 1-D uint8 tensor; got {p.dim()}-D {p.dtype}")
    if p.numel() != want:
        raise UnsupportedConfigError(f"payload holds {p.numel()} bytes; the chunk needs exactly {want}")
    if p.numel() > 1 and p.stride(0) != 1:
        raise UnsupportedConfigError("payload must be contiguous")


def _payload_layers(payloads: Sequence[torch.Tensor] | torch.Tensor, want: int) -> _Layers:
    """Payloads as layers (a stacked ``[L, nbytes]`` uint8 tensor or a list), size-checked."""
    lay, shp, st, dt, _ = _as_layers(payloads, "payloads")
    if dt != torch.uint8 or len(shp) != 1:
        raise UnsupportedConfigError(f"payloads must be 1-D uint8 (or stacked [L, nbytes]); got {shp} {dt}")
    if shp[0] != want:
        raise UnsupportedConfigError(f"payload holds {shp[0]} bytes; the chunk needs exactly {want}")
    if want > 1 and st[0] != 1:
        raise UnsupportedConfigError("payload must be contiguous")
    return lay


def _payload_bytes(t: int, h: int, d: int, kb: int, scope: ScaleScope, page_size: int | None) -> int:
    return t * h * d * (kb + 1) + 4 * _n_scales(scope, t, h, page_size)


def _n_scales(scope: ScaleScope, t: int, h: int, page_size: int | None) -> int:
    return math.prod(scale_shape(scope, t, h, page_size))


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

    ``payload`` is a 1-D uint8 tensor of exactly :func:`payload_nbytes` bytes
    (any alignment). The returned fp32 absmax has the scale shape; NaN/Inf
    there means the group holds NaN/Inf (its scale is then not meaningful).
    Nothing here syncs with the device.
    """
    _check_kv_meta(tuple(k.shape), tuple(v.shape), k.dtype, v.dtype)
    scope = _check_scope(scope, page_size)
    _check_device(k, v, payload)
    t, h, d = v.shape
    kb = k.element_size()
    _check_payload(payload, _payload_bytes(t, h, d, kb, scope, page_size))
    amax = _encode_core(
        _dense_rows(_Layers(_int_view(k), 0, None, 1)),
        _dense_rows(_Layers(_bits16(v), 0, None, 1)),
        _Layers(payload, 0, None, 1),
        tokens=t, heads=h, dim=d, kb=kb, v_bf16=v.dtype == torch.bfloat16, scope=scope,
        page_size=page_size, fp8_dtype=fp8_dtype, strategy=strategy, table=None, block_size=1,
    )  # fmt: skip
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
    kl, kshape, kst, kdt, _ = _as_layers(ks, "K layers", "k")
    vl, vshape, vst, vdt, _ = _as_layers(vs, "V layers", "v")
    _check_kv_meta(kshape, vshape, kdt, vdt)
    scope = _check_scope(scope, page_size)
    t, h, d = vshape
    kb = kdt.itemsize
    pl = _payload_layers(payloads, _payload_bytes(t, h, d, kb, scope, page_size))
    _check_device(kl.base, vl.base, pl.base)
    if not kl.count == vl.count == pl.count:
        raise UnsupportedConfigError(f"{kl.count} K, {vl.count} V and {pl.count} payloads: counts differ")
    return _encode_core(
        _dense_rows(kl, kst), _dense_rows(vl, vst), pl,
        tokens=t, heads=h, dim=d, kb=kb, v_bf16=vdt == torch.bfloat16, scope=scope, page_size=page_size,
        fp8_dtype=fp8_dtype, strategy=strategy, table=None, block_size=1,
    )  # fmt: skip


def _decode_core(
    pay: _Layers,
    ko: _Rows,
    vo: _Rows,
    *,
    tokens: int,
    heads: int,
    dim: int,
    kb: int,
    out_kind: int,
    scope: ScaleScope,
    page_size: int | None,
    fp8_dtype: torch.dtype,
    table: torch.Tensor | None,
    block_size: int,
) -> None:
    """Launch the fused decode over ``pay.count`` layers (outputs already in the kernels' views)."""
    fp = _fp8_params(fp8_dtype)
    if tokens == 0 or heads == 0 or dim == 0:
        return
    dev = pay.base.device
    ps, s_pg, s_hd = _scale_strides(scope, tokens, heads, page_size)
    n_el = tokens * heads * dim
    kbytes = n_el * kb
    k_aligned = pay.base.data_ptr() % kb == 0 and pay.stride % kb == 0
    if pay.table is not None and k_aligned and kb > 1:
        k_aligned = all(o % kb == 0 for o in pay.offsets)
    dummy = _dummy_table(dev)
    paged = table is not None
    q_tab, q_has = _tab(pay)
    vo_tab, vo_has = _tab(vo.layers)
    ko_tab, ko_has = _tab(ko.layers)
    kw = {
        "q_ptr": pay.base, "s_ptr": dummy, "vo_ptr": vo.layers.base, "ko_ptr": ko.layers.base,
        "tbl_ptr": table if paged else dummy,
        "q_ltab": q_tab if q_has else dummy, "vo_ltab": vo_tab if vo_has else dummy,
        "ko_ltab": ko_tab if ko_has else dummy,
        "T": tokens, "H": heads, "PS": ps, "s_pg": s_pg, "s_hd": s_hd, "s_off": n_el, "s_sl": 0,
        "BS": block_size, "q_off": kbytes,
        "q_st": heads * dim, "q_sh": dim, "q_sd": 1, "q_sl": pay.stride,
        **vo.kw("vo"), **ko.kw("ko"),
        "D": dim, "KB": kb, "MANT": fp.mant, "BIAS": fp.bias,
        "OUT_KIND": out_kind, "SCALE_BYTES": True, "K_ALIGNED": k_aligned, "PAGED": paged,
        "Q_TAB": q_has, "VO_TAB": vo_has, "KO_TAB": ko_has, "HW_FP8": _hw_fp8(dev),
    }  # fmt: skip
    _launch_tiles("_dequant_tiles_kernel", tokens, _pow2(dim), heads, pay.count, **kw)


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
    _check_tensor3("k_out", k_out)
    _check_tensor3("v_out", v_out)
    if k_out.shape != v_out.shape:
        raise UnsupportedConfigError(f"k_out {tuple(k_out.shape)} and v_out {tuple(v_out.shape)} differ")
    scope = _check_scope(scope, page_size)
    _check_device(payload, k_out, v_out)
    t, h, d = v_out.shape
    kb = k_out.element_size()
    _check_payload(payload, _payload_bytes(t, h, d, kb, scope, page_size))
    vov, kind = _out_view(v_out)
    _decode_core(
        _Layers(payload, 0, None, 1),
        _dense_rows(_Layers(_int_view(k_out), 0, None, 1)),
        _dense_rows(_Layers(vov, 0, None, 1)),
        tokens=t, heads=h, dim=d, kb=kb, out_kind=kind, scope=scope, page_size=page_size,
        fp8_dtype=fp8_dtype, table=None, block_size=1,
    )  # fmt: skip


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
    kl, kshape, kst, kdt, _ = _as_layers(k_outs, "K outputs", "k")
    vl, vshape, vst, vdt, _ = _as_layers(v_outs, "V outputs", "v")
    if len(kshape) != 3 or kshape != vshape:
        raise UnsupportedConfigError(f"k_out {kshape} and v_out {vshape} must be same-shaped [T, H, D]")
    kind = _out_kind(vdt)
    scope = _check_scope(scope, page_size)
    t, h, d = vshape
    kb = kdt.itemsize
    pl = _payload_layers(payloads, _payload_bytes(t, h, d, kb, scope, page_size))
    _check_device(pl.base, kl.base, vl.base)
    if not kl.count == vl.count == pl.count:
        raise UnsupportedConfigError(f"{pl.count} payloads, {kl.count} K and {vl.count} V outputs: counts differ")
    _decode_core(
        pl, _dense_rows(kl, kst), _dense_rows(vl, vst),
        tokens=t, heads=h, dim=d, kb=kb, out_kind=kind, scope=scope, page_size=page_size,
        fp8_dtype=fp8_dtype, table=None, block_size=1,
    )  # fmt: skip
