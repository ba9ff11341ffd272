"""Writing a chunk read by :func:`~.chunks.read_chunk` into every layer's paged cache (vLLM's step).

On CPU caches the C loops copy K and dequantize V straight into each layer's view, the chunk's
layers in one :func:`~kvcodec.backends.scatter_blob_rows_many` call; a blob read with its CRC
unchecked has it checked in that pass. Anything C declines is decoded and scattered as
:func:`~.chunks.decode_chunk` + :func:`~.layout.scatter_kv` would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcodec import Reason, UnsupportedConfigError
from kvcodec.backends import scatter_blob_rows_many
from kvcodec.format import BlobCrc

from .chunks import LayerChunk, PreparedChunk
from .layout import ChunkSlots, chunk_slots, scatter_kv

__all__ = ["write_chunk"]


def write_chunk(
    chunk: PreparedChunk,
    caches: Mapping[str, torch.Tensor],
    block_ids: Sequence[int] | torch.Tensor,
    *,
    start: int,
    skip: int = 0,
) -> None:
    """Write a :func:`read_chunk` result into every layer's cache: the chunk's tokens ``skip ..``
    go to request tokens ``start + skip ..`` (``start``: the chunk's first token; the first ``skip``
    stay as vLLM computed them). Writes the bytes :func:`decode_chunk` + :func:`~.layout.scatter_kv` write. The slots are computed
    once for all layer views of one geometry, and all of them before the first write (bad block ids
    raise with nothing written). On a CPU cache, one C pass per layer copies K and dequantizes V into
    the view, a geometry's layers in one call. Runs on the thread that owns the caches (vLLM's step).

    A layer read with its CRC unchecked (:attr:`LayerChunk.unverified`) is checked in that pass:
    a mismatch raises :class:`~kvcodec.CorruptEncodedKVError` with the layer already written, so
    the caller must fail the load (vLLM recomputes the blocks) and remove the blob.
    """
    if isinstance(skip, bool) or not isinstance(skip, int) or not 0 <= skip <= chunk.num_tokens:
        raise UnsupportedConfigError(
            f"skip must be an int in 0..{chunk.num_tokens}; got {skip!r}", reason=Reason.BAD_VALUE
        )
    n = chunk.num_tokens - skip
    memo: dict[tuple[int, int, int], tuple[ChunkSlots, Any]] = {}
    plan = []
    for name, layer in chunk.layers.items():
        cache = caches[name]
        key = (cache.shape[0], cache.shape[2], layer.codec.block_size) if cache.dim() == 4 else (-1, -1, -1)
        if key not in memo:
            s = chunk_slots(
                cache, block_ids, block_size=layer.codec.block_size, start=start + skip, num_tokens=n
            )
            memo[key] = (s, s.runs_array(shift=skip))
        plan.append((cache, layer, *memo[key]))
    by_runs: dict[int, list[tuple[torch.Tensor, LayerChunk, ChunkSlots, Any]]] = {}
    for entry in plan:  # the layers C can take, one batch per geometry (its runs)
        if entry[1].rows is not None:
            by_runs.setdefault(id(entry[3]), []).append(entry)
    written: set[int] = set()
    for group in by_runs.values():
        written |= _write_c(group)
    for cache, layer, slots, _ in plan:
        if id(layer) not in written:
            _write_decoded(cache, layer, block_ids, slots, start, skip)


def _write_c(plan: list[tuple[torch.Tensor, LayerChunk, ChunkSlots, Any]]) -> set[int]:
    """Layers of one geometry, each with rows for C, in one :func:`scatter_blob_rows_many`: the ids of
    those written (a CRC read unchecked is checked after the writes, in order: a mismatch raises)."""
    writes = [(lay.rows, c, None if lay.unverified is None else lay.unverified.seed) for c, lay, _, _ in plan]
    got = scatter_blob_rows_many(writes, plan[0][1].codec.head_size, plan[0][3])
    written = set()
    for (_, layer, _, _), res in zip(plan, got):
        if res is not None:
            if layer.unverified is not None:
                _finish_crc(layer.unverified, res.crc)
            written.add(id(layer))
    return written


def _finish_crc(crc: BlobCrc, got: int | None) -> None:
    """After a C pass that wrote the blob: ``got`` its CRC through K and V's codes (continued over the
    scales), or None when C did not fold it (the whole blob checked). Only once it passed is the
    header remembered (the store's read left it out of the memo)."""
    crc.finish(got, crc.codes_end, remember=True)


def _write_decoded(
    cache: torch.Tensor, layer: LayerChunk, block_ids: Any, slots: ChunkSlots, start: int, skip: int
) -> None:
    """A layer C did not write (no rows for it, or C declined: NaN codes, a layout): its CRC first if
    unchecked, then V decoded (as :func:`decode_chunk` does) and both scattered by
    :func:`~.layout.scatter_kv`."""
    cc = layer.codec
    if layer.unverified is not None:
        layer.unverified.finish(None)
    k, v = layer.decoded(cache.dtype)
    scatter_kv(
        cache,
        block_ids,
        k[skip:],
        v[skip:],
        head_size=cc.head_size,
        block_size=cc.block_size,
        start=start + skip,
        slots=slots,
    )
