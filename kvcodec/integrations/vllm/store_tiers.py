"""The connector's store as configured: one store, or tiers of stores in front of it.

* ``host_cache_bytes``: a RAM tier of encoded blobs (:class:`~kvcodec.store.memory.MemoryStore`)
  first, shared by the connectors of one process (vLLM's scheduler-side and worker-side connectors
  of a TP=1 engine live in one process: the lookup sees what the worker wrote or loaded);
* ``root`` and a remote ``store`` both set: the local directory in front of the remote store;
* the configured store last.

A tier configured with ``compression: "lossless"`` (none by default: :data:`DEFAULT_COMPRESSION`)
stores each plain blob as its lossless twin (:mod:`kvcodec.codec.lossless`, about 0.72x the bytes on a
real model's KV) and hands it back expanded, byte for byte, so every other part of the connector sees
plain blobs. Writes go through to every tier; reads take the fastest and promote (:mod:`kvcodec.store.tiers`),
with the chunk's manifest that the scheduler-side lookup found below (a memo shared in the process).
vLLM's per-source hit metrics get each chunk under its tier's source (RAM: ``HOST``, directory:
``DISK``, remote: ``EXTERNAL_UNSPECIFIED``). Also here: opening the connector's store (the fleet key
checked against it, one probe at start).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from kvcodec.codec.lossless import compress_blob, expand_blob
from kvcodec.errors import CodecError, Reason, UnsupportedConfigError
from kvcodec.format import LOSSLESS_OF, MAGIC, PLAIN_OF, ParsedBlob, parse
from kvcodec.hostmem import new_buffer
from kvcodec.store import BlobStore, DirectoryStore, StoreOptions, open_store
from kvcodec.store.auth import load_fleet_key
from kvcodec.store.base import SEALS_VALUES
from kvcodec.store.factory import REDIS_SCHEMES
from kvcodec.store.memory import MemoryStore
from kvcodec.store.tiers import ManifestMemo, Tier, TieredStore

from .chunk_keys import group_of, is_manifest
from .config import DEFAULT_COMPRESSION, KvcodecConfig

logger = logging.getLogger("vllm.kvcodec")

__all__ = [
    "DEFAULT_COMPRESSION",
    "LosslessTier",
    "by_source",
    "flat_stats",
    "hit_source",
    "open_connector_store",
    "open_tiers",
    "stores_of",
    "tier_sources",
]


def open_tiers(cfg: KvcodecConfig, options: StoreOptions) -> BlobStore:
    """The configured store, or a :class:`~kvcodec.store.tiers.TieredStore` of its tiers; each tier
    whose ``compression`` is ``lossless`` behind a :class:`LosslessTier`."""
    remote = _is_remote(cfg.store)
    tiers = []
    if cfg.host_cache_bytes is not None:
        tiers.append(Tier("ram", _coded(cfg, "ram", _SHARED_RAM.acquire(cfg, options))))
    if remote and cfg.root is not None:
        tiers.append(Tier("disk", _coded(cfg, "disk", open_store(cfg.root, options))))
    name = "remote" if remote else "disk"
    bottom = _coded(cfg, name, open_store(cfg.location, options))
    if not tiers:
        return bottom
    tiers.append(Tier(name, bottom))
    return TieredStore(tiers, options, _memo_of(cfg))


def _coded(cfg: KvcodecConfig, tier: str, store: BlobStore) -> BlobStore:
    return LosslessTier(store) if cfg.compression_of(tier) == "lossless" else store


_LOSSLESS_IDS = frozenset(int(s) for s in PLAIN_OF)


def _is_lossless(mv: memoryview) -> bool:
    """Whether ``mv`` starts like a lossless LMCKV blob (magic, version 2, a lossless scheme id)."""
    b = bytes(mv[:20])
    return (
        len(b) == 20
        and b[:8] == MAGIC
        and b[8:10] == b"\x02\x00"
        and int.from_bytes(b[18:], "little") in _LOSSLESS_IDS
    )


class LosslessTier:
    """A store that keeps plain blobs as their lossless twins and gives them back plain, byte for byte.

    ``put``: a plain version-2 blob (its CRC checked first, so damage is never sealed in) is stored
    coded; anything else (a manifest, a blob the stage cannot code) as it is. Reads expand a lossless
    blob after checking its own CRC, whatever ``verify_crc`` says; a damaged one raises
    ``CorruptEncodedKVError`` as any damaged blob does. Everything else is the inner store's.
    """

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self._local = threading.local()  # .spare: the stored bytes of this thread's last get_parsed

    def __getattr__(self, name: str) -> Any:  # partial_groups, location, stats, keys, close...
        return getattr(self.inner, name)

    @staticmethod
    def _code(key: str, blob: Any) -> Any:
        if is_manifest(key):
            return blob
        try:
            p = parse(blob)
        except CodecError:
            return blob  # not a blob kvcodec reads: stored as given, refused when read
        if p.header.version < 2 or p.header.scale_scheme not in LOSSLESS_OF:
            return blob
        try:
            return compress_blob(p)
        except UnsupportedConfigError:  # 32-bit K, no layout fields: the plain blob
            return blob

    @staticmethod
    def _expand(p: ParsedBlob, checked: bool, into: Callable[[int], Any] | None = None) -> ParsedBlob:
        """``p`` as its plain blob (its own CRC checked first unless ``checked``), written into
        ``into(size)`` when given (a reused buffer: no page faults), else a new one."""
        if p.header.scale_scheme not in PLAIN_OF:
            return p
        if not checked:
            p = parse(p.blob)
        return parse(expand_blob(p, into=into), verify_crc=False)

    def put(self, key: str, blob: Any) -> None:
        self.inner.put(key, self._code(key, blob))

    def put_many(self, items: Any) -> None:
        self.inner.put_many([(k, self._code(k, b)) for k, b in items])

    def get(self, key: str, *, max_bytes: int | None = None) -> memoryview:
        mv = self.inner.get(key, max_bytes=max_bytes)
        return memoryview(expand_blob(parse(mv))) if _is_lossless(mv) else mv

    def get_parsed(
        self,
        key: str,
        into: bytearray | None = None,
        *,
        verify_crc: bool = True,
        max_bytes: int | None = None,
    ) -> ParsedBlob:
        """The inner store's blob, expanded into ``into`` when it is large enough (the caller's reused
        buffer, as for a plain read), the stored bytes read into this thread's reused buffer."""
        spare = getattr(self._local, "spare", None)
        p = self.inner.get_parsed(key, spare, verify_crc=verify_crc, max_bytes=max_bytes)
        if p.header.scale_scheme not in PLAIN_OF:  # stored plain: it must live in the caller's memory
            return p if p.buffer.obj is not spare else parse(bytes(p.blob), verify_crc=False)
        if isinstance(p.buffer.obj, bytearray):
            self._local.spare = p.buffer.obj  # grown to the largest stored blob read on this thread
        if isinstance(into, bytearray):
            return self._expand(p, verify_crc, lambda n: into if len(into) >= n else new_buffer(n))
        return self._expand(p, verify_crc)

    def get_parsed_many(
        self, keys: Any, *, verify_crc: bool = True, max_bytes: int | None = None, buffers: Any = None
    ) -> list[ParsedBlob]:
        """The inner store's blobs, expanded: with ``buffers`` (the caller's pool) read into buffers it
        lends and expanded into others it lends, which the caller gives back as for any read; the stored
        bytes' buffers go back at once. Without, new buffers."""
        got = self.inner.get_parsed_many(keys, verify_crc=verify_crc, max_bytes=max_bytes, buffers=buffers)
        out = [self._expand(p, verify_crc, None if buffers is None else buffers.lend) for p in got]
        if buffers is not None:
            viewed = {id(p.buffer.obj) for p in out}
            spent = {id(o): o for p in got if buffers.owns(o := p.buffer.obj) and id(o) not in viewed}
            buffers.give(list(spent.values()))
        return out


_SOURCE_OF_TIER = {"ram": "HOST", "disk": "DISK", "remote": "EXTERNAL_UNSPECIFIED"}
"""vLLM's ``CacheHitSource`` member each tier's hits count under (a remote store is none of the others)."""


def tier_sources(store: BlobStore) -> list[Any] | None:
    """The ``CacheHitSource`` of each tier of a tiered store (None: not tiered, or a vLLM without
    per-source hit metrics)."""
    if not isinstance(store, TieredStore):
        return None
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return [CacheHitSource[_SOURCE_OF_TIER[t.name]] for t in store.tiers]


def by_source(tokens_per_tier: dict[int, int], sources: list[Any]) -> dict[Any, int]:
    """Tokens per tier index -> tokens per hit source (two tiers may share a source)."""
    out: dict[Any, int] = {}
    for tier, n in tokens_per_tier.items():
        out[sources[tier]] = out.get(sources[tier], 0) + n
    return out


def flat_stats(store: BlobStore) -> dict[str, float]:
    """The store's counters, and with tiers each tier's (``<tier>_<name>``: its own counters and the
    :data:`~kvcodec.store.tiers.TIER_COUNTERS`)."""
    out = dict(store.stats())
    if isinstance(store, TieredStore):
        for tier, counts in store.tier_stats().items():
            out.update({f"{tier}_{name}": value for name, value in counts.items()})
    return out


def stores_of(store: BlobStore) -> list[BlobStore]:
    """The stores a connector's store is made of (its tiers, or itself; a :class:`LosslessTier`'s inner store)."""
    tiers = [t.store for t in store.tiers] if isinstance(store, TieredStore) else [store]
    return [s.inner if isinstance(s, LosslessTier) else s for s in tiers]


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


# ------------------------------------------------------------ the connector's store


def open_connector_store(cfg: KvcodecConfig) -> BlobStore:
    """The configured store (``store`` URL, else the ``root`` directory), told the chunk grammar
    (:func:`~.chunk_keys.group_of`; manifests evicted first, :func:`~.chunk_keys.is_manifest`) and the
    fleet key, if any."""
    options = StoreOptions(
        max_bytes=cfg.max_bytes,
        fsync=cfg.fsync,
        group_of=group_of,
        evict_first=is_manifest,
        key_prefix=cfg.key_prefix,
        fleet_key=load_fleet_key(cfg.fleet_key_env, cfg.fleet_key_file),
        timeout_s=cfg.store_timeout_ms / 1000,
        verify_blobs=False,  # loads CRC-check every blob in get_parsed; nothing else reads
    )
    try:
        store = open_tiers(cfg, options)
    except OSError as e:
        raise UnsupportedConfigError(
            f"store {cfg.location!r}: cannot open the store: {e}", reason=Reason.UNSUPPORTED
        ) from None
    try:
        _check_fleet_key(store, cfg, options.fleet_key is not None)
        _probe(store)
    except BaseException:
        store.close()
        raise
    return store


def _authenticates(store: BlobStore) -> bool:
    """Whether the store (one of its tiers) seals values with the fleet key (its ``seals_values``:
    RedisStore; a directory or a RAM tier is local)."""
    return any(getattr(s, SEALS_VALUES, False) for s in stores_of(store))


def _check_fleet_key(store: BlobStore, cfg: KvcodecConfig, keyed: bool) -> None:
    """A fleet key the store would ignore: refused when given as ``fleet_key_file``, else a WARNING."""
    if not keyed or _authenticates(store):
        return
    what = f"store {getattr(store, 'location', cfg.location)!r} ({type(store).__name__}) does not use a fleet key"
    if cfg.fleet_key_file is not None:
        raise UnsupportedConfigError(
            f"fleet_key_file is set but the {what}: remove it or use a Redis store", reason=Reason.UNSUPPORTED
        )
    logger.warning(
        "kvcodec: a fleet key is set (%s) but the %s: values are neither sealed nor checked",
        cfg.fleet_key_env,
        what,
    )


def _probe(store: BlobStore) -> None:
    """One ``contains`` now, so that a config error a store finds only when it connects (a Redis Cluster
    URL naming a database other than 0) stops the engine at start; an unreachable store is an outage,
    not a config error (the store logs it; lookups miss until it is back)."""
    try:
        store.contains_many([_PROBE_KEY])
    except UnsupportedConfigError:
        raise
    except (CodecError, OSError):
        pass


_PROBE_KEY = "kvcodec-start-probe"
"""A key no chunk has (chunk keys start with the 16-hex model prefix)."""


def hit_source(store: BlobStore, default: Any) -> Any:
    """The ``CacheHitSource`` vLLM counts this connector's hits under: ``DISK`` for a directory store;
    ``default`` (``EXTERNAL_UNSPECIFIED``, vLLM's label for a remote store) for any other, Redis
    included (a network store is none of DEVICE, HOST, P2P or DISK). Tiers: their outermost store's, for
    a hit whose tiers are not known (``get_external_cache_hit_sources`` splits the others by tier)."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:  # a vLLM without per-source hit metrics
        return default
    return CacheHitSource.DISK if isinstance(stores_of(store)[-1], DirectoryStore) else default
