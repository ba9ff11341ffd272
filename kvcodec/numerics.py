"""The codec's numerics in one place: FP8 limits, scale groups, the scale rule, checks.

For each scale group (whole tensor; one head over all tokens; one page x one
head, a partial last page over the tokens it holds)::

    scale = amax(|V|) / fp8_max          (fp32, IEEE division; 1.0 if amax == 0)
    q     = RNE(clamp(V / scale, -fp8_max, fp8_max))   as float8
    V_hat = float(q) * scale              (one rounding, to the output dtype)

These are LMCache's numerics; every backend must equal them bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from .errors import Reason, UnsupportedConfigError
from .format import COMPUTED_SCOPES, FLOAT8_DTYPES, ScaleScope, expected_scale_shape

__all__ = [
    "COMPUTED_SCOPES",
    "FP8_DTYPES",
    "ZERO_SCALE",
    "NonFinitePolicy",
    "ScaleScope",
    "amax_to_scale",
    "check_amax",
    "check_finite_amax",
    "check_layers_amax",
    "check_scales",
    "fp8_max",
    "group_name",
    "narrow_scales",
    "output_for",
    "scale_shape",
    "token_scales",
]

FP8_DTYPES: tuple[torch.dtype, ...] = tuple(getattr(torch, d.name) for d in FLOAT8_DTYPES)
"""The FP8 formats V may be stored in, as torch dtypes (format.FLOAT8_DTYPES)."""
ZERO_SCALE = 1.0
"""The scale of an all-zero group (any nonzero value decodes zeros exactly)."""

NonFinitePolicy = Literal["error", "saturate"]


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype: 448 (e4m3fn) or 57344 (e5m2)."""
    if dtype not in FP8_DTYPES:
        raise UnsupportedConfigError(
            f"{dtype} is not an FP8 dtype; expected one of {FP8_DTYPES}", reason=Reason.UNSUPPORTED_DTYPE
        )
    return float(torch.finfo(dtype).max)


def scale_shape(scope: ScaleScope, tokens: int, heads: int, page_size: int | None) -> tuple[int, ...]:
    """Shape of the scale tensor a scope gives for a ``[tokens, heads, *]`` chunk."""
    if scope == ScaleScope.PER_PAGE_HEAD and (type(page_size) is not int or page_size < 1):
        raise UnsupportedConfigError(
            f"per_page_head needs an int page_size >= 1; got {page_size!r}",
            reason=Reason.MISSING_ARGUMENT if page_size is None else Reason.BAD_VALUE,
        )
    shape = expected_scale_shape(scope, tokens, heads, page_size or 1)
    if shape is None:
        raise UnsupportedConfigError(
            f"scope {ScaleScope(scope).name} has no computed scales", reason=Reason.BAD_SCOPE
        )
    return shape


def amax_to_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``amax / qmax`` in fp32 (IEEE division), 1.0 where the group is all zeros."""
    scale = torch.div(amax, torch.tensor(qmax, dtype=torch.float32, device=amax.device))
    return torch.where(amax > 0, scale, torch.full_like(scale, ZERO_SCALE))


def group_name(scope: ScaleScope, idx: tuple[int, ...]) -> str:
    """Human name of one scale group, for error messages."""
    if scope == ScaleScope.PER_TENSOR:
        return "the whole tensor"
    if scope == ScaleScope.PER_LAYER_HEAD:
        return f"head {idx[0]}"
    return f"page {idx[0]}, head {idx[1]}"


def check_finite_amax(amax: torch.Tensor, scope: ScaleScope) -> None:
    """Refuse NaN/Inf in any group's absmax, naming the first such group (a device sync on GPU)."""
    bad = ~torch.isfinite(amax)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0]) if amax.dim() else ()
        raise UnsupportedConfigError(
            f"V holds NaN or Inf in {group_name(scope, idx)} ({scope.name}); "
            "refusing to write a blob with a meaningless scale (pass nonfinite='saturate' "
            "to scale by the finite values)",
            reason=Reason.NONFINITE_V,
        )


def check_amax(amax: torch.Tensor, scope: ScaleScope, fp8_dtype: torch.dtype) -> None:
    """Refuse the group absmax a fused kernel computed if the other paths would refuse its blob:
    NaN/Inf, or a nonzero absmax whose fp32 scale ``amax / fp8 max`` underflows to 0 (fp32 V)."""
    check_finite_amax(amax, scope)
    narrow_scales(amax_to_scale(amax.float(), fp8_max(fp8_dtype)), torch.float32, scope)


def check_layers_amax(
    amax: torch.Tensor, scope: ScaleScope, fp8_dtype: torch.dtype, layer_ids: Sequence[int]
) -> None:
    """:func:`check_amax` for every layer of a fused launch's ``[L, *scale_shape]`` absmax, naming the
    first bad layer (vectorised; numpy for a host tensor: a few µs when all is well)."""
    a = amax.reshape(amax.shape[0], -1).float()
    if a.device.type == "cpu":
        x = a.numpy()
        with np.errstate(all="ignore"):
            ok = (np.isfinite(x) & ((x / np.float32(fp8_max(fp8_dtype)) > 0) | (x == 0))).all(axis=1)
    else:
        ok = (torch.isfinite(a) & ((a / fp8_max(fp8_dtype) > 0) | (a == 0))).all(dim=1).cpu().numpy()
    if ok.all():
        return
    bad = int(np.flatnonzero(~ok)[0])
    try:
        check_amax(amax[bad], scope, fp8_dtype)
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(f"layer {layer_ids[bad]}: {e}", reason=e.reason) from None


def check_scales(scales: torch.Tensor, scope: ScaleScope, what: str = "scale") -> None:
    """Refuse any scale that is not finite and positive: it would decode to NaN, Inf or flipped signs."""
    bad = ~(torch.isfinite(scales) & (scales > 0))
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0]) if bad.dim() else ()
        value = float(scales[idx] if idx else scales)
        raise UnsupportedConfigError(
            f"{what} {value:.3g} of {group_name(scope, idx)} is not a finite positive number; "
            "V would decode to NaN or Inf",
            reason=Reason.BAD_SCALES,
        )


def narrow_scales(scales: torch.Tensor, scale_dtype: torch.dtype, scope: ScaleScope) -> torch.Tensor:
    """``scales`` cast to the stored dtype; refuses a group whose scale the cast (or fp32 itself) ruins.

    fp16 scales overflow above 65504 and flush to zero below 6e-8, and an fp32
    scale underflows to zero for amax below ~6e-43: LMCache writes such blobs,
    and they decode to Inf/NaN. kvcodec refuses them, naming the group.
    """
    out = scales.to(scale_dtype)
    bad = ~(torch.isfinite(out) & (out > 0)) & torch.isfinite(scales)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0]) if bad.dim() else ()
        raise UnsupportedConfigError(
            f"scale {float(scales[idx] if idx else scales):.3g} of {group_name(scope, idx)} does not fit "
            f"{scale_dtype} (it becomes {float(out[idx] if idx else out)})"
            + (
                "; use scale_dtype=torch.float32"
                if scale_dtype != torch.float32
                else "; V is too small to scale"
            ),
            reason=Reason.BAD_SCALES,
        )
    return out


def token_scales(
    scales: torch.Tensor, scope: ScaleScope, tokens: int, heads: int, page_size: int | None
) -> torch.Tensor:
    """fp32 scales broadcastable against ``[tokens, heads, head_dim]``.

    Memory is bounded by the tokens present: a page's scale is gathered per
    token, never expanded to ``pages * page_size`` rows (a header may declare
    any page size).
    """
    s = scales.to(torch.float32)
    want = scale_shape(scope, tokens, heads, page_size)
    if tuple(s.shape) != want:
        raise UnsupportedConfigError(
            f"scales of shape {tuple(s.shape)} do not fit scope {scope.name} over "
            f"{tokens} tokens x {heads} heads (page_size {page_size}); expected {want}",
            reason=Reason.BAD_SCALES,
        )
    if scope == ScaleScope.PER_TENSOR:
        return s.reshape(1, 1, 1).expand(tokens, 1, 1)
    if scope == ScaleScope.PER_LAYER_HEAD:
        return s.reshape(1, heads, 1).expand(tokens, heads, 1)
    page_of_token = torch.arange(tokens, device=s.device) // int(page_size or 1)
    return s.index_select(0, page_of_token).unsqueeze(-1)


def output_for(
    out: torch.Tensor | None,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    *,
    same_dtype: bool,
) -> torch.Tensor:
    """The caller's ``out`` checked against ``shape`` (and ``dtype`` if ``same_dtype``), or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or (same_dtype and out.dtype != dtype):
        want = f"{shape} {dtype}" if same_dtype else f"{shape}"
        got = f"{tuple(out.shape)} {out.dtype}" if same_dtype else f"{tuple(out.shape)}"
        raise UnsupportedConfigError(f"out is {got}; expected {want}", reason=Reason.BAD_OUTPUT)
    return out
