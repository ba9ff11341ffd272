"""The naive oracle: docs/FORMAT.md's quantization convention written the plainest way.

One Python loop over scale groups, torch's own ops and torch's own float8
cast; slow on purpose and independent of every backend's tricks (block
loops, bit-level widening, C, Triton). Every backend is tested against it.
"""

from __future__ import annotations

import torch

__all__ = ["groups", "oracle_dequantize", "oracle_encode", "oracle_quantize", "oracle_scales"]


def groups(scope: str, tokens: int, heads: int, page_size: int | None) -> list[tuple[tuple, tuple]]:
    """(index into [tokens, heads, :], index into the scale tensor) for each scale group."""
    if scope == "per_tensor":
        return [((slice(None), slice(None)), ())]
    if scope == "per_layer_head":
        return [((slice(None), slice(h, h + 1)), (h,)) for h in range(heads)]
    ps = int(page_size)
    pages = (tokens + ps - 1) // ps
    return [
        ((slice(p * ps, (p + 1) * ps), slice(h, h + 1)), (p, h)) for p in range(pages) for h in range(heads)
    ]


def _scale_shape(scope: str, tokens: int, heads: int, page_size: int | None) -> tuple[int, ...]:
    if scope == "per_tensor":
        return ()
    if scope == "per_layer_head":
        return (heads,)
    return ((tokens + int(page_size) - 1) // int(page_size), heads)


def oracle_scales(v: torch.Tensor, scope: str, page_size: int | None, fp8: torch.dtype) -> torch.Tensor:
    """fp32 ``amax(|V|) / fp8_max`` per group, 1.0 for an all-zero group."""
    t, h, _ = v.shape
    qmax = torch.tensor(torch.finfo(fp8).max, dtype=torch.float32)
    out = torch.empty(_scale_shape(scope, t, h, page_size), dtype=torch.float32)
    for vs, si in groups(scope, t, h, page_size):
        amax = v[vs].to(torch.float32).abs().max()
        out[si] = amax / qmax if amax > 0 else torch.tensor(1.0)
    return out


def oracle_quantize(
    v: torch.Tensor, scales: torch.Tensor, scope: str, page_size: int | None, fp8: torch.dtype
) -> torch.Tensor:
    """``(V / scale).clamp(±fp8_max)`` cast with torch's own float8 conversion."""
    t, h, _ = v.shape
    qmax = torch.finfo(fp8).max
    q = torch.empty(v.shape, dtype=fp8)
    for vs, si in groups(scope, t, h, page_size):
        s = scales[si].to(torch.float32)
        q[vs] = (v[vs].to(torch.float32) / s).clamp(-qmax, qmax).to(fp8)
    return q


def oracle_encode(
    v: torch.Tensor, scope: str, page_size: int | None, fp8: torch.dtype, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales as stored and the codes made with them (LMCache quantizes with the stored scales)."""
    scales = oracle_scales(v, scope, page_size, fp8).to(scale_dtype)
    return scales, oracle_quantize(v, scales, scope, page_size, fp8)


def oracle_dequantize(
    q: torch.Tensor, scales: torch.Tensor, scope: str, page_size: int | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """``float(q) * scale`` in fp32, then cast to ``out_dtype``."""
    t, h, _ = q.shape
    out = torch.empty(q.shape, dtype=out_dtype)
    for vs, si in groups(scope, t, h, page_size):
        out[vs] = (q[vs].to(torch.float32) * scales[si].to(torch.float32)).to(out_dtype)
    return out
