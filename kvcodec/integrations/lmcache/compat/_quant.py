"""LMCache's layout-agnostic quant primitives (``compute_v_scales``, ``quantize_v_fp8``, ``dequantize_v_fp8``).

LMCache groups V by a ``head_axis`` (and a ``page_axis``) of any tensor;
kvcodec's backends work on ``[tokens, heads, head_dim]``. :func:`canon` views
the caller's tensor so that LMCache's groups are kvcodec's, the backend kvcodec
picks does the work, and :func:`uncanon` puts the result back in the caller's
shape. Argument checks name a :class:`UnsupportedConfigError` where LMCache
would let an ``AttributeError`` or ``RuntimeError`` escape.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .... import backends
from ....backends import reference as ref
from ....errors import Reason, UnsupportedConfigError
from ....format import ScaleScope
from ....numerics import FP8_DTYPES, amax_to_scale, fp8_max, scale_shape

__all__ = [
    "axis_index",
    "canon",
    "compute_v_scales",
    "dequantize_v_fp8",
    "device_arg",
    "dtype_arg",
    "lm_scope",
    "quantize_v_fp8",
    "tensor_arg",
    "uncanon",
]

Canonical = tuple[torch.Tensor, ScaleScope, int | None, tuple[int, ...], list[int]]
"""(3-D view, scope, page size, moved shape, permutation to undo) as :func:`canon` returns them."""


def _fp8_max(dtype: torch.dtype) -> float:
    if dtype not in FP8_DTYPES:
        raise UnsupportedConfigError(
            f"compute_v_scales: dtype {dtype} is not an FP8 dtype", reason=Reason.UNSUPPORTED_DTYPE
        )
    return fp8_max(dtype)


def tensor_arg(x: Any, what: str) -> torch.Tensor:
    """``x`` itself when it is a tensor (LMCache would fail on it with an AttributeError)."""
    if not isinstance(x, torch.Tensor):
        raise UnsupportedConfigError(
            f"{what} must be a torch.Tensor; got {type(x).__name__}", reason=Reason.BAD_TYPE
        )
    return x


def dtype_arg(x: Any, what: str) -> torch.dtype:
    """``x`` itself when it is a torch dtype."""
    if not isinstance(x, torch.dtype):
        raise UnsupportedConfigError(f"{what} must be a torch.dtype; got {x!r}", reason=Reason.BAD_TYPE)
    return x


def device_arg(device: Any) -> torch.device:
    """LMCache's ``device or cpu``, a bad device named as a config error."""
    try:
        return torch.device(device) if device is not None else torch.device("cpu")
    except (RuntimeError, TypeError, ValueError) as e:
        raise UnsupportedConfigError(
            f"decode: bad device {device!r}: {e}", reason=Reason.BAD_DEVICE
        ) from None


_LMCACHE_SCOPES = (
    ScaleScope.PER_TENSOR,
    ScaleScope.PER_LAYER_HEAD,
    ScaleScope.PER_PAGE_HEAD,
    ScaleScope.EXTERNAL,
)


def lm_scope(scope: Any, what: str = "scope") -> ScaleScope:
    """One of LMCache's four scopes (an enum member or its value)."""
    if (
        isinstance(scope, bool)
        or not isinstance(scope, int)
        or scope not in {int(s) for s in _LMCACHE_SCOPES}
    ):
        raise UnsupportedConfigError(
            f"unsupported {what}: {scope!r}; expected one of {[s.name for s in _LMCACHE_SCOPES]}",
            reason=Reason.BAD_SCOPE,
        )
    return ScaleScope(scope)


def axis_index(axis: Any, nd: int, what: str) -> int:
    """``axis`` of an ``nd``-D tensor as a non-negative index."""
    if isinstance(axis, bool) or not isinstance(axis, int) or not -nd <= axis < nd:
        raise UnsupportedConfigError(
            f"{what}={axis!r} is not an axis of a {nd}-D tensor", reason=Reason.BAD_VALUE
        )
    return axis % nd


def canon(x: Any, scope: Any, head_axis: Any, page_axis: Any, who: str) -> Canonical:
    """View ``x`` as kvcodec's [tokens, heads, dim] such that LMCache's groups map onto ours.

    Returns the 3-D tensor, the scope, the page size to use (one page per
    index of LMCache's page axis), the moved shape and the permutation to undo.
    """
    x = tensor_arg(x, f"{who}: the tensor").detach()
    scope = lm_scope(scope)
    nd = x.dim()
    if scope == ScaleScope.PER_TENSOR:
        return x.reshape(1, 1, -1), scope, None, tuple(x.shape), list(range(nd))
    if scope == ScaleScope.EXTERNAL:
        raise UnsupportedConfigError(f"{who}: unsupported scope: {scope}", reason=Reason.BAD_SCOPE)
    if nd == 0:
        raise UnsupportedConfigError(
            f"{who}({scope.name}) needs a tensor with a head axis; got a 0-D one", reason=Reason.BAD_SHAPE
        )
    head = axis_index(head_axis, nd, "head_axis")
    if scope == ScaleScope.PER_LAYER_HEAD:
        order = [head] + [d for d in range(nd) if d != head]
        y = x.permute(order)
        return y.reshape(1, x.shape[head], -1), scope, None, tuple(y.shape), order
    if page_axis is None:
        raise UnsupportedConfigError(
            f"{who}(PER_PAGE_HEAD) requires page_axis", reason=Reason.MISSING_ARGUMENT
        )
    page = axis_index(page_axis, nd, "page_axis")
    if page == head:
        raise UnsupportedConfigError(
            f"{who}(PER_PAGE_HEAD): page_axis and head_axis are the same axis ({page})",
            reason=Reason.BAD_VALUE,
        )
    order = [page, head] + [d for d in range(nd) if d not in (page, head)]
    y = x.permute(order)
    return y.reshape(x.shape[page], x.shape[head], -1), scope, 1, tuple(y.shape), order


def uncanon(y3: torch.Tensor, moved: tuple[int, ...], order: list[int]) -> torch.Tensor:
    """Undo :func:`canon`: ``y3`` back in the caller's shape (contiguous)."""
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return y3.reshape(moved).permute(inv).contiguous()


def _scales_for(
    scales: Any, x3: torch.Tensor, scope: ScaleScope, page_size: int | None, who: str
) -> torch.Tensor:
    """The caller's scales shaped as kvcodec's for the canonical ``x3``, on its device."""
    s = tensor_arg(scales, f"{who}: scales")
    shape = scale_shape(scope, x3.shape[0], x3.shape[1], page_size)
    if s.numel() != math.prod(shape):
        raise UnsupportedConfigError(
            f"{who}: {s.numel()} scales given; {scope.name} over this tensor has {math.prod(shape)} {shape}",
            reason=Reason.BAD_SCALES,
        )
    return s.detach().to(x3.device).reshape(shape)


def _dispatch(
    op: str, x3: torch.Tensor, scales: torch.Tensor, groups: backends.Groups, out_dtype: torch.dtype
) -> torch.Tensor:
    """``op`` (quantize / dequantize) by the backend kvcodec picks for ``x3``'s device."""
    out = torch.empty(x3.shape, dtype=out_dtype, device=x3.device)
    if x3.numel() == 0:
        return out
    return backends.call(backends.select(None, x3.device), op, x3, scales, groups, out=out)


def compute_v_scales(
    v: torch.Tensor,
    scope: ScaleScope,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    head_axis: int = -2,
    page_axis: int | None = None,
) -> torch.Tensor:
    """fp32 scales of ``v``: () per tensor, (heads,) per layer-head, (pages, heads) per page-head."""
    qmax = _fp8_max(fp8_dtype)
    if scope == ScaleScope.EXTERNAL:
        raise UnsupportedConfigError(
            "compute_v_scales does not produce EXTERNAL scales; the caller is expected to attach them.",
            reason=Reason.BAD_SCOPE,
        )
    v3, sc, ps, _, _ = canon(v, scope, head_axis, page_axis, "compute_v_scales")
    # Quietly like LMCache: NaN/Inf groups give whatever the formula gives. Torch
    # reductions only (no backend computes scales without also quantizing).
    s = amax_to_scale(ref.reduce_groups(ref.token_head_amax(v3), sc, ps), qmax)
    return s.reshape(()) if sc == ScaleScope.PER_TENSOR else s


def quantize_v_fp8(
    v: torch.Tensor,
    scales: torch.Tensor,
    scope: ScaleScope,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    head_axis: int = -2,
    page_axis: int | None = None,
) -> torch.Tensor:
    """FP8 of ``v`` under ``scales`` (saturating), same shape as ``v``."""
    _fp8_max(fp8_dtype)
    v3, sc, ps, moved, order = canon(v, scope, head_axis, page_axis, "quantize_v_fp8")
    s = _scales_for(scales, v3, sc, ps, "quantize_v_fp8")
    return uncanon(_dispatch("quantize", v3, s, backends.Groups(sc, ps, fp8_dtype), fp8_dtype), moved, order)


def dequantize_v_fp8(
    q: torch.Tensor,
    scales: torch.Tensor,
    scope: ScaleScope,
    *,
    out_dtype: torch.dtype = torch.float16,
    head_axis: int = -2,
    page_axis: int | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_v_fp8`, in ``out_dtype``."""
    out_dtype = dtype_arg(out_dtype, "dequantize_v_fp8: out_dtype")
    q3, sc, ps, moved, order = canon(q, scope, head_axis, page_axis, "dequantize_v_fp8")
    if q3.dtype not in FP8_DTYPES:
        raise UnsupportedConfigError(
            f"dequantize_v_fp8: codes must be an FP8 dtype; got {q3.dtype}", reason=Reason.UNSUPPORTED_DTYPE
        )
    s = _scales_for(scales, q3, sc, ps, "dequantize_v_fp8")
    return uncanon(_dispatch("dequantize", q3, s, backends.Groups(sc, ps, q3.dtype), out_dtype), moved, order)
