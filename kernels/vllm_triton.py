"""Fused kvcodec encode/decode over vLLM 0.33 KV-cache views: every layer of a chunk in one launch.

vLLM 0.33 hands a connector one view per attention layer, logically
``[num_blocks, H, block_size, C]`` with ``C = head_size + head_size_v`` (K is
``C[..., :head_size]``, V is ``C[..., head_size:]``), over any of
``KVCacheLayout``'s physical orders (``LBNHC``, ``LBHNC``, ``BLHNC``,
``BLNHC``, ``BHLNC``, ``LHBNC``), often several layers in one allocation.
The fused launchers of :mod:`kvcodec.kernels.fused_triton` already address
their operands by (block, slot, head, channel) strides through a block
table, and layers by a uniform stride or an offset table, so these views are
read and written in place, whatever the order: no staging copy.

* :func:`gather_encode_layers`: chunk tokens of every layer → each layer's
  LMCKV payload ``K ‖ FP8(V) ‖ scales`` (bit-exact with ``kvcodec.encode`` of
  the gathered ``[T, H, D]`` tensors); one launch (two for two-stage scopes).
* :func:`decode_scatter_layers`: each layer's payload → the chunk's blocks
  (bit-exact with ``kvcodec.decode(out_v_dtype=cache dtype)`` + a scatter; a
  NaN code, which kvcodec never writes, decodes to NaN either way, not always
  with the same NaN bits).

Blobs (headers, host buffers, the asynchronous copy) are the codec's:
:mod:`kvcodec.codec.chunk_blobs` builds them around these launches.

Token ``t`` of a chunk is slot ``t % block_size`` of block
``block_ids[t // block_size]``; the last block may be partly used. ``start``
(the chunk's first request token) must be a multiple of ``block_size``.
Only ``head_size == head_size_v`` is supported, and fp16/bf16/fp32 caches
(an FP8 cache already holds quantized V: copy it instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import Reason, UnsupportedConfigError
from ..numerics import ScaleScope
from .fused_triton import ChunkGeometry, Strategy, decode_rows, encode_rows
from .operands import (
    K_ELEM_VIEW,
    V_DTYPES,
    Rows,
    check_device,
    check_scope,
    listed,
    out_kind,
    payload_layers,
    same_layout,
)

__all__ = [
    "BlockIds",
    "CacheViews",
    "as_views",
    "decode_scatter_layers",
    "gather_encode_layers",
    "prepare_views",
]

BlockIds = Sequence[int] | torch.Tensor


# ----------------------------------------------------------------------------
# Views
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheViews:
    """Kernel addressing of a model's vLLM layer views, built once (e.g. at ``register_kv_caches``).

    Passing it instead of the list of views skips per-chunk validation and
    layer-offset discovery.
    """

    k: Rows
    """K: ``C[..., :head_size]`` of every layer (as same-width integers)."""
    v: Rows
    """V: ``C[..., head_size:]`` of every layer (bf16 as int16 bits)."""
    count: int
    num_blocks: int
    heads: int
    block_size: int
    """Token slots per block of the views (vLLM's kernel block)."""
    head_size: int
    dtype: torch.dtype
    device: torch.device


def _check_views(views: Sequence[torch.Tensor], head_size: int) -> torch.Tensor:
    if not views:
        raise UnsupportedConfigError("no layer views given", reason=Reason.MISSING_ARGUMENT)
    x0 = views[0]
    if not isinstance(x0, torch.Tensor) or x0.dim() != 4:
        raise UnsupportedConfigError(
            f"a vLLM layer view is 4-D [num_blocks, H, block_size, C]; got {getattr(x0, 'shape', type(x0))}",
            reason=Reason.BAD_SHAPE,
        )
    same_layout(views, "layer views")
    c = x0.shape[3]
    if isinstance(head_size, bool) or not isinstance(head_size, int) or not 0 < head_size < c:
        raise UnsupportedConfigError(
            f"head_size={head_size!r} must leave room for V in C={c}", reason=Reason.BAD_SHAPE
        )
    if c != 2 * head_size:
        raise UnsupportedConfigError(
            f"C={c} holds head_size={head_size} and head_size_v={c - head_size}: the fused vLLM "
            "kernels need head_size == head_size_v (encode K and V separately otherwise)",
            reason=Reason.BAD_SHAPE,
        )
    if x0.dtype not in V_DTYPES:
        raise UnsupportedConfigError(
            f"cache dtype {x0.dtype} is not fp16/bf16/fp32; an FP8 cache holds V quantized already",
            reason=Reason.UNSUPPORTED_DTYPE,
        )
    return x0


def _rows(views: Sequence[torch.Tensor], view: torch.dtype | None) -> Rows:
    """Paged rows of ``[num_blocks, H, block_size, D]`` views: (slot, head, channel, block) strides."""
    lay = listed(views, view)
    sb, sh, st, sd = views[0].stride()
    return Rows(lay, st, sh, sd, sb)


def prepare_views(layers: Sequence[torch.Tensor], head_size: int) -> CacheViews:
    """Validate vLLM 0.33 layer views once and build their kernel addressing."""
    views = list(layers)
    x0 = _check_views(views, head_size)
    check_device(x0)
    kb = x0.element_size()
    ks = [x[..., :head_size] for x in views]
    vs = [x[..., head_size:] for x in views]
    vview = torch.int16 if x0.dtype == torch.bfloat16 else None
    nb, h, bs, _ = x0.shape
    return CacheViews(
        _rows(ks, K_ELEM_VIEW[kb]), _rows(vs, vview), len(views), nb, h, bs, head_size, x0.dtype, x0.device
    )


def as_views(layers: Sequence[torch.Tensor] | CacheViews, head_size: int) -> CacheViews:
    """``layers`` prepared once (:func:`prepare_views`), or already prepared views for ``head_size``."""
    if isinstance(layers, CacheViews):
        if layers.head_size != head_size:
            raise UnsupportedConfigError(
                f"views prepared for head_size={layers.head_size}, not {head_size}", reason=Reason.BAD_SHAPE
            )
        return layers
    return prepare_views(layers, head_size)


def _block_table(
    cv: CacheViews, block_ids: BlockIds, num_tokens: int, block_size: int | None, start: int, distinct: bool
) -> tuple[torch.Tensor, int]:
    """The chunk's view-block ids on the device, and the view's tokens per block.

    ``block_size`` (the scheduler's block) may be a multiple of the view's
    (vLLM splits scheduler blocks into kernel blocks): ids are expanded.
    """
    kbs = cv.block_size
    bs = kbs if block_size is None else int(block_size)
    if bs < 1 or bs % kbs:
        raise UnsupportedConfigError(
            f"block_size={block_size} is not a multiple of the views' {kbs} slots per block",
            reason=Reason.BAD_VALUE,
        )
    if num_tokens < 0 or start < 0:
        raise UnsupportedConfigError(
            f"num_tokens and start must be >= 0; got {num_tokens}, {start}", reason=Reason.BAD_VALUE
        )
    if start % bs:
        raise UnsupportedConfigError(
            f"start={start} is not a multiple of block_size={bs}: the fused path needs block-aligned chunks",
            reason=Reason.BAD_VALUE,
        )
    ratio = bs // kbs
    first, need = start // bs, -(-num_tokens // bs)
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
            raise UnsupportedConfigError(
                f"block_ids must be 1-D int32/int64; got {block_ids.dim()}-D {block_ids.dtype}",
                reason=Reason.BAD_VALUE,
            )
        if block_ids.device.type != "cpu" and ratio == 1:
            ids_dev = block_ids[first : first + need]
            if ids_dev.numel() < need:
                raise UnsupportedConfigError(
                    f"{num_tokens} tokens need {need} block ids; got {ids_dev.numel()}",
                    reason=Reason.BAD_SHAPE,
                )
            return ids_dev.to(device=cv.device, dtype=torch.int64).contiguous(), kbs
        ids = [int(i) for i in block_ids.tolist()]
    else:
        ids = list(block_ids)
    used = ids[first : first + need]
    if len(used) < need:
        raise UnsupportedConfigError(
            f"{num_tokens} tokens at block_size {bs} need {need} block ids; got {len(used)}",
            reason=Reason.BAD_SHAPE,
        )
    nb = cv.num_blocks // ratio
    if used and (min(used) < 0 or max(used) >= nb):
        raise UnsupportedConfigError(
            f"block ids span {min(used)}..{max(used)}; the cache has {nb} blocks", reason=Reason.BAD_VALUE
        )
    if distinct and len(set(used)) != len(used):
        raise UnsupportedConfigError(
            f"block ids repeat: {used[:16]}; a chunk's blocks are distinct", reason=Reason.BAD_VALUE
        )
    if ratio > 1:
        used = [b * ratio + j for b in used for j in range(ratio)]
    t = torch.tensor(used or [0], dtype=torch.int64)
    if cv.device.type == "cuda":
        t = t.pin_memory()
    return t.to(cv.device, non_blocking=True), kbs


# ----------------------------------------------------------------------------
# Encode / decode
# ----------------------------------------------------------------------------


def gather_encode_layers(
    layers: Sequence[torch.Tensor] | CacheViews,
    block_ids: BlockIds,
    *,
    num_tokens: int,
    head_size: int,
    scope: ScaleScope,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    payloads: Sequence[torch.Tensor] | torch.Tensor,
    block_size: int | None = None,
    start: int = 0,
    strategy: Strategy = "auto",
) -> torch.Tensor:
    """Encode one chunk of every layer straight from vLLM views; return the group absmax ``[L, *scale_shape]``.

    ``block_ids``: the request's block table (scheduler blocks); the chunk's
    are ``block_ids[start // block_size:]``. A list is range-checked here; ids
    already on the GPU are not (that would cost a sync).

    ``payloads``: ``[L, payload_len]`` uint8 (rows may be padded, e.g.
    :func:`~kvcodec.kernels.operands.empty_payloads`) or one 1-D tensor
    per layer. NaN/Inf in the absmax means that layer's blob must be refused.
    No device sync.
    """
    cv = as_views(layers, head_size)
    scope = check_scope(scope, page_size)
    ids, kbs = _block_table(cv, block_ids, num_tokens, block_size, start, distinct=False)
    g = ChunkGeometry(
        num_tokens, cv.heads, head_size, cv.dtype.itemsize, scope, page_size, fp8_dtype, ids, kbs
    )
    pl = payload_layers(payloads, g.payload_len)
    if pl.count != cv.count:
        raise UnsupportedConfigError(
            f"{cv.count} layer views but {pl.count} payloads", reason=Reason.BAD_VALUE
        )
    check_device(cv.k.layers.base, pl.base)
    return encode_rows(cv.k, cv.v, pl, g, v_bf16=cv.dtype == torch.bfloat16, strategy=strategy)


def decode_scatter_layers(
    payloads: Sequence[torch.Tensor] | torch.Tensor,
    layers: Sequence[torch.Tensor] | CacheViews,
    block_ids: BlockIds,
    *,
    num_tokens: int,
    head_size: int,
    scope: ScaleScope,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    block_size: int | None = None,
    start: int = 0,
) -> None:
    """Decode each layer's payload straight into the chunk's blocks of its view (one launch).

    K is copied bit for bit (the payload's K dtype must be the cache dtype);
    V is dequantized to the cache dtype. Other slots are untouched.
    """
    cv = as_views(layers, head_size)
    scope = check_scope(scope, page_size)
    ids, kbs = _block_table(cv, block_ids, num_tokens, block_size, start, distinct=True)
    g = ChunkGeometry(
        num_tokens, cv.heads, head_size, cv.dtype.itemsize, scope, page_size, fp8_dtype, ids, kbs
    )
    pl = payload_layers(payloads, g.payload_len)
    if pl.count != cv.count:
        raise UnsupportedConfigError(
            f"{pl.count} payloads but {cv.count} layer views", reason=Reason.BAD_VALUE
        )
    check_device(cv.k.layers.base, pl.base)
    decode_rows(pl, cv.k, cv.v, g, out_kind=out_kind(cv.dtype))
