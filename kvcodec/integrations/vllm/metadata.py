"""What the scheduler side tells the worker side each step. Pure Python (no torch, no vLLM): the
facade's ``KvcodecMetadata`` adds vLLM's ``KVConnectorMetadata`` base to :class:`StepPlan`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .chunk_keys import ChunkRef

__all__ = ["ChunkEvent", "LoadSpec", "SaveSpec", "StepPlan"]


@dataclass(frozen=True)
class ChunkEvent:
    """What vLLM's KV event for a stored chunk names (a ``BlockStored`` of its blocks, vLLM's own block
    hashes, so a cache-aware router matches them to prompts)."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass
class SaveSpec:
    """Save chunk ``chunk`` (tokens ``chunk * chunk_size ..``) of a request."""

    req_id: str
    chunk: int
    chunk_hash: str
    parent_hash: str | None
    block_ids: list[int]
    event: ChunkEvent | None = None
    """The KV event to report once the chunk is loadable (None: KV events off, or no block hashes)."""
    group_blocks: list[list[int]] = field(default_factory=list)
    """With several KV cache groups (vLLM's hybrid allocator): each group's blocks up to the chunk's
    end (``block_ids`` is group 0's)."""

    def blocks(self, group: int) -> list[int]:
        """The block table of KV cache group ``group``."""
        return self.group_blocks[group] if self.group_blocks else self.block_ids

    @property
    def ref(self) -> ChunkRef:
        """The chunk, as its keys name it."""
        return ChunkRef(self.chunk, self.chunk_hash, self.parent_hash)


@dataclass
class LoadSpec:
    """Load tokens ``start .. end`` of a request from chunks ``start // chunk_size ..``."""

    req_id: str
    start: int
    end: int
    chunk_hashes: list[str]
    """Hashes of every chunk from the request's first on (only those covering start..end are read)."""
    block_ids: list[int]
    background: bool = False
    """Read on the loader thread, written and reported through ``get_finished``."""
    group_blocks: list[list[int]] = field(default_factory=list)
    """With several KV cache groups: each group's block table (``block_ids`` is group 0's); a
    sliding-window group's blocks outside the window are vLLM's null block (id 0), not written."""
    splits: list[int] = field(default_factory=list)
    """Per chunk from the request's first: the head split (parts) its blobs were found in (none
    given: this engine's own)."""

    def blocks(self, group: int) -> list[int]:
        """The block table of KV cache group ``group``."""
        return self.group_blocks[group] if self.group_blocks else self.block_ids

    def split(self, chunk: int, own: int) -> int:
        """The head split to read chunk ``chunk`` from."""
        return self.splits[chunk] if chunk < len(self.splits) else own

    def ref(self, chunk: int) -> ChunkRef:
        """Chunk ``chunk`` of the request, as its keys name it."""
        return ChunkRef.of(self.chunk_hashes, chunk)


@dataclass
class StepPlan:
    """What the worker does this step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    tokens_hit: int = 0
    """Lookups since the last step: prompt tokens the connector will load ..."""
    tokens_missed: int = 0
    """... and prompt tokens neither it nor vLLM's own prefix cache had."""
    lookups_unavailable: int = 0
    """Lookups since the last step that found the store unreachable (answered as misses)."""
    loads_deferred: int = 0
    """Lookups since the last step answered "ask again later" (``max_concurrent_loads`` in flight)."""
    lookup_calls: int = 0
    """``contains_many`` calls the scheduler side made since the last step (one round trip each on a
    remote store): one per prompt looked up, one per step that plans a request's saves."""
    held: list[str] = field(default_factory=list)
    """Requests finished since the last step whose blocks vLLM keeps (``request_finished`` returned
    True) until ``get_finished`` reports them sent: their chunks may still be being copied out."""
    idle: bool = False
    """This step computes no token (vLLM steps anyway while requests wait for their loads)."""
    preempted: list[str] = field(default_factory=list)
    """Requests preempted by this step's schedule: their blocks are free, so ``handle_preemptions``
    waits for any copy still reading them before the forward may overwrite them."""
