"""The connector's key grammar, written and parsed here only.

Every key of one chunk ends ``-C<chunk>-H<hash>[-P<parent hash>]``:

* a layer's blob: ``<model16>-L<layer>-C..``  (``model16`` of the rank that wrote it);
* a tensor-parallel rank's marker: ``<model16>-R-C..``;
* the chunk's manifest (written last, after every layer and rank): ``<model16 of rank 0>-M-C..``.

``group`` reads a key back as the store's eviction policy and the Redis
backend's hash slot need it: the chunk's group id ``C<chunk>-H<hash>``, its
depth in the prompt and its predecessor's group id. Pure Python (no torch, no
vLLM), so the scheduler side and the store's tests can use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ChunkKeys", "ChunkRef", "group_of", "is_manifest"]

_TAIL_RE = re.compile(r"-C(\d+)-H([A-Za-z0-9]+)(?:-P([A-Za-z0-9]+))?\Z")


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
class ChunkKeys:
    """The keys of one model identity: ``model16`` per tensor-parallel rank (rank 0 names manifests)."""

    model16: dict[int, str]

    def blob(self, rank: int, layer: int, ref: ChunkRef) -> str:
        """The key of one rank's blob of one layer of a chunk."""
        return f"{self.model16[rank]}-L{layer}{ref.suffix}"

    def rank_marker(self, rank: int, ref: ChunkRef) -> str:
        """The key a rank writes once all its blobs of a chunk are stored (tensor parallel only)."""
        return f"{self.model16[rank]}-R{ref.suffix}"

    def manifest(self, ref: ChunkRef) -> str:
        """The chunk's manifest: present only once every layer's and rank's blob is."""
        return f"{self.model16[0]}-M{ref.suffix}"

    def manifest_prefix(self) -> str:
        """What every manifest key of this identity starts with."""
        return f"{self.model16[0]}-M-"

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
    return m is not None and key[: m.start()].endswith("-M")
