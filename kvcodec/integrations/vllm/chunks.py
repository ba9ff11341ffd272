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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcodec import (
    ParsedBlob,
    Reason,
    UnsupportedConfigError,
    check_hashes,
    decode,
    encode,
    parse,
)
from kvcodec.backends import BlobRows, Groups, cache_lanes_available, call, select
from kvcodec.format import (
    BlobCrc,
    Hashes,
    Header,
    ScaleScheme,
    ScaleScope,
    as_dtype,
    geometry,
    is_plain,
)
from kvcodec.format.dtypes import FLOAT8_E4M3FN, FLOAT32

from .chunk_codec import (
    ChunkCodec,
    FP8Scales,
    blob_identity,
    check_ids,
    check_k_exact,
    fp8_k,
    fp8_v,
    fp8_view,
    layer_scales,
    pad_to,
)
from .latent import decode_latent, encode_latent
from .layout import gather_kv

__all__ = [
    "ChunkCodec",
    "FP8Scales",
    "LayerChunk",
    "PreparedChunk",
    "blob_identity",
    "check_ids",
    "check_k_exact",
    "decode_chunk",
    "encode_chunk",
    "read_chunk",
]


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
    if v.shape[-1] == 0:  # an MLA latent cache: the whole entry, bit for bit
        return encode_latent(k, cc, layer_id=layer_id, chunk_id=chunk_id, chunk_hash=chunk_hash)
    dim = max(k.shape[-1], v.shape[-1])
    common: dict[str, Any] = {
        "hashes": blob_identity(cc, k.shape[-1], v.shape[-1], chunk_hash),
        "layer_id": layer_id,
        "chunk_id": chunk_id,
        "version": cc.version,
    }
    if cc.fp8 is None:
        if k.element_size() == 1:
            raise UnsupportedConfigError(
                f"a {k.dtype} cache needs its FP8 scales (FP8Scales)", reason=Reason.MISSING_ARGUMENT
            )
        return encode(pad_to(k, dim), pad_to(v, dim), scope=cc.scope, page_size=cc.page_size, **common)
    heads = k.shape[1]
    ks = layer_scales(cc.fp8.k_scale, heads, k.device, "k_scale")
    vs = layer_scales(cc.fp8.v_scale, heads, k.device, "v_scale")
    k16 = (fp8_view(k, cc.fp8).to(torch.float32) * ks[:, None]).to(cc.model_dtype)
    vq = fp8_view(v, cc.fp8)
    per_head = vs.numel() > 1
    return encode(
        pad_to(k16, dim),
        None,
        precomputed_v_quant=pad_to(vq.view(torch.uint8), dim).view(vq.dtype),
        precomputed_v_scales=vs if per_head else vs[0],
        scope="per_layer_head" if per_head else "per_tensor",
        v_dtype=vq.dtype,
        allow_e5m2=vq.dtype == torch.float8_e5m2,
        **common,
    )


def _check_tokens(x: torch.Tensor | None, tokens: int, heads: int, dim: int) -> torch.Tensor:
    if x is None:
        raise UnsupportedConfigError(
            "the blob holds no K; a vLLM cache needs both K and V", reason=Reason.MISSING_ARGUMENT
        )
    if tuple(x.shape) != (tokens, heads, dim):
        raise UnsupportedConfigError(
            f"the blob holds {tuple(x.shape)}; this cache needs ({tokens}, {heads}, {dim})",
            reason=Reason.BAD_SHAPE,
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
    if dv == 0:  # an MLA latent cache
        return decode_latent(blob, cache, cc, num_tokens=num_tokens, chunk_hash=chunk_hash, ids=ids)
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
    return fp8_k(k[..., :dk], fp8, heads), fp8_v(v[..., :dv], res.scales, fp8, heads)


# ----------------------------------------------------------------------------
# A whole chunk (every layer): read and check, then write
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerChunk:
    """One layer's chunk, checked and ready to write: decoded K and V, or the blob's K and V codes."""

    codec: ChunkCodec
    kv: tuple[torch.Tensor, torch.Tensor] | None = None
    """K ``[T, H, head_size]`` and V ``[T, H, head_size_v]`` in the cache's dtype (``rows`` unset)."""
    rows: BlobRows | None = None
    """The blob's K bytes and V's codes and scales, which :func:`~.chunk_writes.write_chunk` writes into a CPU
    cache in one C pass (V dequantized there, K copied)."""
    unverified: BlobCrc | None = None
    """The CRC of the blob ``rows`` views when it is still unchecked (read with ``crc_checked=False``):
    :func:`write_chunk` continues it in the same C pass and raises ``CorruptEncodedKVError`` after
    writing (the load then fails and the blob is removed)."""

    def decoded(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V in the cache's ``dtype`` (V dequantized now, as :func:`decode_chunk` does, when
        held as codes)."""
        r = self.rows
        if r is None:
            return self.kv  # type: ignore[return-value]  # read_chunk sets one of the two
        k = torch.from_numpy(r.k).view(dtype)
        codes = torch.from_numpy(r.codes).view(torch.float8_e4m3fn)
        v = torch.empty(codes.shape, dtype=dtype)
        call(select(None, "cpu"), "dequantize", codes, torch.from_numpy(r.scales), r.groups, out=v)
        return k, v


@dataclass(frozen=True)
class PreparedChunk:
    """Every layer's blob of one chunk, read and checked by :func:`read_chunk`; nothing written yet."""

    chunk_id: int
    num_tokens: int
    layers: dict[str, LayerChunk]


_C_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def read_chunk(
    blobs: Mapping[str, Any],
    caches: Mapping[str, torch.Tensor],
    codecs: Mapping[str, ChunkCodec],
    layer_ids: Mapping[str, int],
    *,
    chunk_id: int,
    num_tokens: int,
    chunk_hash: str = "",
    crc_checked: bool = True,
) -> PreparedChunk:
    """Check every layer's blob of chunk ``chunk_id`` as :func:`decode_chunk` does, writing nothing.

    ``blobs`` maps a layer name to its blob: a :class:`~kvcodec.format.ParsedBlob`
    whose CRC was verified (:meth:`~kvcodec.store.DirectoryStore.get_parsed`), or
    any buffer (parsed here, CRC included). Each is refused, with
    :func:`decode_chunk`'s errors, unless it carries the codec's identity bound
    to ``chunk_hash`` (strict), header ids ``(layer_ids[name], chunk_id)`` and
    the cache's geometry and dtypes (K bit-exact; FP8 caches only lossless).
    Blobs are parsed once and not decoded here where :func:`write_chunk` can
    dequantize V straight into the cache (CPU 16-bit caches, e4m3 V): K and V's
    codes stay views into the blobs. May run on a background thread.

    ``crc_checked=False``: the ParsedBlobs were parsed with every check but the
    CRC (``get_parsed(verify_crc=False)``: none with ``consistency=False``).
    Those :func:`write_chunk` writes in one C pass keep it for then
    (:attr:`LayerChunk.unverified`; their header is remembered by the parse
    memo once it passes); every other one is checked here first.
    """
    plans: dict[tuple[Any, ...], _Plan] = {}
    layers = {}
    for name, blob in blobs.items():
        parsed = blob if isinstance(blob, ParsedBlob) else parse(blob)
        cache, cc = caches[name], codecs[name]
        key = (id(cc), cache.shape, cache.dtype, cache.device)
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = _Plan.of(cache, cc, num_tokens, chunk_hash)
        ids = (layer_ids[name], chunk_id)
        unchecked = not crc_checked and parsed is blob
        layer = plan.rows(parsed, ids, unchecked)
        if layer is None:  # not the plain case: decoded now, by the general path (which names any refusal)
            if unchecked:
                BlobCrc(parsed).finish(None)
            layer = LayerChunk(
                cc, kv=decode_chunk(parsed, cache, cc, num_tokens=num_tokens, chunk_hash=chunk_hash, ids=ids)
            )
        layers[name] = layer
    return PreparedChunk(chunk_id, num_tokens, layers)


@dataclass(frozen=True)
class _Rows:
    """A plain blob's K, V codes and scales shapes (:func:`~kvcodec.format.geometry`) and V's groups:
    the same for every blob of one header layout, so worked out once per chunk and layout."""

    k_shape: tuple[int, int, int]
    codes_shape: tuple[int, int, int]
    scales_shape: tuple[int, ...]
    groups: Groups

    @classmethod
    def of(cls, h: Header, key: tuple[Any, ...], fields: tuple[Any, ...]) -> _Rows | None:
        """The layout of a blob whose header is ``h`` (``key``: its :func:`_layout_key`); None when it
        is not the plain case (:func:`~kvcodec.format.is_plain`) ``fields`` describes (the general
        path then checks and decodes it, and names any refusal)."""
        g = geometry(h)
        if key[: len(fields)] != fields or g is None or not is_plain(h):
            return None
        paged = h.scale_scope == ScaleScope.PER_PAGE_HEAD
        return cls(
            k_shape=g.k_shape,
            codes_shape=g.v_shape,
            scales_shape=tuple(h.scale_shape),
            groups=Groups(h.scale_scope, h.page_size if paged else None, torch.float8_e4m3fn),
        )


def _layout_key(h: Header) -> tuple[Any, ...]:
    """Every header field :meth:`_Rows.of` reads (through :func:`~kvcodec.format.is_plain` and
    :func:`~kvcodec.format.geometry`), :attr:`_Plan.fields`' first: headers equal in these have the
    same layout."""
    return (
        h.kv_head_count,
        h.head_dim,
        h.k_dtype,
        h.v_dtype,
        h.k_payload_len,
        h.v_payload_len,
        h.scale_scheme,
        h.scale_dtype,
        h.scale_scope,
        h.page_size,
        h.scale_shape,
        h.scale_payload_len,
    )


@dataclass
class _Plan:
    """What every blob of a chunk for one codec and cache geometry must be: its identity and, for
    the plain case (CPU 16-bit cache, e4m3 V, C built), the header fields C's path takes."""

    codec: ChunkCodec
    identity: Hashes
    fields: tuple[Any, ...] | None
    """``(kv_head_count, head_dim, k_dtype, v_dtype, k_len, v_len, scheme, scale_dtype)``; None: never plain."""
    last: tuple[tuple[Any, ...], _Rows | None] | None = None
    """The last header layout seen (:func:`_layout_key`) and its :class:`_Rows`: a chunk's blobs
    share one, so all but the first compare one tuple (one read_chunk call's, so one thread's)."""

    @classmethod
    def of(cls, cache: torch.Tensor, cc: ChunkCodec, tokens: int, chunk_hash: str) -> _Plan:
        dk = cc.head_size
        dv = cache.shape[3] - dk if cache.dim() == 4 else -1
        identity = Hashes.coerce(blob_identity(cc, dk, dv, chunk_hash))
        plain = (
            cache_lanes_available()
            and cc.fp8 is None
            and cache.device.type == "cpu"
            and cache.dim() == 4
            and cache.dtype in _C_CACHE_DTYPES
            and dv == dk
            and tokens > 0
        )
        if not plain:
            return cls(cc, identity, None)
        heads, item = cache.shape[1], cache.element_size()
        elems = tokens * heads * dk
        fields = (
            heads,
            dk,
            as_dtype(cache.dtype),
            FLOAT8_E4M3FN,
            elems * item,
            elems,
            ScaleScheme.COMPUTED,
            FLOAT32,
        )
        return cls(cc, identity, fields)

    def rows(self, p: ParsedBlob, ids: tuple[int, int], unverified: bool) -> LayerChunk | None:
        """The blob as K bytes and V codes for C, after the identity and id checks; None when it is
        not the plain case (the general path then checks and decodes it). ``unverified``: ``p``'s CRC
        is left to :func:`write_chunk` (carried as a :class:`~kvcodec.format.BlobCrc`)."""
        h = p.header
        if h.hashes != self.identity:  # equal: the strict check passes; else it names the difference
            check_hashes(h.hashes, self.identity, strict=True)
        check_ids(h.layer_id, h.chunk_id, *ids)
        if self.fields is None:
            return None
        key = _layout_key(h)
        if self.last is None or self.last[0] != key:
            self.last = (key, _Rows.of(h, key, self.fields))
        r = self.last[1]
        if r is None:
            return None
        k = np.frombuffer(p.k, np.uint8).reshape(r.k_shape)
        codes = np.frombuffer(p.v, np.uint8).reshape(r.codes_shape)
        scales = np.frombuffer(p.scales, np.float32).reshape(r.scales_shape).copy()  # aligned, C-contiguous
        crc = BlobCrc(p) if unverified else None
        return LayerChunk(self.codec, rows=BlobRows(k, codes, scales, r.groups), unverified=crc)
