"""vLLM KV events for the chunks the connector stores (vLLM 0.32's connector event API).

The worker that writes a chunk's manifest (the chunk is then loadable: every layer's and rank's blob
is in) reports the chunk's :class:`~.metadata.ChunkEvent`; ``get_kv_connector_kv_cache_events``
hands them to vLLM as ``BlockStored`` events (vLLM's own block hashes, ``medium`` ``STORAGE``,
``locality`` ``LOCAL`` for a directory store, ``REMOTE`` for any other) in a
:class:`KvcodecKVEvents`; the scheduler side collects them in ``update_connector_output`` and
``take_events`` gives them to vLLM's publisher. One rank reports each chunk, so events are kept as
reported, not only those every worker reported. No ``BlockRemoved``: the store evicts on its own
(another engine, Redis's LRU) and tells no one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored, KVCacheEvent, KVConnectorKVEvents

from .metadata import ChunkEvent

__all__ = ["KvcodecKVEvents", "block_stored"]


class KvcodecKVEvents(KVConnectorKVEvents):
    """The events of one step, from every worker, in order (each chunk reported by one rank)."""

    def __init__(self, events: Sequence[KVCacheEvent] = (), num_workers: int = 1) -> None:
        self._events = list(events)
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KvcodecKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()


def block_stored(events: Sequence[ChunkEvent], locality: str) -> KvcodecKVEvents | None:
    """The ``BlockStored`` events of stored chunks (None when there are none)."""
    if not events:
        return None
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    def one(e: ChunkEvent) -> BlockStored:
        parent: Any = e.parent_block_hash
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in e.block_hashes],
            parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
            token_ids=list(e.token_ids),
            block_size=e.block_size,
            lora_id=e.lora_id,
            medium=MEDIUM_STORAGE,
            lora_name=e.lora_name,
            locality=locality,
        )

    return KvcodecKVEvents([one(e) for e in events])
