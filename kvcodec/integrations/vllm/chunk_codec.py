"""What every chunk path shares: a layer cache's blob options (:class:`ChunkCodec`, :class:`FP8Scales`),
a chunk blob's identity, and the checks a blob must pass before it touches a cache (ids, K exact, FP8
pass-through lossless)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcodec import CodecMismatchError, Reason, UnsupportedConfigError
from kvcodec.numerics import FP8_DTYPES

__all__ = [
    "ChunkCodec",
    "FP8Scales",
    "blob_identity",
    "check_ids",
    "check_k_exact",
    "fp8_k",
    "fp8_v",
    "fp8_view",
    "layer_scales",
    "pad_to",
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


def layer_scales(x: torch.Tensor | float, heads: int, device: torch.device, what: str) -> torch.Tensor:
    s = torch.as_tensor(x, dtype=torch.float32, device=device).reshape(-1)
    if s.numel() not in (1, heads):
        raise UnsupportedConfigError(
            f"{what} must have 1 or {heads} (one per KV head) values; got {s.numel()}",
            reason=Reason.BAD_SCALES,
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
            f"chunk {want_chunk}: a misfiled blob",
            reason=Reason.MISMATCH,
        )


def check_k_exact(blob_k: torch.dtype, cache: torch.dtype) -> None:
    """Refuse a blob whose K dtype is not the 16-bit cache's: K loads bit-exact or not at all."""
    if blob_k != cache:
        raise UnsupportedConfigError(
            f"the blob's K is {blob_k} but the cache is {cache}: K must load bit-exact",
            reason=Reason.UNSUPPORTED_DTYPE,
        )


def pad_to(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.shape[-1] == dim:
        return x
    out = torch.zeros((*x.shape[:-1], dim), dtype=x.dtype, device=x.device)
    out[..., : x.shape[-1]] = x
    return out


def fp8_view(x: torch.Tensor, fp8: FP8Scales) -> torch.Tensor:
    if fp8.dtype not in FP8_DTYPES:
        raise UnsupportedConfigError(
            f"FP8 cache dtype must be float8_e4m3fn or float8_e5m2; got {fp8.dtype}",
            reason=Reason.UNSUPPORTED_DTYPE,
        )
    if x.element_size() != 1:
        raise UnsupportedConfigError(
            f"an FP8 cache holds 1-byte values; this one is {x.dtype}", reason=Reason.UNSUPPORTED_DTYPE
        )
    return x.view(fp8.dtype)


def fp8_k(k: torch.Tensor, fp8: FP8Scales, heads: int) -> torch.Tensor:
    """K back to the cache's FP8 bytes, refused unless that loses nothing."""
    ks = layer_scales(fp8.k_scale, heads, k.device, "k_scale")[:, None]
    q = (k.to(torch.float32) / ks).to(fp8.dtype)
    if not torch.equal((q.to(torch.float32) * ks).to(k.dtype), k):
        raise UnsupportedConfigError(
            "the blob's K does not fit this FP8 cache's k_scale losslessly; loading it would requantize K",
            reason=Reason.BAD_SCALES,
        )
    return q


def fp8_v(v: torch.Tensor, scales: torch.Tensor | None, fp8: FP8Scales, heads: int) -> torch.Tensor:
    """Raw FP8 V, refused unless its scales are exactly the layer's."""
    vs = layer_scales(fp8.v_scale, heads, v.device, "v_scale")
    got = None if scales is None else scales.to(torch.float32).reshape(-1)
    if v.dtype != fp8.dtype or got is None or got.numel() != vs.numel() or not torch.equal(got, vs):
        raise UnsupportedConfigError(
            f"the blob's V ({v.dtype}, scales {None if got is None else tuple(got.shape)}) does not pass through "
            f"to this {fp8.dtype} cache with its v_scale; loading it would requantize V",
            reason=Reason.BAD_SCALES,
        )
    return v
