"""The worker's registered layer caches, shared by its load and save handlers: the views, one codec
for every layer, the fused path when it serves them, and the chunk manifest's blob."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcodec.errors import Reason, UnsupportedConfigError
from kvcodec.format import Hashes, Header, ScaleScope, assemble

from .chunks import ChunkCodec, FP8Scales, blob_identity
from .fused import FusedLayers
from .identity import CacheGeometry

__all__ = ["LayerCaches"]


@dataclass
class LayerCaches:
    """What ``register_kv_caches`` sets up: the worker builds it (and its handlers) there."""

    geo: CacheGeometry
    layers: dict[str, int]
    """Every attention layer's name -> layer id (the key's ``-L<id>``)."""
    chunk_size: int
    rank: int = 0
    world: int = 1
    caches: dict[str, torch.Tensor] = field(default_factory=dict)
    codec0: ChunkCodec | None = None
    """The one codec of every layer (a load plans each chunk once for all of them)."""
    fused: FusedLayers | None = None
    side_stream: Any = None
    """CUDA: the stream the fused save's gather+encode runs on, ordered against the forward."""
    fp8_scales: Callable[[str], FP8Scales] | None = None
    """FP8 caches: a layer's K/V scales, read when used (vLLM may set them after registration)."""
    groups: dict[str, int] = field(default_factory=dict)
    """Layer name -> its KV cache group (vLLM's hybrid allocator); empty: one group."""
    windowed: bool = False
    """Some group is sliding-window: vLLM frees its blocks outside the window at the next schedule,
    so chunks are copied out of the cache inside the step that completes them."""

    def by_group(self) -> list[tuple[int, list[str]]]:
        """Each KV cache group and its registered layers (one group: every layer)."""
        out: dict[int, list[str]] = {}
        for name in self.caches:
            out.setdefault(self.groups.get(name, 0), []).append(name)
        return sorted(out.items())

    def register(self, kv_caches: dict[str, torch.Tensor], codec: ChunkCodec) -> None:
        """Keep the views of this model's layers, each checked against the geometry."""
        geo = self.geo
        want_c = geo.head_size + geo.head_size_v
        for name, cache in kv_caches.items():
            if name not in self.layers:
                continue
            if cache.dim() != 4 or cache.shape[1] != geo.num_kv_heads or cache.shape[3] != want_c:
                raise UnsupportedConfigError(
                    f"layer {name}: expected a [blocks, {geo.num_kv_heads}, block, {want_c}] view; "
                    f"got {tuple(cache.shape)}",
                    reason=Reason.BAD_SHAPE,
                )
            self.caches[name] = cache
        self.codec0 = codec

    @property
    def on_cpu(self) -> bool:
        """Every registered cache is in host memory (the background threads may read and write it)."""
        return bool(self.caches) and all(c.device.type == "cpu" for c in self.caches.values())

    def codec(self, name: str) -> ChunkCodec:
        """The layer's codec, with its FP8 scales read now."""
        cc = self.codec0
        if cc is None:
            raise UnsupportedConfigError("no KV caches registered", reason=Reason.MISSING_ARGUMENT)
        if not self.geo.fp8 or self.fp8_scales is None:
            return cc
        return dataclasses.replace(cc, fp8=self.fp8_scales(name))

    def chunk_bytes(self) -> int:
        """Host bytes one chunk of every layer holds once gathered out of the cache (K and V)."""
        return sum(self.chunk_size * c.shape[1] * c.shape[3] * c.element_size() for c in self.caches.values())

    def manifest_blob(self, chunk: int, chunk_hash: str) -> bytearray:
        """A payload-free LMCKV blob with the chunk's identity (``kvcodec verify`` reads it like a blob)."""
        cc = self.codec0
        if cc is None:
            raise UnsupportedConfigError("no KV caches registered", reason=Reason.MISSING_ARGUMENT)
        hashes = blob_identity(cc, self.geo.head_size, self.geo.head_size_v, chunk_hash)
        header = Header(
            k_dtype=torch.bfloat16,
            v_dtype=torch.float8_e4m3fn,
            scale_scope=ScaleScope.EXTERNAL,
            version=2,
            layer_id=-1,
            chunk_id=chunk,
            chunk_size=self.chunk_size,
            hashes=Hashes.coerce(hashes),
        )
        return assemble(header)
