"""The connector's key grammar, written and parsed here only.

Keys do not depend on the tensor-parallel size: every engine of one model identity (``model16``) at
any TP size names a chunk the same way. Every key of one chunk ends ``-C<chunk>-H<hash>[-P<parent>]``:

* a layer's blob: ``<model16>-L<layer>-C..`` when it holds every KV head (a chunk written by one
  rank), ``<model16>-L<layer>.<lo>.<hi>-C..`` when it holds KV heads ``lo .. hi-1`` (one of
  ``parts`` equal head ranges: a chunk written by ``parts`` tensor-parallel ranks);
* a tensor-parallel rank's marker: ``<model16>-R<rank>.<world>-C..``;
* the chunk's manifest (written last, after every layer's and rank's blob): ``<model16>-M-C..`` for
  a chunk of whole-head blobs, ``<model16>-M<parts>-C..`` for one split into ``parts`` head ranges.

``group`` reads a key back as the store's eviction policy and the Redis
backend's hash slot need it: the chunk's group id ``C<chunk>-H<hash>``, its
depth in the prompt and its predecessor's group id. Pure Python (no torch, no
vLLM), so the scheduler side and the store's tests can use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ChunkKeys", "ChunkRef", "HeadSplit", "group_of", "is_manifest", "splits_for"]

_TAIL_RE = re.compile(r"-C(\d+)-H([A-Za-z0-9]+)(?:-P([A-Za-z0-9]+))?\Z")
_MANIFEST_RE = re.compile(r"-M\d*\Z")


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a prompt: its index, its prefix hash and its predecessor's (None for chunk 0)."""

    chunk: int
    chunk_hash: str
    parent_hash: str | None = None

    @property
    def suffix(self) -> str:
        """``-C<chunk>-H<hash>[-P<parent>]``: the tail every key of this chunk shares."""
        tail = f"-C{self.chunk}-H{self.chunk_hash}"
        return f"{tail}-P{self.parent_hash}" if self.chunk > 0 and self.parent_hash else tail

    @property
    def group(self) -> str:
        """The chunk's group id, ``C<chunk>-H<hash>`` (the store groups and hash-slots by it)."""
        return f"C{self.chunk}-H{self.chunk_hash}"

    @classmethod
    def of(cls, hashes: list[str], chunk: int) -> ChunkRef:
        """Chunk ``chunk`` of a prompt whose chained prefix hashes are ``hashes``."""
        return cls(chunk, hashes[chunk], hashes[chunk - 1] if chunk else None)


@dataclass(frozen=True)
class HeadSplit:
    """A chunk's KV heads split into ``parts`` equal ranges, one blob per layer and range."""

    heads: int
    """The model's KV heads (all ranks together)."""
    parts: int = 1

    def range(self, part: int) -> tuple[int, int]:
        """Heads ``lo .. hi-1`` of part ``part``."""
        n = self.heads // self.parts
        return part * n, (part + 1) * n

    @classmethod
    def of_world(cls, heads: int, world: int) -> HeadSplit:
        """How ``world`` tensor-parallel ranks split ``heads`` KV heads (more ranks than heads: each
        head on ``world // heads`` ranks, as vLLM replicates them)."""
        return cls(heads, min(world, heads))

    def part_of_rank(self, rank: int, world: int) -> int:
        """The part rank ``rank`` of ``world`` holds (vLLM: ``rank // replicas``)."""
        return rank // max(1, world // self.parts)

    def overlapping(self, lo: int, hi: int) -> list[int]:
        """The parts holding any of heads ``lo .. hi-1``."""
        return [p for p in range(self.parts) if self.range(p)[0] < hi and lo < self.range(p)[1]]


def splits_for(heads: int, own: int, most: int = 8) -> tuple[int, ...]:
    """The head splits a lookup tries: ``own`` first, then every power of two up to ``most`` that
    divides ``heads`` (the TP sizes whose blobs a reader may take)."""
    others = [p for p in (1, 2, 4, 8, 16, 32) if p <= most and heads % p == 0 and p != own]
    return (own, *others)


@dataclass(frozen=True)
class ChunkKeys:
    """The keys of one model identity (``model16``), for a writer whose chunks are split ``split``."""

    model16: str
    split: HeadSplit = HeadSplit(1, 1)
    world: int = 1
    """Tensor-parallel ranks writing each chunk (each its marker; the last also the manifest)."""

    def blob(self, rank: int, layer: int, ref: ChunkRef) -> str:
        """The key of rank ``rank``'s blob of one layer of a chunk (its own head range)."""
        return self.part_blob(layer, ref, self.split, self.split.part_of_rank(rank, self.world))

    def part_blob(self, layer: int, ref: ChunkRef, split: HeadSplit, part: int) -> str:
        """The key of the blob of part ``part`` of ``split`` of one layer of a chunk."""
        if split.parts == 1:
            return f"{self.model16}-L{layer}{ref.suffix}"
        lo, hi = split.range(part)
        return f"{self.model16}-L{layer}.{lo}.{hi}{ref.suffix}"

    def rank_marker(self, rank: int, ref: ChunkRef) -> str:
        """The key a rank writes once all its blobs of a chunk are stored (tensor parallel only)."""
        return f"{self.model16}-R{rank}.{self.world}{ref.suffix}"

    def manifest(self, ref: ChunkRef, parts: int | None = None) -> str:
        """The chunk's manifest for blobs split in ``parts`` (default: this writer's split): present
        only once every layer's and rank's blob is."""
        parts = self.split.parts if parts is None else parts
        return f"{self.model16}-M{'' if parts == 1 else parts}{ref.suffix}"

    @staticmethod
    def group(key: str) -> tuple[str, int, str | None]:
        """``(group id, depth, parent group id)`` of any key; a key outside the grammar is its own group."""
        return group_of(key)


def group_of(key: str) -> tuple[str, int, str | None]:
    """``(group id, depth, parent group id)``: ``m-L3-C2-Habc-Pdef`` -> ``("C2-Habc", 2, "C1-Hdef")``.

    A key that does not end in the chunk grammar is a group of its own at depth 0.
    """
    m = _TAIL_RE.search(key)
    if m is None:
        return key, 0, None
    chunk = int(m.group(1))
    parent = None if m.group(3) is None or chunk == 0 else f"C{chunk - 1}-H{m.group(3)}"
    return f"C{chunk}-H{m.group(2)}", chunk, parent


def is_manifest(key: str) -> bool:
    """Whether ``key`` is a chunk's manifest: a store evicts it before the chunk's blobs, so no lookup
    finds a manifest whose blobs are going."""
    m = _TAIL_RE.search(key)
    return m is not None and _MANIFEST_RE.search(key[: m.start()]) is not None
