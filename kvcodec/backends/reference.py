"""The torch backend: the codec's numerics (see :mod:`kvcodec.numerics`) in torch ops, CPU or GPU.

Everything works on V in canonical token-major layout ``[tokens, heads, head_dim]``.
For each scale group (whole tensor; one head over all tokens; one page x one
head, a partial last page over the tokens it holds)::

    scale = amax(|V|) / fp8_max          (fp32, IEEE division; 1.0 if amax == 0)
    q     = RNE(clamp(V / scale, -fp8_max, fp8_max))   as float8
    V_hat = float(q) * scale              (then cast to the output dtype)

These are LMCache's numerics, so blobs are byte-identical to its
``AsymK16V8Codec``. Every other backend must equal this module bit for bit.

Work is done in token blocks so that no full-size fp32 copy of V is made:
peak scratch memory is bounded by :data:`BLOCK_ELEMENTS` fp32 values.
"""

from __future__ import annotations

import torch

from ..errors import Reason, UnsupportedConfigError
from ..numerics import (
    ScaleScope,
    amax_to_scale,
    check_finite_amax,
    fp8_max,
    output_for,
    scale_shape,
    token_scales,
)
from .base import Groups, NonFinitePolicy, TwoPass

__all__ = [
    "BACKEND",
    "BLOCK_ELEMENTS",
    "ReferenceBackend",
    "compute_scales",
    "dequantize",
    "fp8_to_float32",
    "quantize",
    "reduce_groups",
    "token_head_amax",
]

BLOCK_ELEMENTS = 1 << 19
"""fp32 scratch elements per block on GPUs (2 MiB): bounds an encode's extra memory."""
CPU_BLOCK_ELEMENTS = 1 << 14
"""Elements per block on CPU: under torch's parallel grain (32768), so every op stays on the
calling thread (torch would otherwise run it on an OpenMP team per calling thread)."""


def _block_tokens(heads: int, dim: int, device: torch.device) -> int:
    per_tok = max(1, heads * dim)
    block = CPU_BLOCK_ELEMENTS if device.type == "cpu" else BLOCK_ELEMENTS
    return max(1, block // per_tok)


def token_head_amax(v: torch.Tensor, *, finite_only: bool = False) -> torch.Tensor:
    """``amax(|V|)`` over head_dim, per (token, head), as fp32 ``[tokens, heads]``.

    Exact: ``|x|`` and ``max`` lose nothing in any float format, nor does the
    widening to fp32. NaN propagates (it is caught later), unless
    ``finite_only`` drops non-finite values.
    """
    t, h, d = v.shape
    out = torch.empty((t, h), dtype=torch.float32, device=v.device)
    if t == 0 or h == 0:
        return out
    if d == 0:
        return out.zero_()
    bt = _block_tokens(h, d, v.device)
    scratch = torch.empty((min(bt, t), h, d), dtype=torch.float32, device=v.device)
    for t0 in range(0, t, bt):
        t1 = min(t, t0 + bt)
        a = scratch[: t1 - t0]
        a.copy_(v[t0:t1])  # widening is exact; fp32 abs/amax are the fast kernels
        a.abs_()
        if finite_only:
            a.masked_fill_(~torch.isfinite(a), 0.0)
        torch.amax(a, dim=2, out=out[t0:t1])
    return out


def reduce_groups(amax_th: torch.Tensor, scope: ScaleScope, page_size: int | None) -> torch.Tensor:
    """Per-group absmax from per-(token, head) absmax ``[tokens, heads]``, shaped as the scope's scales."""
    t, h = amax_th.shape
    shape = scale_shape(scope, t, h, page_size)
    if t == 0:
        return torch.zeros(shape, dtype=torch.float32, device=amax_th.device)
    if scope == ScaleScope.PER_TENSOR:
        return amax_th.amax()
    if scope == ScaleScope.PER_LAYER_HEAD:
        return amax_th.amax(dim=0)
    ps = int(page_size or 1)  # scale_shape has checked it
    full = t // ps
    parts = [amax_th[: full * ps].view(full, ps, h).amax(dim=1)] if full else []
    if full * ps < t:  # the partial last page: its own group, never padded to page_size rows
        parts.append(amax_th[full * ps :].amax(dim=0, keepdim=True))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def compute_scales(
    v: torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    nonfinite: NonFinitePolicy = "error",
) -> torch.Tensor:
    """fp32 scales of ``v`` (``[tokens, heads, head_dim]``) for a scope.

    ``nonfinite="error"`` raises :class:`UnsupportedConfigError` naming the
    first group holding NaN or Inf; ``"saturate"`` computes the scale from the
    finite values only (Inf then saturates to the FP8 max, NaN stays NaN).
    """
    if v.dim() != 3:
        raise UnsupportedConfigError(
            f"expected V as [tokens, heads, head_dim]; got shape {tuple(v.shape)}", reason=Reason.BAD_SHAPE
        )
    qmax = fp8_max(fp8_dtype)
    amax = reduce_groups(token_head_amax(v, finite_only=False), scope, page_size)
    if not bool(torch.isfinite(amax).all()):
        if nonfinite == "error":
            check_finite_amax(amax, scope)
        if nonfinite != "saturate":
            raise UnsupportedConfigError(
                f"nonfinite must be 'error' or 'saturate'; got {nonfinite!r}", reason=Reason.BAD_VALUE
            )
        amax = reduce_groups(token_head_amax(v, finite_only=True), scope, page_size)
    return amax_to_scale(amax, qmax)


def quantize(
    v: torch.Tensor,
    scales: torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 of ``v / scale``, saturated at ±fp8_max and rounded to nearest even.

    ``out`` (``[tokens, heads, head_dim]`` of ``fp8_dtype``, any strides) receives
    the result; the function works block by block so its scratch stays small.
    """
    qmax = fp8_max(fp8_dtype)
    t, h, d = v.shape
    out = output_for(out, (t, h, d), fp8_dtype, v.device, same_dtype=True)
    if v.numel() == 0:
        return out
    ts = token_scales(scales, scope, t, h, page_size)
    bt = _block_tokens(h, d, v.device)
    scratch = torch.empty((min(bt, t), h, d), dtype=torch.float32, device=v.device)
    for t0 in range(0, t, bt):
        t1 = min(t, t0 + bt)
        buf = scratch[: t1 - t0]
        buf.copy_(v[t0:t1])  # widening is exact
        buf.div_(ts[t0:t1])  # IEEE fp32 division
        buf.clamp_(-qmax, qmax)
        out[t0:t1].copy_(buf)
    return out


def _fp8_widen_div256(
    q: torch.Tensor, scratch: torch.Tensor, probe: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``float(q) / 256`` exactly, as an fp16 tensor, for e4m3fn, with three int16 operations.

    An e4m3fn code placed in an fp16's bits (sign to bit 15, exponent and
    mantissa to bits 7..13) reads as the same value over 2^8, subnormals
    included, since the exponent biases differ by 8. Sign-extending the code
    as int8 and shifting left by 7 does that, except that the code's own sign
    bit lands on bit 14, which is cleared. NaN codes (0x7F, 0xFF) would read
    as ±480/256: their mask is returned for the caller to patch. ``scratch`` is
    int16 and ``probe`` uint8, of ``q``'s shape; the result is a view of scratch.
    """
    u = q.view(torch.uint8)
    h = scratch
    h.copy_(q.view(torch.int8))
    h.bitwise_left_shift_(7)
    h.bitwise_and_(~0x4000)
    torch.bitwise_and(u, 0x7F, out=probe)
    nan_mask = (probe == 0x7F) if int(probe.amax()) == 0x7F else None
    return h.view(torch.float16), nan_mask


def fp8_to_float32(q: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Exact ``q.to(float32)`` into ``out`` (same shape), by bit manipulation.

    torch's own FP8 widening is a slow scalar loop on CPU; this equals it for
    every one of the 256 codes of both formats (tested exhaustively), NaN
    included. ``scratch`` (int16, ``q``'s shape) avoids an allocation.
    """
    if scratch is None:
        scratch = torch.empty(q.shape, dtype=torch.int16, device=q.device)
    if q.dtype == torch.float8_e5m2:
        # e5m2 is the top byte of an fp16.
        scratch.copy_(q.view(torch.uint8))
        scratch.bitwise_left_shift_(8)
        out.copy_(scratch.view(torch.float16))
        return out
    if q.dtype != torch.float8_e4m3fn:
        raise UnsupportedConfigError(f"{q.dtype} is not an FP8 dtype", reason=Reason.UNSUPPORTED_DTYPE)
    h16, nan_mask = _fp8_widen_div256(q, scratch, torch.empty(q.shape, dtype=torch.uint8, device=q.device))
    out.copy_(h16)
    out.mul_(256.0)  # a power of two: exact
    if nan_mask is not None:
        out.masked_fill_(nan_mask, float("nan"))
    return out


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    out_dtype: torch.dtype = torch.float16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``float(q) * scale`` (fp32, one rounding) cast to ``out_dtype`` or written into ``out``."""
    t, h, d = q.shape
    out = output_for(out, (t, h, d), out_dtype, q.device, same_dtype=False)
    if q.numel() == 0:
        return out
    ts = token_scales(scales.to(q.device), scope, t, h, page_size)
    bt = _block_tokens(h, d, q.device)
    scratch = torch.empty((min(bt, t), h, d), dtype=torch.float32, device=q.device)
    # On CPU, widen q/256 by bit operations and multiply by 256*scale: the
    # product is the same real number as q*scale, so its single rounding is
    # too (256*scale is exact unless it overflows, which is checked).
    fast = q.device.type == "cpu" and q.dtype == torch.float8_e4m3fn
    if fast:
        s32 = scales.to(torch.float32)
        fast = bool(torch.isfinite(s32 * 256.0).all()) or not bool(torch.isfinite(s32).all())
        iscratch = torch.empty(scratch.shape, dtype=torch.int16)
        probe = torch.empty(scratch.shape, dtype=torch.uint8)
    for t0 in range(0, t, bt):
        t1 = min(t, t0 + bt)
        buf = scratch[: t1 - t0]
        if fast:
            # Separate widen / multiply / narrow passes: torch's mixed-dtype
            # kernels (fp16 x fp32 -> fp16) are many times slower on CPU.
            h16, nan_mask = _fp8_widen_div256(q[t0:t1], iscratch[: t1 - t0], probe[: t1 - t0])
            buf.copy_(h16)
            buf.mul_(ts[t0:t1] * 256.0)
            if nan_mask is not None:
                buf.masked_fill_(nan_mask, float("nan"))
        elif q.device.type == "cpu":
            fp8_to_float32(q[t0:t1], buf)
            buf.mul_(ts[t0:t1])
        else:
            buf.copy_(q[t0:t1])
            buf.mul_(ts[t0:t1])
        out[t0:t1].copy_(buf)
    return out


class ReferenceBackend(TwoPass):
    """The :class:`~kvcodec.backends.base.Backend` in torch ops: never declines."""

    name = "torch"

    def scales(self, v: torch.Tensor, groups: Groups, nonfinite: NonFinitePolicy) -> torch.Tensor:
        """fp32 scales of ``v``."""
        g = groups
        return compute_scales(v, g.scope, page_size=g.page_size, fp8_dtype=g.fp8_dtype, nonfinite=nonfinite)

    def quantize(
        self, v: torch.Tensor, scales: torch.Tensor, groups: Groups, *, out: torch.Tensor
    ) -> torch.Tensor:
        """FP8 codes of ``v`` with the caller's scales."""
        g = groups
        return quantize(v, scales, g.scope, page_size=g.page_size, fp8_dtype=g.fp8_dtype, out=out)

    def dequantize(
        self, q: torch.Tensor, scales: torch.Tensor, groups: Groups, *, out: torch.Tensor
    ) -> torch.Tensor:
        """``float(q) * scale`` into ``out``."""
        g = groups
        return dequantize(q, scales, g.scope, page_size=g.page_size, out_dtype=out.dtype, out=out)


BACKEND = ReferenceBackend()
