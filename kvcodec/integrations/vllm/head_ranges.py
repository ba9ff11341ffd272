"""A chunk written at another tensor-parallel size: this rank's KV heads cut out of other head ranges.

Blobs hold a chunk's layer for one head range (:class:`~.chunk_keys.HeadSplit`); a rank reading a
chunk split otherwise than its own reads every blob overlapping the heads it holds, checks and
decodes each as :func:`~.chunks.decode_chunk` does (its own range's identity, strict), and keeps the
heads it owns. Scales are per blob (``per_tensor``), per blob and head (``per_layer_head``) or per
page and head (``per_page_head``): a blob decodes to the same values whoever reads it, so the heads
a rank keeps are exactly those the writer stored. Only 16-bit caches (FP8 caches read their own
split only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kvcodec import ParsedBlob

from .chunk_codec import ChunkCodec
from .chunks import LayerChunk, PreparedChunk, decode_chunk

__all__ = ["HeadRead", "read_head_ranges"]


@dataclass(frozen=True)
class HeadRead:
    """What to take from one chunk's blobs: this rank's heads ``own``, each blob's head range and its
    identity (``hashes``), for chunk ``chunk_id`` of ``num_tokens`` with prefix hash ``chunk_hash``."""

    own: tuple[int, int]
    hashes: Callable[[tuple[int, int]], dict[str, str]]
    chunk_id: int
    num_tokens: int
    chunk_hash: str


def read_head_ranges(
    blobs: Mapping[str, Mapping[tuple[int, int], ParsedBlob]],
    caches: Mapping[str, torch.Tensor],
    codecs: Mapping[str, ChunkCodec],
    layer_ids: Mapping[str, int],
    read: HeadRead,
) -> tuple[PreparedChunk, int]:
    """Every layer's K and V for ``read.own``, from blobs of other head ranges (layer name -> head
    range -> blob), each checked against its range's identity; and the bytes read for heads this rank
    does not hold. Nothing is written."""
    layers, unused = {}, 0
    lo, hi = read.own
    for name, ranges in blobs.items():
        cache, cc = caches[name], codecs[name]
        k = v = None
        for (rlo, rhi), parsed in ranges.items():
            rcc = dataclasses.replace(cc, hashes=read.hashes((rlo, rhi)))
            shape = cache.new_empty((0, rhi - rlo, 0, cache.shape[3]))  # a cache of that range's heads
            kr, vr = decode_chunk(
                parsed,
                shape,
                rcc,
                num_tokens=read.num_tokens,
                chunk_hash=read.chunk_hash,
                ids=(layer_ids[name], read.chunk_id),
            )
            if k is None:
                k = kr.new_empty((kr.shape[0], hi - lo, kr.shape[2]))
                v = vr.new_empty((vr.shape[0], hi - lo, vr.shape[2]))
            a, b = max(lo, rlo), min(hi, rhi)
            k[:, a - lo : b - lo] = kr[:, a - rlo : b - rlo]
            v[:, a - lo : b - lo] = vr[:, a - rlo : b - rlo]
            unused += len(parsed.blob) * ((rhi - rlo) - (b - a)) // (rhi - rlo)
        layers[name] = LayerChunk(cc, kv=(k, v))  # type: ignore[arg-type]  # every layer has a range
    return PreparedChunk(read.chunk_id, read.num_tokens, layers), unused
