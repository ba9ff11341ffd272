"""Triton kernels for vLLM paged KV caches, equal to :mod:`kvcodec.paged` bit for bit.

* :func:`gather_chunk` / :func:`scatter_chunk`: copy a chunk's tokens between
  the blocks and ``[T, H, D]`` tensors (any strides; K and V in one launch).
* :func:`encode_paged` / :func:`encode_paged_layers`: the fused encode of
  :mod:`kvcodec.kernels.quant_triton` reading K and V straight from the
  blocks (no staging copy) into the payload.
* :func:`decode_paged` / :func:`decode_paged_layers`: decode a payload
  straight into the blocks.

Scale pages (``page_size``) and cache blocks (``block_size``) are independent:
either may be a multiple of the other, or neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from ..errors import UnsupportedConfigError
from ..format import ScaleScope
from ..paged import BlockIds, Layout, _check_src, _check_tokens, _fp8_view, block_ids_tensor, kv_views
from ._tl import layer_off, row_off
from .quant_triton import (
    K_ELEM_VIEW,
    KERNELS,
    V_DTYPES,
    Strategy,
    _check_device,
    _check_scope,
    _decode_core,
    _encode_core,
    _launch_tiles,
    _listed,
    _out_view,
    _payload_bytes,
    _payload_layers,
    _pow2,
    _Rows,
    _same_layout,
    _tab,
    _tuned,
)

__all__ = [
    "decode_paged",
    "decode_paged_layers",
    "encode_paged",
    "encode_paged_layers",
    "gather_chunk",
    "scatter_chunk",
]


@triton.jit
def _copy_rows_kernel(
    src_ptr, dst_ptr, tbl_ptr, s_ltab, d_ltab,
    T, BS,
    s_st, s_sh, s_sd, s_sb, s_sl,
    d_st, d_sh, d_sd, d_sb, d_sl,
    D: tl.constexpr, SRC_PAGED: tl.constexpr, DST_PAGED: tl.constexpr,
    S_TAB: tl.constexpr, D_TAB: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Copy BLOCK_T token rows x one head of one tensor ("layer" axis: K/V, model layers)."""
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2)
    s_base = src_ptr + layer_off(layer, s_ltab, s_sl, S_TAB)
    d_base = dst_ptr + layer_off(layer, d_ltab, d_sl, D_TAB)
    t = i * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    d = tl.arange(0, BLOCK_D)
    d64 = d.to(tl.int64)
    m2 = tm[:, None] & (d < D)[None, :]
    srow = row_off(t, tm, tbl_ptr, s_st, s_sb, BS, SRC_PAGED)
    drow = row_off(t, tm, tbl_ptr, d_st, d_sb, BS, DST_PAGED)
    x = tl.load(s_base + srow[:, None] + h * s_sh + d64[None, :] * s_sd, mask=m2, other=0)
    tl.store(d_base + drow[:, None] + h * d_sh + d64[None, :] * d_sd, x, mask=m2)


_copy_rows_tuned = _tuned(_copy_rows_kernel, "_copy_rows_kernel")
KERNELS["_copy_rows_kernel"] = (_copy_rows_kernel, _copy_rows_tuned)


def _cache_rows(caches: Sequence[torch.Tensor], view: torch.dtype | None) -> _Rows:
    """Paged rows of same-layout ``[num_blocks, block_size, H, D]`` views (one per "layer")."""
    lay = _listed(caches, view)
    st = lay.base.stride()
    return _Rows(lay, st[1], st[2], st[3], st[0])


def _dense(xs: Sequence[torch.Tensor], view: torch.dtype | None) -> _Rows:
    lay = _listed(xs, view)
    st = lay.base.stride()
    return _Rows(lay, st[0], st[1], st[2])


def _copy(src: _Rows, dst: _Rows, *, src_paged: bool, dst_paged: bool, tbl: torch.Tensor,
          tokens: int, heads: int, dim: int, block_size: int) -> None:  # fmt: skip
    s_tab, s_has = _tab(src.layers)
    d_tab, d_has = _tab(dst.layers)
    kw: dict[str, Any] = {
        "src_ptr": src.layers.base, "dst_ptr": dst.layers.base, "tbl_ptr": tbl,
        "s_ltab": s_tab if s_has else tbl, "d_ltab": d_tab if d_has else tbl,
        "T": tokens, "BS": block_size, **src.kw("s"), **dst.kw("d"),
        "D": dim, "SRC_PAGED": src_paged, "DST_PAGED": dst_paged, "S_TAB": s_has, "D_TAB": d_has,
    }  # fmt: skip
    _launch_tiles("_copy_rows_kernel", tokens, _pow2(dim), heads, src.layers.count, **kw)


def gather_chunk(
    kv_cache: torch.Tensor,
    block_ids: BlockIds,
    *,
    layout: Layout,
    num_tokens: int,
    block_size: int,
    fp8_dtype: torch.dtype | None = None,
    validate: bool = True,
    out_k: torch.Tensor | None = None,
    out_v: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's K and V as ``[num_tokens, H, D]`` (new, or written into ``out_k``/``out_v``).

    One launch copies both; ``out_k``/``out_v`` may have any strides (e.g.
    views of a payload), and must have the cache dtype (or FP8 for a uint8 cache).
    """
    kc, vc = kv_views(kv_cache, layout=layout, block_size=block_size)
    _check_tokens(num_tokens, kc.shape[0], block_size)
    dev = _check_device(kv_cache)
    ids = block_ids_tensor(
        block_ids, num_tokens=num_tokens, block_size=block_size, num_blocks=kc.shape[0],
        device=dev, validate=validate,
    )  # fmt: skip
    _, _, h, d = kc.shape
    if (out_k is None) != (out_v is None):
        raise UnsupportedConfigError("give both out_k and out_v, or neither")
    if out_k is None or out_v is None:
        both = torch.empty((2, num_tokens, h, d), dtype=kc.dtype, device=dev)
        out_k, out_v = both[0], both[1]
        ok, ov = out_k, out_v
    else:
        _check_device(kv_cache, out_k, out_v)
        for o in (out_k, out_v):
            if tuple(o.shape) != (num_tokens, h, d):
                raise UnsupportedConfigError(f"output of shape {tuple(o.shape)}; expected {(num_tokens, h, d)}")
        ok, ov = _check_src(kc, out_k, out_v)
    if num_tokens and h and d:
        view = K_ELEM_VIEW.get(kc.element_size())
        if view is None:
            raise UnsupportedConfigError(f"cache dtype {kc.dtype} unsupported")
        pairs = [([kc, vc], [ok, ov])] if ok.stride() == ov.stride() else [([kc], [ok]), ([vc], [ov])]
        for src, dst in pairs:
            _copy(_cache_rows(src, view), _dense(dst, view), src_paged=True, dst_paged=False, tbl=ids,
                  tokens=num_tokens, heads=h, dim=d, block_size=block_size)  # fmt: skip
    return _fp8_view(out_k, fp8_dtype), _fp8_view(out_v, fp8_dtype)


def scatter_chunk(
    kv_cache: torch.Tensor,
    block_ids: BlockIds,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: Layout,
    block_size: int,
    validate: bool = True,
) -> None:
    """Write ``k``/``v`` (``[T, H, D]``, any strides) into the chunk's blocks; one launch."""
    kc, vc = kv_views(kv_cache, layout=layout, block_size=block_size)
    k, v = _check_src(kc, k, v)
    t = k.shape[0]
    _check_tokens(t, kc.shape[0], block_size)
    dev = _check_device(kv_cache, k, v)
    ids = block_ids_tensor(
        block_ids, num_tokens=t, block_size=block_size, num_blocks=kc.shape[0], device=dev, validate=validate
    )
    _, _, h, d = kc.shape
    if not (t and h and d):
        return
    view = K_ELEM_VIEW.get(kc.element_size())
    if view is None:
        raise UnsupportedConfigError(f"cache dtype {kc.dtype} unsupported")
    pairs = [([k, v], [kc, vc])] if k.stride() == v.stride() else [([k], [kc]), ([v], [vc])]
    for src, dst in pairs:
        _copy(_dense(src, view), _cache_rows(dst, view), src_paged=False, dst_paged=True, tbl=ids,
              tokens=t, heads=h, dim=d, block_size=block_size)  # fmt: skip


def _caches_views(
    kv_caches: Sequence[torch.Tensor], layout: Layout, block_size: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ks, vs = [], []
    for c in kv_caches:
        kc, vc = kv_views(c, layout=layout, block_size=block_size)
        ks.append(kc)
        vs.append(vc)
    _same_layout(ks, "K caches")
    _same_layout(vs, "V caches")
    return ks, vs


def encode_paged_layers(
    kv_caches: Sequence[torch.Tensor],
    block_ids: BlockIds,
    scope: ScaleScope,
    *,
    layout: Layout,
    num_tokens: int,
    block_size: int,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    payloads: Sequence[torch.Tensor] | torch.Tensor,
    strategy: Strategy = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Fused gather + encode of one chunk from each layer's cache, all layers in one launch.

    Payload ``l`` receives layer ``l``'s ``K ‖ FP8(V) ‖ scales`` exactly as
    :func:`kvcodec.kernels.quant_triton.encode_fused` writes it. Returns the
    group absmax ``[L, *scale_shape]`` (NaN/Inf: refuse the blob). No sync
    unless ``validate`` checks device-side block ids.
    """
    caches = list(kv_caches)
    if not caches:
        raise UnsupportedConfigError("no caches given")
    ks, vs = _caches_views(caches, layout, block_size)
    kc = ks[0]
    if kc.dtype not in V_DTYPES:
        raise UnsupportedConfigError(
            f"cache dtype {kc.dtype} is not fp16/bf16/fp32; an FP8 cache holds V quantized already "
            "(copy it with gather_chunk(out_k=..., out_v=...))"
        )
    scope = _check_scope(scope, page_size)
    _check_tokens(num_tokens, kc.shape[0], block_size)
    dev = _check_device(caches[0])
    ids = block_ids_tensor(
        block_ids, num_tokens=num_tokens, block_size=block_size, num_blocks=kc.shape[0],
        device=dev, validate=validate,
    )  # fmt: skip
    _, _, h, d = kc.shape
    kb = kc.element_size()
    pl = _payload_layers(payloads, _payload_bytes(num_tokens, h, d, kb, scope, page_size))
    if pl.count != len(caches):
        raise UnsupportedConfigError(f"{len(caches)} caches but {pl.count} payloads")
    _check_device(caches[0], pl.base)
    v_bf16 = kc.dtype == torch.bfloat16
    return _encode_core(
        _cache_rows(ks, K_ELEM_VIEW[kb]), _cache_rows(vs, torch.int16 if v_bf16 else None), pl,
        tokens=num_tokens, heads=h, dim=d, kb=kb, v_bf16=v_bf16, scope=scope, page_size=page_size,
        fp8_dtype=fp8_dtype, strategy=strategy, table=ids, block_size=block_size,
    )  # fmt: skip


def encode_paged(
    kv_cache: torch.Tensor,
    block_ids: BlockIds,
    scope: ScaleScope,
    *,
    layout: Layout,
    num_tokens: int,
    block_size: int,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    payload: torch.Tensor,
    strategy: Strategy = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Fused gather + encode of one layer's chunk into ``payload``; returns the group absmax."""
    amax = encode_paged_layers(
        [kv_cache], block_ids, scope, layout=layout, num_tokens=num_tokens, block_size=block_size,
        page_size=page_size, fp8_dtype=fp8_dtype, payloads=[payload], strategy=strategy, validate=validate,
    )  # fmt: skip
    return amax[0]


def decode_paged_layers(
    payloads: Sequence[torch.Tensor] | torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    block_ids: BlockIds,
    scope: ScaleScope,
    *,
    layout: Layout,
    num_tokens: int,
    block_size: int,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    validate: bool = True,
) -> None:
    """Decode each layer's payload straight into its cache's blocks (one launch for all layers).

    K is copied at the cache dtype (which must be the payload's K dtype); V
    is dequantized to the cache dtype (fp16/bf16/fp32).
    """
    caches = list(kv_caches)
    if not caches:
        raise UnsupportedConfigError("no caches given")
    ks, vs = _caches_views(caches, layout, block_size)
    kc = ks[0]
    scope = _check_scope(scope, page_size)
    _check_tokens(num_tokens, kc.shape[0], block_size)
    dev = _check_device(caches[0])
    ids = block_ids_tensor(
        block_ids, num_tokens=num_tokens, block_size=block_size, num_blocks=kc.shape[0],
        device=dev, validate=validate,
    )  # fmt: skip
    _, _, h, d = kc.shape
    vview, kind = _out_view(vs[0])
    kb = kc.element_size()
    pl = _payload_layers(payloads, _payload_bytes(num_tokens, h, d, kb, scope, page_size))
    if pl.count != len(caches):
        raise UnsupportedConfigError(f"{len(caches)} caches but {pl.count} payloads")
    _check_device(caches[0], pl.base)
    _decode_core(
        pl, _cache_rows(ks, K_ELEM_VIEW[kb]), _cache_rows(vs, vview.dtype if kind == 2 else None),
        tokens=num_tokens, heads=h, dim=d, kb=kb, out_kind=kind, scope=scope, page_size=page_size,
        fp8_dtype=fp8_dtype, table=ids, block_size=block_size,
    )  # fmt: skip


def decode_paged(
    payload: torch.Tensor,
    kv_cache: torch.Tensor,
    block_ids: BlockIds,
    scope: ScaleScope,
    *,
    layout: Layout,
    num_tokens: int,
    block_size: int,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    validate: bool = True,
) -> None:
    """Decode one layer's payload straight into the chunk's blocks of ``kv_cache``."""
    decode_paged_layers(
        [payload], [kv_cache], block_ids, scope, layout=layout, num_tokens=num_tokens,
        block_size=block_size, page_size=page_size, fp8_dtype=fp8_dtype, validate=validate,
    )  # fmt: skip

