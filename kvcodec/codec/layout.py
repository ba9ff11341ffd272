"""Arguments in the shapes the codec works in: token-major tensors, scopes, identity hashes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CodecMismatchError, Reason, UnsupportedConfigError
from ..format import HASH_KEYS, Hashes, ScaleScope
from ..hostmem import copy_tensor

__all__ = ["Layout", "ScopeLike", "check_hashes", "normalize_layout", "resolve_scope"]

ScopeLike = ScaleScope | int | str


@dataclass(frozen=True)
class Layout:
    """How a tensor maps onto token-major ``[tokens, heads, head_dim]``."""

    tokens: int
    heads: int
    head_dim: int
    page_size: int | None
    """Tokens per page when the input was paged (or pages were named), else None."""


_SCOPE_ALIASES = {
    "per_tensor": ScaleScope.PER_TENSOR,
    "tensor": ScaleScope.PER_TENSOR,
    "per_layer_head": ScaleScope.PER_LAYER_HEAD,
    "layer_head": ScaleScope.PER_LAYER_HEAD,
    "per_page_head": ScaleScope.PER_PAGE_HEAD,
    "page_head": ScaleScope.PER_PAGE_HEAD,
    "external": ScaleScope.EXTERNAL,
    "none": ScaleScope.NONE,
    "raw": ScaleScope.NONE,
}


def resolve_scope(scope: ScopeLike) -> ScaleScope:
    """A :class:`ScaleScope` from an enum, its value, or a name like ``"per_page_head"``."""
    if isinstance(scope, ScaleScope):
        return scope
    if isinstance(scope, str):
        try:
            return _SCOPE_ALIASES[scope.lower()]
        except KeyError:
            raise UnsupportedConfigError(
                f"unknown scale scope {scope!r}; expected one of {sorted(_SCOPE_ALIASES)}",
                reason=Reason.BAD_SCOPE,
            ) from None
    try:
        return ScaleScope(int(scope))
    except (ValueError, TypeError):
        raise UnsupportedConfigError(f"unknown scale scope {scope!r}", reason=Reason.BAD_SCOPE) from None


def _norm_axis(axis: int, ndim: int, name: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise UnsupportedConfigError(
            f"{name} must be an int; got {type(axis).__name__} {axis!r}", reason=Reason.BAD_TYPE
        )
    if not -ndim <= axis < ndim:
        raise UnsupportedConfigError(
            f"{name}={axis} out of range for a {ndim}-D tensor", reason=Reason.BAD_VALUE
        )
    return axis % ndim


def normalize_layout(
    x: torch.Tensor, *, head_axis: int | None = None, page_axis: int | None = None
) -> tuple[torch.Tensor, Layout]:
    """View ``x`` as token-major ``[tokens, heads, head_dim]``.

    Accepts ``[tokens, heads, head_dim]``, paged ``[pages, page_size, heads,
    head_dim]``, or any 3-D/4-D order named by ``head_axis`` (and ``page_axis``
    for 4-D; in 3-D a ``page_axis`` means one page per index). head_dim is the
    last axis. No copy is made where a view is possible.
    """
    if x.requires_grad:
        x = x.detach()
    nd = x.dim()
    if nd == 3 and head_axis is None and page_axis is None:  # token-major already: no op at all
        return x, Layout(x.shape[0], x.shape[1], x.shape[2], None)
    if nd not in (3, 4):
        raise UnsupportedConfigError(
            f"expected a 3-D [tokens, heads, head_dim] or 4-D [pages, page_size, heads, head_dim] "
            f"tensor; got shape {tuple(x.shape)}",
            reason=Reason.BAD_SHAPE,
        )
    h_ax = _norm_axis(-2 if head_axis is None else head_axis, nd, "head_axis")
    if h_ax == nd - 1:
        raise UnsupportedConfigError(
            f"head_axis={head_axis} names the last axis, which is head_dim", reason=Reason.BAD_VALUE
        )
    p_ax = None if page_axis is None else _norm_axis(page_axis, nd, "page_axis")
    if p_ax is not None and p_ax in (h_ax, nd - 1):
        raise UnsupportedConfigError(
            f"page_axis={page_axis} collides with head_axis={head_axis} or head_dim (last axis)",
            reason=Reason.BAD_VALUE,
        )
    rest = [a for a in range(nd - 1) if a != h_ax]
    if nd == 3:
        (t_ax,) = rest
        if p_ax is not None and p_ax != t_ax:
            raise UnsupportedConfigError(
                f"page_axis={page_axis} is not the token axis {t_ax}", reason=Reason.BAD_VALUE
            )
        y = x.permute(t_ax, h_ax, nd - 1)
        return y, Layout(y.shape[0], y.shape[1], y.shape[2], 1 if p_ax is not None else None)
    if p_ax is None:
        p_ax = rest[0]
    (s_ax,) = [a for a in rest if a != p_ax]
    y = x.permute(p_ax, s_ax, h_ax, nd - 1)
    pages, ps, heads, dim = y.shape
    return _merge_pages(y), Layout(pages * ps, heads, dim, ps)


def _merge_pages(y: torch.Tensor) -> torch.Tensor:
    """``[pages, page_size, H, D]`` as ``[tokens, H, D]``: a view, or one single-threaded copy."""
    pages, ps, heads, dim = y.shape
    try:
        return y.view(pages * ps, heads, dim)
    except RuntimeError:  # pages and slots not evenly strided: copy (numpy, on this thread)
        out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
        copy_tensor(out, y)
        return out.view(pages * ps, heads, dim)


def check_hashes(got: Hashes, expected: Any, *, strict: bool = False) -> None:
    """Refuse a blob whose identity hashes differ from ``expected``.

    Empty strings are wildcards on either side, as in LMCache. With
    ``strict``, a non-empty expected value must also be present in the blob.
    """
    exp = Hashes.coerce(expected)
    for key in HASH_KEYS:
        ev, gv = getattr(exp, key), getattr(got, key)
        if not ev:
            continue
        if gv and gv != ev:
            raise CodecMismatchError(
                f"codec hash mismatch on {key!r}: encoded={gv!r}, expected={ev!r}",
                reason=Reason.HASH_MISMATCH,
            )
        if not gv and strict:
            raise CodecMismatchError(
                f"codec hash {key!r} missing from the blob (strict): expected={ev!r}, encoded=''",
                reason=Reason.HASH_MISSING,
            )
