"""Loads for the tests, without a connector: the reference (decode a blob, scatter it: the oracle
every load path must match) and a chunk load as the connector's load handler does it (each blob
parsed once, checked by the fused path's ``prepare`` or by ``read_chunk``, then one write)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcodec import ParsedBlob, parse
from kvcodec.integrations.vllm.chunk_writes import write_chunk
from kvcodec.integrations.vllm.chunks import ChunkCodec, decode_chunk, read_chunk
from kvcodec.integrations.vllm.fused import FusedLayers
from kvcodec.integrations.vllm.layout import scatter_kv

__all__ = ["ChunkLoad", "load_layers", "reference_load"]


@dataclass(frozen=True)
class ChunkLoad:
    """Chunk ``chunk`` of a request to write into every layer; its first ``skip`` tokens are left alone."""

    block_ids: Sequence[int]
    chunk: int
    chunk_size: int
    skip: int = 0
    chunk_hash: str = ""
    layer_ids: Mapping[str, int] | None = None
    """Layer name -> layer id, checked against each blob's header (None: the fused path's order)."""

    @property
    def start(self) -> int:
        return self.chunk * self.chunk_size


def reference_load(
    blob: Any,
    cache: torch.Tensor,
    block_ids: Sequence[int],
    cc: ChunkCodec,
    *,
    start: int,
    num_tokens: int,
    skip: int = 0,
    chunk_hash: str = "",
) -> None:
    """Decode one layer's blob and write tokens ``skip ..`` of it into the cache (the oracle)."""
    k, v = decode_chunk(blob, cache, cc, num_tokens=num_tokens, chunk_hash=chunk_hash)
    scatter_kv(
        cache,
        block_ids,
        k[skip:],
        v[skip:],
        head_size=cc.head_size,
        block_size=cc.block_size,
        start=start + skip,
    )


def load_layers(
    blobs: Mapping[str, Any],
    caches: Mapping[str, torch.Tensor],
    codec: Callable[[str], ChunkCodec],
    req: ChunkLoad,
    fused: FusedLayers | None = None,
    parse_blob: Callable[[Any], ParsedBlob] = parse,
) -> bool:
    """The load handler's path for one chunk: every blob parsed once (``parse_blob``), checked, then
    written; True when the fused path wrote it. Nothing is written unless every layer passes."""
    parsed = {n: b if isinstance(b, ParsedBlob) else parse_blob(b) for n, b in blobs.items()}
    if fused is not None and fused.serves(req.start, req.skip):
        fc = fused.prepare(parsed, req.chunk, req.chunk_size, req.skip, req.chunk_hash)
        if fc is not None:
            fused.load(fc, req.block_ids)
            return True
    layer_ids = req.layer_ids
    if layer_ids is None:
        layer_ids = (
            dict(zip(fused.names, fused.layer_ids))
            if fused is not None
            else {n: i for i, n in enumerate(sorted(blobs))}
        )
    chunk = read_chunk(
        parsed,
        caches,
        {n: codec(n) for n in parsed},
        layer_ids,
        chunk_id=req.chunk,
        num_tokens=req.chunk_size,
        chunk_hash=req.chunk_hash,
    )
    write_chunk(chunk, caches, req.block_ids, start=req.start, skip=req.skip)
    return False
