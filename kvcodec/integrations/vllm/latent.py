"""One layer's chunk of an MLA latent cache <-> one LATENT blob (docs/FORMAT.md).

An MLA layer caches one entry per token, ``kv_lora_rank`` latent then ``qk_rope_head_dim`` rope
part, as a one-head "K" of their sum and no V in vLLM's view (``head_size_v == 0``). The blob holds
the entry bit for bit in its V section (scale scheme LATENT, scope NONE, no K, no scales), so a load
gives back exactly what was saved. Identity, prefix hash and ids are checked as for any blob.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcodec import CorruptEncodedKVError, ParsedBlob, Reason, UnsupportedConfigError, check_hashes, parse
from kvcodec.format import Hashes, Header, ScaleScheme, ScaleScope, as_dtype, assemble

from .chunk_codec import ChunkCodec, blob_identity, check_ids

__all__ = ["decode_latent", "encode_latent"]


def encode_latent(
    entry: torch.Tensor, cc: ChunkCodec, *, layer_id: int, chunk_id: int, chunk_hash: str = ""
) -> bytearray:
    """The LATENT blob of a gathered chunk ``[tokens, 1, kv_lora_rank + rope]`` in the cache's dtype."""
    if entry.element_size() == 1:
        raise UnsupportedConfigError(
            f"an MLA latent cache of {entry.dtype} is not stored (16/32-bit caches only)",
            reason=Reason.UNSUPPORTED_DTYPE,
        )
    header = Header(
        k_dtype=as_dtype(entry.dtype),
        v_dtype=as_dtype(entry.dtype),
        scale_scope=ScaleScope.NONE,
        scale_scheme=ScaleScheme.LATENT,
        version=2,
        layer_id=layer_id,
        chunk_id=chunk_id,
        chunk_size=entry.shape[0],
        kv_head_count=entry.shape[1],
        head_dim=entry.shape[2],
        hashes=Hashes.coerce(blob_identity(cc, entry.shape[2], 0, chunk_hash)),
    )
    raw = entry.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    return assemble(header, b"", memoryview(raw).cast("B"))


def decode_latent(
    blob: Any,
    cache: torch.Tensor,
    cc: ChunkCodec,
    *,
    num_tokens: int,
    chunk_hash: str = "",
    ids: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entry ``[tokens, 1, head_size]`` (as K) and an empty V, for :func:`~.layout.scatter_kv`;
    a blob of another identity, chunk, scheme, dtype or shape is refused first."""
    p = blob if isinstance(blob, ParsedBlob) else parse(blob)
    h = p.header
    check_hashes(h.hashes, Hashes.coerce(blob_identity(cc, cc.head_size, 0, chunk_hash)), strict=True)
    if ids is not None:
        check_ids(h.layer_id, h.chunk_id, *ids)
    heads, dim = cache.shape[1], cc.head_size
    want = num_tokens * heads * dim * cache.element_size()
    if h.scale_scheme != ScaleScheme.LATENT or h.v_dtype != as_dtype(cache.dtype) or h.v_payload_len != want:
        raise CorruptEncodedKVError(
            f"an MLA latent cache of {cache.dtype} needs a LATENT blob of {want} bytes; got scheme "
            f"{h.scale_scheme.name}, V of {h.v_dtype.name}, {h.v_payload_len} bytes",
            reason=Reason.INCONSISTENT_PAYLOAD,
        )
    raw = torch.frombuffer(bytearray(p.v), dtype=torch.uint8)  # v_payload_len == want: checked above
    entry = raw.view(cache.dtype).reshape(num_tokens, heads, dim).to(cache.device)
    return entry, entry.new_empty((num_tokens, heads, 0))
