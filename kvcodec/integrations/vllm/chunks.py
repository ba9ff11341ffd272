"""One layer's chunk of a vLLM cache <-> one kvcodec blob.

16-bit caches: K is stored bit-exact, V quantized to FP8 with the chosen scope.
FP8 caches (``kv_cache_dtype="fp8"``, per-tensor or per-head scales): V's FP8
bytes pass through with the layer's scale as the blob's scale; K is widened to
the model dtype (``k * k_scale``), since blobs hold K at 16 bits. Loading into an
FP8 cache is refused unless it is lossless: V's blob scale must equal the
layer's, and K must come back to the same FP8 bytes.

When ``head_size_v != head_size`` the narrower of K and V is zero-padded to the
wider head dim in the blob (zeros change no absmax, so V's scales and codes are
those of the unpadded data) and cut off again on load; the geometry is part of
the blob's identity (``|dk=..,dv=..`` is appended to ``kv_layout``), so a blob
is never read at other widths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcodec import CodecMismatchError, UnsupportedConfigError, decode, encode
from kvcodec.numerics import FP8_DTYPES

from .layout import gather_kv, scatter_kv

__all__ = [
    "ChunkCodec",
    "FP8Scales",
    "blob_identity",
    "check_ids",
    "check_k_exact",
    "decode_chunk",
    "encode_chunk",
    "load_chunk",
]


@dataclass(frozen=True)
class FP8Scales:
    """How an FP8 cache's bytes are read: FP8 dtype and K/V scales (1 or H values)."""

    dtype: torch.dtype = torch.float8_e4m3fn
    k_scale: torch.Tensor | float = 1.0
    v_scale: torch.Tensor | float = 1.0


@dataclass(frozen=True)
class ChunkCodec:
    """Everything fixed per layer cache: geometry, blob options, identity."""

    head_size: int
    block_size: int
    model_dtype: torch.dtype = torch.bfloat16
    """K's dtype in blobs written from an FP8 cache (16-bit caches keep their own)."""
    scope: str = "per_page_head"
    page_size: int = 16
    """Tokens per V scale page for ``per_page_head`` (independent of vLLM's block size)."""
    hashes: dict[str, str] = field(default_factory=dict)
    fp8: FP8Scales | None = None
    version: int = 2


def _scales(x: torch.Tensor | float, heads: int, device: torch.device, what: str) -> torch.Tensor:
    s = torch.as_tensor(x, dtype=torch.float32, device=device).reshape(-1)
    if s.numel() not in (1, heads):
        raise UnsupportedConfigError(
            f"{what} must have 1 or {heads} (one per KV head) values; got {s.numel()}"
        )
    return s


def blob_identity(cc: ChunkCodec, dk: int, dv: int, chunk_hash: str = "") -> dict[str, str]:
    """The codec's hashes with K/V head dims added to ``kv_layout`` (padded blobs never load at other
    widths) and, for a connector chunk, its prefix hash (``|prefix=<hash>``): a blob copied under
    another chunk's key fails the identity check."""
    hashes = dict(cc.hashes)
    hashes["kv_layout"] = f"{hashes.get('kv_layout', '')}|dk={dk},dv={dv}"
    if chunk_hash:
        hashes["kv_layout"] += f"|prefix={chunk_hash}"
    return hashes


def check_ids(layer_id: int, chunk_id: int, want_layer: int, want_chunk: int) -> None:
    """Refuse a blob whose header ids are not those of the key it was read for."""
    if (layer_id, chunk_id) != (want_layer, want_chunk):
        raise CodecMismatchError(
            f"blob holds layer {layer_id} chunk {chunk_id}, but was read for layer {want_layer} "
            f"chunk {want_chunk}: a misfiled blob"
        )


def check_k_exact(blob_k: torch.dtype, cache: torch.dtype) -> None:
    """Refuse a blob whose K dtype is not the 16-bit cache's: K loads bit-exact or not at all."""
    if blob_k != cache:
        raise UnsupportedConfigError(
            f"the blob's K is {blob_k} but the cache is {cache}: K must load bit-exact"
        )


def _pad(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.shape[-1] == dim:
        return x
    out = torch.zeros((*x.shape[:-1], dim), dtype=x.dtype, device=x.device)
    out[..., : x.shape[-1]] = x
    return out


def _fp8_view(x: torch.Tensor, fp8: FP8Scales) -> torch.Tensor:
    if fp8.dtype not in FP8_DTYPES:
        raise UnsupportedConfigError(f"FP8 cache dtype must be float8_e4m3fn or float8_e5m2; got {fp8.dtype}")
    if x.element_size() != 1:
        raise UnsupportedConfigError(f"an FP8 cache holds 1-byte values; this one is {x.dtype}")
    return x.view(fp8.dtype)


def encode_chunk(
    cache: torch.Tensor,
    block_ids: Sequence[int],
    cc: ChunkCodec,
    *,
    start: int,
    num_tokens: int,
    layer_id: int,
    chunk_id: int,
    chunk_hash: str = "",
) -> bytearray:
    """Encode tokens ``start .. start + num_tokens`` of one layer cache into a blob (bound to ``chunk_hash``)."""
    k, v = gather_kv(
        cache, block_ids, head_size=cc.head_size, block_size=cc.block_size, start=start, num_tokens=num_tokens
    )
    return encode_kv(k, v, cc, layer_id=layer_id, chunk_id=chunk_id, chunk_hash=chunk_hash)


def encode_kv(
    k: torch.Tensor, v: torch.Tensor, cc: ChunkCodec, *, layer_id: int, chunk_id: int, chunk_hash: str = ""
) -> bytearray:
    """Encode a gathered chunk (:func:`~.layout.gather_kv`'s K and V, in the cache's dtype) into a blob.

    :func:`encode_chunk` is this after the gather; the connector's writer threads call it on the
    copies ``wait_for_save`` made, so both write the same bytes."""
    dim = max(k.shape[-1], v.shape[-1])
    common: dict[str, Any] = {
        "hashes": blob_identity(cc, k.shape[-1], v.shape[-1], chunk_hash),
        "layer_id": layer_id,
        "chunk_id": chunk_id,
        "version": cc.version,
    }
    if cc.fp8 is None:
        if k.element_size() == 1:
            raise UnsupportedConfigError(f"a {k.dtype} cache needs its FP8 scales (FP8Scales)")
        return encode(_pad(k, dim), _pad(v, dim), scope=cc.scope, page_size=cc.page_size, **common)
    heads = k.shape[1]
    ks = _scales(cc.fp8.k_scale, heads, k.device, "k_scale")
    vs = _scales(cc.fp8.v_scale, heads, k.device, "v_scale")
    k16 = (_fp8_view(k, cc.fp8).to(torch.float32) * ks[:, None]).to(cc.model_dtype)
    vq = _fp8_view(v, cc.fp8)
    per_head = vs.numel() > 1
    return encode(
        _pad(k16, dim),
        None,
        precomputed_v_quant=_pad(vq.view(torch.uint8), dim).view(vq.dtype),
        precomputed_v_scales=vs if per_head else vs[0],
        scope="per_layer_head" if per_head else "per_tensor",
        v_dtype=vq.dtype,
        allow_e5m2=vq.dtype == torch.float8_e5m2,
        **common,
    )


def _check_tokens(x: torch.Tensor | None, tokens: int, heads: int, dim: int) -> torch.Tensor:
    if x is None:
        raise UnsupportedConfigError("the blob holds no K; a vLLM cache needs both K and V")
    if tuple(x.shape) != (tokens, heads, dim):
        raise UnsupportedConfigError(
            f"the blob holds {tuple(x.shape)}; this cache needs ({tokens}, {heads}, {dim})"
        )
    return x


def decode_chunk(
    blob: Any,
    cache: torch.Tensor,
    cc: ChunkCodec,
    *,
    num_tokens: int,
    chunk_hash: str = "",
    ids: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode a blob into K and V in the cache's dtype, ready for :func:`~.layout.scatter_kv`.

    Nothing is written to the cache here: a blob of another model or chunk
    (identity hashes with ``chunk_hash``, checked strictly; header ``(layer_id,
    chunk_id)`` against ``ids``), geometry or dtype, or a lossy FP8 load, raises
    first. Returns ``[T, H, head_size]`` and ``[T, H, head_size_v]``.
    """
    heads, dk = cache.shape[1], cc.head_size
    dv = cache.shape[3] - dk
    dim = max(dk, dv)
    fp8 = cc.fp8
    want_v = None if fp8 is not None else cache.dtype
    res = decode(
        blob,
        out_v_dtype=want_v,
        device=cache.device,
        expected_hashes=blob_identity(cc, dk, dv, chunk_hash),
        strict_hashes=True,
    )
    if ids is not None:
        check_ids(res.header.layer_id, res.header.chunk_id, *ids)
    k = _check_tokens(res.k, num_tokens, heads, dim)
    v = _check_tokens(res.v, num_tokens, heads, dim)
    if fp8 is None:
        check_k_exact(k.dtype, cache.dtype)
        return k[..., :dk], v[..., :dv]
    return _fp8_k(k[..., :dk], fp8, heads), _fp8_v(v[..., :dv], res.scales, fp8, heads)


def _fp8_k(k: torch.Tensor, fp8: FP8Scales, heads: int) -> torch.Tensor:
    """K back to the cache's FP8 bytes, refused unless that loses nothing."""
    ks = _scales(fp8.k_scale, heads, k.device, "k_scale")[:, None]
    q = (k.to(torch.float32) / ks).to(fp8.dtype)
    if not torch.equal((q.to(torch.float32) * ks).to(k.dtype), k):
        raise UnsupportedConfigError(
            "the blob's K does not fit this FP8 cache's k_scale losslessly; loading it would requantize K"
        )
    return q


def _fp8_v(v: torch.Tensor, scales: torch.Tensor | None, fp8: FP8Scales, heads: int) -> torch.Tensor:
    """Raw FP8 V, refused unless its scales are exactly the layer's."""
    vs = _scales(fp8.v_scale, heads, v.device, "v_scale")
    got = None if scales is None else scales.to(torch.float32).reshape(-1)
    if v.dtype != fp8.dtype or got is None or got.numel() != vs.numel() or not torch.equal(got, vs):
        raise UnsupportedConfigError(
            f"the blob's V ({v.dtype}, scales {None if got is None else tuple(got.shape)}) does not pass through "
            f"to this {fp8.dtype} cache with its v_scale; loading it would requantize V"
        )
    return v


def load_chunk(
    blob: Any,
    cache: torch.Tensor,
    block_ids: Sequence[int],
    cc: ChunkCodec,
    *,
    start: int,
    num_tokens: int,
    skip: int = 0,
) -> None:
    """Decode and write a blob's tokens into the cache; the first ``skip`` tokens are left alone."""
    k, v = decode_chunk(blob, cache, cc, num_tokens=num_tokens)
    scatter_kv(
        cache,
        block_ids,
        k[skip:],
        v[skip:],
        head_size=cc.head_size,
        block_size=cc.block_size,
        start=start + skip,
    )
