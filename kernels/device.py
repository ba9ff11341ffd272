"""Shared Triton device helpers of kvcodec's kernels, and the naming scheme of kernel arguments.

Kernel arguments are named by one scheme (launchers spell each name out in
full, so grep finds every use):

* an operand is a short prefix: ``k``/``v`` (K and V in), ``p``/``pay``
  (payload), ``q`` (FP8 codes in), ``o`` (codes out), ``ko``/``vo`` (K and V
  out), ``s`` (scales), ``tbl`` (block table), ``amax``/``abits`` (absmax),
  ``hi``/``lo`` (K's byte planes of the lossless payload, contiguous);
* ``<op>_ptr`` is its base pointer, ``<op>_ltab`` its per-layer offset
  table and ``<OP>_TAB`` that table's constexpr (0: ``layer * <op>_sl``);
* its element strides are ``<op>_st`` (token), ``<op>_sh`` (head),
  ``<op>_sd`` (channel), ``<op>_sb`` (block, paged rows) and ``<op>_sl``
  (layer); scale tensors use ``s_pg`` (page) and ``s_hd`` (head);
* sizes are capitals: ``T`` tokens, ``H`` heads, ``D`` head_dim, ``BS``
  block size (tokens per cache block), ``PS`` tokens per scale group, ``GT``
  tokens per group of one program, ``TT`` tokens per stage-1 tile, ``KB``
  bytes per K element, ``BLOCK_T``/``BLOCK_D`` the tile;
* ``MANT``/``BIAS``/``MAX_BITS``/``SAT`` describe the FP8 format
  (:class:`kvcodec.kernels.operands.Fp8Constants`), ``HW_FP8`` selects the
  hardware converters.

Every float conversion whose rounding matters is done with integer ops on the
fp32 bit pattern, so results are identical on the interpreter, NVIDIA and
AMD: Triton's own fp32→fp8 cast drops the rounding carry in the interpreter,
and before sm_89 NVIDIA has no fp32→fp8 converter (Triton goes through fp16,
rounding toward zero, for e5m2), and the interpreter truncates fp32→bf16. On
sm_89+ :func:`f32_to_fp8` / :func:`fp8_to_f32` use the hardware converters
instead (selected by a constexpr; see their docstrings).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "abs_bits",
    "bf16_bits_rne",
    "div_by_scale",
    "f32_to_fp8",
    "f32_to_fp8_byte",
    "fp8_byte_to_f32",
    "fp8_to_f32",
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
    FINITE: tl.constexpr = False,
):
    """fp32 → FP8 byte: saturate at ±max, round to nearest even, NaN → 0x7F | sign.

    Equals ``clamp(y, -max, max).to(fp8)`` in torch for every fp32 input
    (subnormals included). ``MANT``/``BIAS``: 3/7 for e4m3fn, 2/15 for e5m2;
    ``MAX_BITS`` the fp32 bits of the FP8 max, ``SAT`` the max's byte.
    ``FINITE``: the caller knows ``y`` holds no NaN (no NaN select).
    """
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    SH: tl.constexpr = 23 - MANT
    RB: tl.constexpr = (BIAS - 127) * (1 << 23) + (1 << (SH - 1)) - 1
    # Normal range: rebias the exponent and round the mantissa (ties to even).
    norm = (a + RB + ((a >> SH) & 1)) >> SH
    # Subnormal range (|y| < 2^(1-BIAS)): one fp32 add of 2^k whose ulp is the FP8
    # subnormal step rounds |y| onto that step (ties to even); the low bits count the steps.
    STEP_EXP: tl.constexpr = 1 - BIAS - MANT
    ALIGN: tl.constexpr = 2.0 ** (STEP_EXP + 23)
    ALIGN_BITS: tl.constexpr = (STEP_EXP + 23 + 127) << 23
    sub = (a.to(tl.float32, bitcast=True) + ALIGN).to(tl.int32, bitcast=True) - ALIGN_BITS
    MIN_NORM: tl.constexpr = (128 - BIAS) * (1 << 23)
    r = tl.where(a < MIN_NORM, sub, norm)
    r = tl.where(a >= MAX_BITS, SAT, r)
    if not FINITE:
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
def f32_to_fp8(
    y,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_BITS: tl.constexpr,
    SAT: tl.constexpr,
    HW: tl.constexpr,
    FINITE: tl.constexpr = False,
):
    """fp32 → FP8 byte like :func:`f32_to_fp8_byte`; ``HW`` uses the sm_89+ converter.

    The hardware path converts with ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32``
    (PTX ISA: round to nearest even straight from fp32, one rounding; finite
    results beyond ±MAX_NORM and ±Inf become ±MAX_NORM, the sign kept, -0 → 0x80),
    which equals torch's ``clamp(y, -max, max).to(fp8)`` for every non-NaN input.
    Without ``FINITE`` it converts ``|y|`` and ORs the sign back, NaN set to
    0x7F | sign explicitly, so the result never depends on the converter's NaN
    encoding; with ``FINITE`` (the caller refuses NaN groups: their bytes are
    never used) it converts ``y`` itself.
    The kernel audit checks that the PTX holds that single ``cvt`` and no
    fp16 intermediate; tests/kernels/test_cuda.py checks all inputs on a GPU.
    """
    if HW:
        if FINITE:
            if MANT == 3:
                out = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            else:
                out = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
        else:
            b = y.to(tl.int32, bitcast=True)
            a = b & 0x7FFFFFFF
            sign = ((b >> 24) & 0x80).to(tl.uint8)
            ay = a.to(tl.float32, bitcast=True)
            if MANT == 3:
                r = ay.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            else:
                r = ay.to(tl.float8e5).to(tl.uint8, bitcast=True)
            r = tl.where(a > 0x7F800000, 0x7F, r).to(tl.uint8)
            out = r | sign
    else:
        out = f32_to_fp8_byte(y, MANT, BIAS, MAX_BITS, SAT, FINITE)
    return out


@triton.jit
def fp8_to_f32(q, MANT: tl.constexpr, BIAS: tl.constexpr, HW: tl.constexpr):
    """FP8 byte → fp32 like :func:`fp8_byte_to_f32`; ``HW`` uses ``cvt.rn.f16x2.{e4m3,e5m2}x2``.

    Every FP8 value is exact in fp16 and fp32, so the hardware path is exact
    (NaN bytes give a NaN, whose payload the caller's multiply canonicalises).
    """
    if HW:
        u = q.to(tl.uint8, bitcast=True)
        if MANT == 3:
            r = u.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            r = u.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        r = fp8_byte_to_f32(q, MANT, BIAS)
    return r


@triton.jit
def div_by_scale(v, s, DIV: tl.constexpr):
    """``v / s`` rounded like IEEE division (``div_rn``), with one reciprocal per scale.

    ``s`` is one scale per group (a scalar, or a ``[rows, 1]`` column), so
    ``r = div_rn(1, s)`` is computed once per group. ``DIV`` (picked on the host):

    * 0: ``div_rn(v, s)`` per element (fp32 V and caller-given scales);
    * 1: ``q = v * r`` corrected once with its residual, ``q - fma(q, s, -v) * r``
      (two FMAs; written so that ``v = -0`` keeps its sign);
    * 2: the same on ``v * f`` and ``s * f`` with ``f = 2^64`` for scales below
      2^-64 (a bf16 group's scale goes down to 2^-149, whose reciprocal would
      overflow); ``v / s == (v f) / (s f)`` exactly, and ``|v| <= 448 s`` cannot overflow.

    tests/kernels/test_division_proof.py proves 1 (fp16) and 2 (bf16) equal to
    ``div_rn`` for every value and the scales the codec makes.
    """
    if DIV == 0:
        q = tl.math.div_rn(v, s)
    else:
        if DIV == 2:
            f = tl.where(s < 5.421010862427522e-20, 1.8446744073709552e19, 1.0)
            s = s * f
            v = v * f
        r = tl.math.div_rn(1.0, s)
        q0 = v * r
        q = tl.fma(-tl.fma(q0, s, -v), r, q0)
    return q


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
    """int64 element offset of a layer: from a device table, or ``layer * stride``.

    ``TABLE``: 0 for ``layer * stride``; n >= 1 for a table whose entries the
    host checked to be multiples of n elements (n > 1 lets Triton prove the
    16-byte alignment that 128-bit accesses need).
    """
    if TABLE > 0:
        r = tl.load(off_ptr + layer).to(tl.int64)
        if TABLE > 1:
            r = tl.multiple_of(r, TABLE)
    else:
        r = layer.to(tl.int64) * stride
    return r


@triton.jit
def row_off(t, tmask, tbl_ptr, s_tok, s_blk, BS, PAGED: tl.constexpr):
    """int64 offsets of token rows ``t``: dense ``t * s_tok`` or through a block table."""
    if PAGED:
        # Token indices are int32 (chunks are far below 2^31 tokens) and the kernels take the
        # block size as a constexpr (one compile per block size): div/mod by a power of two
        # are a shift and a mask, by anything else a multiply-high.
        blk = tl.load(tbl_ptr + t // BS, mask=tmask, other=0).to(tl.int64)
        r = blk * s_blk + (t % BS).to(tl.int64) * s_tok
    else:
        r = t.to(tl.int64) * s_tok
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
