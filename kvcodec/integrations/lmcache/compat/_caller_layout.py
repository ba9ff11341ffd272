"""V kept in the caller's layout: LMCache's semantics for tensors that are not token-major.

LMCache stores a V that is not ``[tokens, heads, head_dim]`` (or paged
``[pages, page_size, heads, head_dim]``) as its contiguous bytes, with the
layout fields only as the caller gave them, so the caller's reshape restores
it. kvcodec's decoder reads V token-major; these checks refuse the layout
fields under which it would then dequantize V under other groups than those V
was quantized in.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ....errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from ....format import ParsedBlob, ScaleScope, parse
from ._quant import axis_index

__all__ = ["check_caller_fields", "is_token_major", "parse_own"]


def _caller_reading(v: torch.Tensor, scope: ScaleScope, head: int, page: int | None) -> dict[str, int] | None:
    """The layout fields under which kvcodec's decoder, reading ``v``'s contiguous bytes as
    token-major ``[tokens, heads, head_dim]``, finds V's scale groups (None: no such fields).

    Axes before the head axis are tokens, axes after it head_dim; per page-head,
    the page axis must lead and the axes between it and the head are the page's tokens.
    """
    shape = tuple(v.shape)
    fields = {"kv_head_count": shape[head], "head_dim": math.prod(shape[head + 1 :])}
    if scope == ScaleScope.PER_PAGE_HEAD:
        if page != 0 or head <= page:
            return None
        fields["page_size"] = math.prod(shape[1:head])
    return fields


def check_caller_fields(
    v: torch.Tensor, scope: ScaleScope, head_axis: int, page_axis: int | None, given: dict[str, int]
) -> None:
    """Refuse layout fields that would make kvcodec's decoder regroup a caller-layout V wrongly.

    The decoder dequantizes per-head scopes only when kv_head_count and head_dim
    are both set; then they (and page_size) must describe the bytes as they lie.
    """
    if scope not in (ScaleScope.PER_LAYER_HEAD, ScaleScope.PER_PAGE_HEAD):
        return
    if given.get("kv_head_count", -1) == -1 or given.get("head_dim", -1) == -1:
        return
    nd = v.dim()
    head = axis_index(head_axis, nd, "head_axis")
    page = axis_index(page_axis, nd, "page_axis") if scope == ScaleScope.PER_PAGE_HEAD else None
    want = _caller_reading(v, scope, head, page)
    bad = None if want is None else {n: x for n, x in want.items() if given.get(n, -1) not in (-1, x)}
    if want is None or bad:
        fit = "no layout fields describe it" if want is None else f"the fields that describe it are {want}"
        raise UnsupportedConfigError(
            f"encode: V is stored in the caller's layout {tuple(v.shape)} (head_axis={head_axis}, "
            f"page_axis={page_axis}); kv_head_count/head_dim/page_size {given} would make kvcodec's decoder "
            f"read it as [tokens, heads, head_dim] under the wrong {scope.name} groups; {fit}. "
            "Pass V token-major, or leave kv_head_count/head_dim unset",
            reason=Reason.BAD_VALUE,
        )


def is_token_major(v: torch.Tensor, head_axis: int, page_axis: int | None) -> bool:
    """Whether ``v``'s contiguous bytes are already token-major [T,H,D] / [P,S,H,D]."""
    nd = v.dim()
    if nd not in (3, 4) or head_axis % nd != nd - 2:
        return False
    return page_axis is None or page_axis % nd == 0


def parse_own(blob: Any) -> ParsedBlob:
    """Parse a blob this layer just wrote; inconsistent caller fields are the caller's error."""
    try:
        return parse(blob, verify_crc=False)
    except CorruptEncodedKVError as e:
        raise UnsupportedConfigError(
            f"the layout fields given make an inconsistent blob: {e}", reason=Reason.INCONSISTENT_PAYLOAD
        ) from None
