"""Shared Triton device helpers of kvcodec's kernels (imported only by kernel modules).

Every float conversion whose rounding matters is done with integer ops on the
fp32 bit pattern, so results are identical on the interpreter, NVIDIA and
AMD: Triton's own fp32→fp8 cast drops the rounding carry in the interpreter
and may double-round through fp16 on NVIDIA, and the interpreter truncates
fp32→bf16.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "abs_bits",
    "bf16_bits_rne",
    "f32_to_fp8_byte",
    "fp8_byte_to_f32",
    "layer_off",
    "load_elems",
    "row_off",
    "store_elems",
    "to_f32",
]


@triton.jit
def f32_to_fp8_byte(
    y,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_BITS: tl.constexpr,
    SAT: tl.constexpr,
):
    """fp32 → FP8 byte: saturate at ±max, round to nearest even, NaN → 0x7F | sign.

    Equals ``clamp(y, -max, max).to(fp8)`` in torch for every fp32 input
    (subnormals included). ``MANT``/``BIAS``: 3/7 for e4m3fn, 2/15 for e5m2;
    ``MAX_BITS`` the fp32 bits of the FP8 max, ``SAT`` the max's byte.
    """
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    SH: tl.constexpr = 23 - MANT
    RB: tl.constexpr = (BIAS - 127) * (1 << 23) + (1 << (SH - 1)) - 1
    # Normal range: rebias the exponent and round the mantissa (ties to even).
    norm = (a + RB + ((a >> SH) & 1)) >> SH
    # Subnormal range: round m * 2^(e-150) onto the FP8 subnormal step exactly.
    e = a >> 23
    m = (a & 0x7FFFFF) | 0x800000
    SUB0: tl.constexpr = 150 - (BIAS - 1 + MANT)
    sh = tl.minimum(tl.maximum(SUB0 - e, 1), 25)
    qs = m >> sh
    rem = m & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    up = (rem > half) | ((rem == half) & ((qs & 1) == 1))
    sub = qs + up.to(tl.int32)
    MIN_NORM: tl.constexpr = (128 - BIAS) * (1 << 23)
    r = tl.where(a < MIN_NORM, sub, norm)
    r = tl.where(a >= MAX_BITS, SAT, r)
    r = tl.where(a > 0x7F800000, 0x7F, r)
    return (r | sign).to(tl.uint8)


@triton.jit
def fp8_byte_to_f32(q, MANT: tl.constexpr, BIAS: tl.constexpr):
    """FP8 byte (any integer type) → its exact fp32 value (NaN/Inf kept)."""
    b = q.to(tl.int32) & 0xFF
    sign = (b & 0x80) << 24
    EMASK: tl.constexpr = (1 << (7 - MANT)) - 1
    MMASK: tl.constexpr = (1 << MANT) - 1
    SUBSTEP: tl.constexpr = 2.0 ** (1 - BIAS - MANT)
    e = (b >> MANT) & EMASK
    m = b & MMASK
    norm = ((e + (127 - BIAS)) << 23) | (m << (23 - MANT))
    sub = (m.to(tl.float32) * SUBSTEP).to(tl.int32, bitcast=True)
    mag = tl.where(e == 0, sub, norm)
    if MANT == 2:
        special = 0x7F800000 | (m << 21) | tl.where(m != 0, 0x400000, 0)
        mag = tl.where(e == EMASK, special, mag)
    else:
        mag = tl.where((b & 0x7F) == 0x7F, 0x7FC00000, mag)
    return (mag | sign).to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits_rne(x):
    """fp32 → bf16 bit pattern (int16), round to nearest even; NaN → quiet NaN."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, (b >> 16) | 0x0040, r)
    return r.to(tl.int16)


@triton.jit
def abs_bits(v, FINITE_ONLY: tl.constexpr):
    """``|v|`` of fp32 ``v`` as int32 bits: ordered like the values, NaN above Inf."""
    a = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if FINITE_ONLY:
        a = tl.where(a >= 0x7F800000, 0, a)
    return a


@triton.jit
def layer_off(layer, off_ptr, stride, TABLE: tl.constexpr):
    """int64 element offset of a layer: from a device table, or ``layer * stride``."""
    if TABLE:
        r = tl.load(off_ptr + layer).to(tl.int64)
    else:
        r = layer.to(tl.int64) * stride
    return r


@triton.jit
def row_off(t, tmask, tbl_ptr, s_tok, s_blk, BS, PAGED: tl.constexpr):
    """int64 offsets of token rows ``t``: dense ``t * s_tok`` or through a block table."""
    t64 = t.to(tl.int64)
    if PAGED:
        blk = tl.load(tbl_ptr + t64 // BS, mask=tmask, other=0).to(tl.int64)
        r = blk * s_blk + (t64 % BS) * s_tok
    else:
        r = t64 * s_tok
    return r


@triton.jit
def store_elems(p_base, idx, val, mask, KB: tl.constexpr, ALIGNED: tl.constexpr):
    """Store integer elements ``val`` of ``KB`` bytes at element index ``idx`` of a byte buffer."""
    if ALIGNED:
        tl.store(p_base.to(tl.pointer_type(val.dtype)) + idx, val, mask=mask)
    else:
        for j in tl.static_range(KB):
            tl.store(p_base + idx * KB + j, ((val >> (8 * j)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def load_elems(p_base, idx, mask, KB: tl.constexpr, ALIGNED: tl.constexpr):
    """Load ``KB``-byte integer elements at element index ``idx`` of a byte buffer."""
    if KB == 1:
        r = tl.load(p_base + idx, mask=mask, other=0)
    elif ALIGNED:
        if KB == 2:
            r = tl.load(p_base.to(tl.pointer_type(tl.int16)) + idx, mask=mask, other=0)
        else:
            r = tl.load(p_base.to(tl.pointer_type(tl.int32)) + idx, mask=mask, other=0)
    else:
        acc = tl.load(p_base + idx * KB, mask=mask, other=0).to(tl.int32)
        for j in tl.static_range(1, KB):
            acc = acc | (tl.load(p_base + idx * KB + j, mask=mask, other=0).to(tl.int32) << (8 * j))
        if KB == 2:
            r = acc.to(tl.int16)
        else:
            r = acc
    return r


@triton.jit
def to_f32(x, IS_BF16: tl.constexpr):
    """Widen fp16/fp32 (or bf16 loaded as int16 bits) to fp32 exactly.

    bf16 is widened by a shift: the interpreter's bf16→fp32 cast gets subnormals wrong.
    """
    if IS_BF16:
        r = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        r = x.to(tl.float32)
    return r
