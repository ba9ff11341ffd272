"""The connector's store as configured: one store, or tiers of stores in front of it.

* ``host_cache_bytes``: a RAM tier of encoded blobs (:class:`~kvcodec.store.memory.MemoryStore`)
  first, shared by the connectors of one process (vLLM's scheduler-side and worker-side connectors
  of a TP=1 engine live in one process: the lookup sees what the worker wrote or loaded);
* ``root`` and a remote ``store`` both set: the local directory in front of the remote store;
* the configured store last.

Writes go through to every tier; reads take the fastest and promote (:mod:`kvcodec.store.tiers`),
with the chunk's manifest that the scheduler-side lookup found below (a memo shared in the process).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from kvcodec.store import BlobStore, StoreOptions, open_store
from kvcodec.store.factory import REDIS_SCHEMES
from kvcodec.store.memory import MemoryStore
from kvcodec.store.tiers import ManifestMemo, Tier, TieredStore

from .config import KvcodecConfig

__all__ = ["open_tiers", "stores_of"]


def open_tiers(cfg: KvcodecConfig, options: StoreOptions) -> BlobStore:
    """The configured store, or a :class:`~kvcodec.store.tiers.TieredStore` of its tiers."""
    remote = _is_remote(cfg.store)
    tiers = []
    if cfg.host_cache_bytes is not None:
        tiers.append(Tier("ram", _SHARED_RAM.acquire(cfg, options)))
    if remote and cfg.root is not None:
        tiers.append(Tier("disk", open_store(cfg.root, options)))
    bottom = open_store(cfg.location, options)
    if not tiers:
        return bottom
    tiers.append(Tier("remote" if remote else "disk", bottom))
    return TieredStore(tiers, options, _memo_of(cfg))


def stores_of(store: BlobStore) -> list[BlobStore]:
    """The stores a connector's store is made of (its tiers, or itself)."""
    if isinstance(store, TieredStore):
        return [t.store for t in store.tiers]
    return [store]


def _is_remote(url: str | None) -> bool:
    return url is not None and "://" in url and url.split("://", 1)[0].lower() in REDIS_SCHEMES


_MEMOS: weakref.WeakValueDictionary[tuple[Any, ...], ManifestMemo] = weakref.WeakValueDictionary()
_MEMOS_LOCK = threading.Lock()


def _memo_of(cfg: KvcodecConfig) -> ManifestMemo:
    """The manifests found below the top tier, shared by the connectors of one process over the same
    tiers: the scheduler-side one looks a chunk up, the worker-side one reads (and promotes) it."""
    with _MEMOS_LOCK:
        memo = _MEMOS.get(_tiers_key(cfg))
        if memo is None:
            memo = _MEMOS[_tiers_key(cfg)] = ManifestMemo()
        return memo


def _tiers_key(cfg: KvcodecConfig) -> tuple[Any, ...]:
    return (cfg.location, cfg.root, cfg.key_prefix, cfg.host_cache_bytes)


class _SharedRam:
    """One RAM tier per configured store in this process, closed when its last connector closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tiers: dict[tuple[Any, ...], list[Any]] = {}

    def acquire(self, cfg: KvcodecConfig, options: StoreOptions) -> BlobStore:
        key = _tiers_key(cfg)
        with self._lock:
            entry = self._tiers.get(key)
            if entry is None:
                entry = self._tiers[key] = [MemoryStore(cfg.host_cache_bytes, options), 0]
            entry[1] += 1
            return _RamHandle(entry[0], lambda: self._release(key))

    def _release(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            entry = self._tiers[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._tiers[key]
                entry[0].close()


_SHARED_RAM = _SharedRam()


class _RamHandle:
    """A connector's handle on a shared RAM tier: the tier's interface, its own ``close``."""

    def __init__(self, ram: MemoryStore, release: Any) -> None:
        self._ram = ram
        self._release = release
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ram, name)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._release()
