"""``TieredStore``: several blob stores, fastest first, behind the one :class:`BlobStore` interface.

A host keeps a RAM tier (:class:`~kvcodec.store.memory.MemoryStore`) and its local directory in front
of a remote store shared by the fleet (Redis), as vLLM's offloading keeps a CPU tier before its
secondary tiers and LMCache an L1 before its L2 adapters:

* **writes go through** to every tier, fastest first; a tier that is full or down is skipped and
  counted (``write_failures``); the write fails only when no tier took it;
* **a read** takes the fastest tier holding every key asked for, and **promotes** what it read to the
  tiers above (with the chunk's manifest when a lookup found it below: a chunk stays whole in every
  tier); below the top tier blobs are read with their CRC checked, so nothing damaged is promoted;
* **damage** in one tier is removed there (each store's own rule) and the next tier is tried; the
  read fails with the damage only when no tier has a good copy;
* **an outage** of one tier is a miss there: the tiers above keep serving hits; a call fails with
  :class:`~kvcodec.errors.StoreUnavailableError` only when every tier it needed was down.

``tier_stats()`` has each tier's own counters and what the tiered store did with it (hits it served,
promotions into it, damage found, outages met, writes it refused).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import CorruptEncodedKVError, Reason, StoreUnavailableError, UnsupportedConfigError
from ..format import ParsedBlob
from .base import STORE_COUNTERS, BlobStore, GroupRead, ReadBufferPool, StoreFullError, StoreOptions
from .eviction import own_group
from .keys import validate_key

__all__ = ["TIER_COUNTERS", "ManifestMemo", "Tier", "TieredStore"]

TIER_COUNTERS: tuple[str, ...] = (
    "served",
    "served_bytes",
    "promoted",
    "damaged",
    "unavailable",
    "write_failures",
)
"""What :meth:`TieredStore.tier_stats` counts per tier, beside the tier's own ``stats()``."""

MANIFESTS_REMEMBERED = 4096
"""Manifests found below the top tier by a lookup, remembered (by chunk group) until the chunk's read
promotes them with its blobs; the oldest are forgotten first."""

_T = TypeVar("_T")


class ManifestMemo:
    """Manifests a lookup found below the top tier, by chunk group, until a read of the chunk promotes
    them; bounded (:data:`MANIFESTS_REMEMBERED`, oldest forgotten first). One memo may serve several
    tiered stores over the same tiers (vLLM's scheduler-side connector looks up, its worker-side one
    reads)."""

    def __init__(self) -> None:
        self._found: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, group: str, manifest: str, tier: int) -> None:
        with self._lock:
            self._found[group] = (manifest, tier)
            self._found.move_to_end(group)
            while len(self._found) > MANIFESTS_REMEMBERED:
                self._found.popitem(last=False)

    def take(self, groups: set[str]) -> list[tuple[str, int]]:
        """The remembered ``(manifest, tier)`` of ``groups``, forgotten here."""
        with self._lock:
            return [self._found.pop(g) for g in groups if g in self._found]


@dataclass(frozen=True)
class Tier:
    """One tier: its name (``ram``, ``disk``, ``remote``: the hit source reported) and its store."""

    name: str
    store: BlobStore


class TieredStore:
    """Tiers of blob stores, fastest first (see the module docstring)."""

    def __init__(
        self, tiers: Sequence[Tier], options: StoreOptions | None = None, memo: ManifestMemo | None = None
    ) -> None:
        names = [t.name for t in tiers]
        if not tiers or len(set(names)) != len(names):
            raise UnsupportedConfigError(f"tiers need distinct names, got {names}", reason=Reason.BAD_VALUE)
        opts = options if options is not None else StoreOptions()
        self.tiers = tuple(tiers)
        self.partial_groups = any(t.store.partial_groups for t in tiers)
        self.location = " > ".join(f"{t.name} {t.store.location}" for t in tiers)
        self._group_of = opts.group_of if opts.group_of is not None else own_group
        self._is_manifest: Callable[[str], bool] = opts.evict_first or (lambda _key: False)
        self._memo = memo if memo is not None else ManifestMemo()
        self._counts = {t.name: dict.fromkeys(TIER_COUNTERS, 0) for t in tiers}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ writes

    def put(self, key: str, blob: Any) -> None:
        """Store ``blob`` in every tier that takes it (see the module docstring)."""
        self.put_many([(key, blob)])

    def put_many(self, items: Sequence[tuple[str, Any]]) -> None:
        """``put_many`` on every tier, fastest first; fails only when no tier took the items."""
        for key, _ in items:
            validate_key(key)
        failures: list[Exception] = []
        for tier in self.tiers:
            try:
                tier.store.put_many(items)
            except (StoreFullError, StoreUnavailableError) as e:
                self._count(tier, write_failures=1)
                failures.append(e)
        if len(failures) == len(self.tiers):
            raise failures[-1]

    # ------------------------------------------------------------ reads

    def get(self, key: str, *, max_bytes: int | None = None) -> memoryview:
        validate_key(key)
        [view] = self._serve([key], lambda st, _crc: [st.get(key, max_bytes=max_bytes)], True, bytes)
        return view

    def get_parsed(
        self,
        key: str,
        into: bytearray | None = None,
        *,
        verify_crc: bool = True,
        max_bytes: int | None = None,
    ) -> ParsedBlob:
        validate_key(key)

        def read(st: BlobStore, crc: bool) -> list[ParsedBlob]:
            return [st.get_parsed(key, into, verify_crc=crc, max_bytes=max_bytes)]

        return self._serve([key], read, verify_crc, _blob_bytes)[0]

    def get_parsed_many(
        self,
        keys: Sequence[str],
        *,
        verify_crc: bool = True,
        max_bytes: int | None = None,
        buffers: ReadBufferPool | None = None,
    ) -> list[ParsedBlob]:
        """The blobs from the fastest tier holding them all (``buffers`` unused: what is read below the
        top is promoted, and a promoted blob must not live in a buffer its caller reuses)."""
        keys = [validate_key(k) for k in keys]
        if not keys:
            return []

        def read(st: BlobStore, crc: bool) -> list[ParsedBlob]:
            return st.get_parsed_many(keys, verify_crc=crc, max_bytes=max_bytes)

        return self._serve(keys, read, verify_crc, _blob_bytes)

    def _serve(
        self,
        keys: list[str],
        read: Callable[[BlobStore, bool], list[_T]],
        verify_crc: bool,
        blob_of: Callable[[_T], Any],
    ) -> list[_T]:
        """``read`` from the fastest tier that has every key, promoting the result to the tiers above.

        Below the top tier the CRC is always checked (what is promoted must be whole); the caller's
        ``verify_crc`` holds for the top tier, whose blobs were checked when they were put."""
        missed: KeyError | None = None
        damaged: CorruptEncodedKVError | None = None
        down: StoreUnavailableError | None = None
        for i, tier in enumerate(self.tiers):
            try:
                got = read(tier.store, verify_crc or i > 0)
            except KeyError as e:
                missed = e
                continue
            except CorruptEncodedKVError as e:
                self._count(tier, damaged=1)
                damaged = e
                continue
            except StoreUnavailableError as e:
                self._count(tier, unavailable=1)
                down = e
                continue
            items = [(k, blob_of(g)) for k, g in zip(keys, got)]
            self._count(tier, served=1, served_bytes=sum(len(b) for _, b in items))
            if i > 0:
                self._promote(i, items)
            return got
        raise damaged or down or missed or KeyError(keys[0])

    def _promote(self, source: int, items: list[tuple[str, Any]]) -> None:
        """Put ``items`` (read from tier ``source``) into every tier above it, with the manifests a
        lookup found below for their chunks, read from ``source`` too (last: a manifest follows its blobs)."""
        items = items + self._manifests_of([k for k, _ in items], source)
        for tier in self.tiers[:source]:
            try:
                tier.store.put_many(items)
            except (StoreFullError, StoreUnavailableError):
                self._count(tier, write_failures=1)
            else:
                self._count(tier, promoted=len(items))

    def _manifests_of(self, keys: list[str], source: int) -> list[tuple[str, Any]]:
        out = []
        for manifest, tier in self._memo.take({self._group_of(k)[0] for k in keys}):
            if tier < source or manifest in keys:
                continue  # already above the tier read (or read itself)
            try:
                out.append((manifest, bytes(self.tiers[source].store.get(manifest))))
            except (KeyError, CorruptEncodedKVError, StoreUnavailableError):
                continue  # the chunk is whole above without it only once a lookup sees it there again
        return out

    def read_ahead(self, reads: Sequence[GroupRead]) -> None:
        """Each tier is told the reads it is to serve (:meth:`BlobStore.read_ahead`): a read goes to the
        fastest tier holding every key of it, asked of the tiers above the last only (a remote store's
        lookup would cost the round trip the hint is there to save); empty ``reads`` reach every tier."""
        per: list[list[GroupRead]] = [[] for _ in self.tiers]
        for r in reads:
            per[self._server_of(list(r.keys))].append(r)
        for tier, mine in zip(self.tiers, per):
            tier.store.read_ahead(mine)

    def _server_of(self, keys: list[str]) -> int:
        """The first tier above the last that holds every key (one that is down holds none), else the last."""
        for j, tier in enumerate(self.tiers[:-1]):
            try:
                if all(tier.store.contains_many(keys)):
                    return j
            except StoreUnavailableError:
                continue
        return len(self.tiers) - 1

    # ------------------------------------------------------------ lookups and the rest

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether some tier holds each key (see :meth:`locate_many`)."""
        return [tier is not None for tier in self.locate_many(keys)]

    def locate_many(self, keys: Sequence[str]) -> list[int | None]:
        """The fastest tier (its index in :attr:`tiers`) holding each key, or None, asking each tier only
        for what the faster ones lack; a tier that is down holds nothing. Manifests found below the top
        tier are remembered for promotion."""
        keys = [validate_key(k) for k in keys]
        found: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        answered = False
        for j, tier in enumerate(self.tiers):
            if not todo:
                break
            try:
                ans = tier.store.contains_many([keys[i] for i in todo])
            except StoreUnavailableError:
                self._count(tier, unavailable=1)
                continue
            answered = True
            for i, ok in zip(todo, ans):
                if ok:
                    found[i] = j
                    if j > 0 and self._is_manifest(keys[i]):
                        self._memo.remember(self._group_of(keys[i])[0], keys[i], j)
            todo = [i for i in todo if found[i] is None]
        if keys and not answered:
            raise StoreUnavailableError(
                "every tier of the store is unavailable", reason=Reason.STORE_UNAVAILABLE
            )
        return found

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every tier (a tier that is down keeps its copy); True if any removed it."""
        validate_key(key)
        return any(self._each(lambda st: st.delete(key), default=False))

    def keys(self) -> list[str]:
        """Every key some reachable tier holds, sorted."""
        found: set[str] = set()
        for ks in self._each(lambda st: st.keys(), default=None, need_one=True):
            found.update(ks or ())
        return sorted(found)

    def iter_keys(self) -> Iterator[str]:
        yield from self.keys()

    def _each(self, call: Callable[[BlobStore], _T], default: _T, need_one: bool = False) -> list[_T]:
        """``call`` on every tier; a tier that is down gives ``default`` (all down and ``need_one``: raise)."""
        out, down = [], 0
        for tier in self.tiers:
            try:
                out.append(call(tier.store))
            except StoreUnavailableError:
                self._count(tier, unavailable=1)
                out.append(default)
                down += 1
        if need_one and down == len(self.tiers):
            raise StoreUnavailableError(
                "every tier of the store is unavailable", reason=Reason.STORE_UNAVAILABLE
            )
        return out

    def stats(self) -> dict[str, float]:
        """The tiers' :data:`~kvcodec.store.STORE_COUNTERS`, added up."""
        total = dict.fromkeys(STORE_COUNTERS, 0.0)
        for tier in self.tiers:
            for name, value in tier.store.stats().items():
                total[name] += value
        return total

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Per tier (by name): its own ``stats()`` and the :data:`TIER_COUNTERS`."""
        with self._lock:
            counts = {name: dict(c) for name, c in self._counts.items()}
        return {t.name: {**t.store.stats(), **counts[t.name]} for t in self.tiers}

    def close(self) -> None:
        """Close every tier (each once, whatever another's close raised)."""
        errors = []
        for tier in self.tiers:
            try:
                tier.store.close()
            except Exception as e:  # every tier is closed; the first failure is raised after
                errors.append(e)
        if errors:
            raise errors[0]

    def _count(self, tier: Tier, **amounts: int) -> None:
        with self._lock:
            counts = self._counts[tier.name]
            for name, n in amounts.items():
                counts[name] += n


def _blob_bytes(parsed: ParsedBlob) -> memoryview:
    return parsed.blob
