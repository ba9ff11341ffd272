"""The worker's load handler: chunks from the store, checked, into the request's blocks.

A load is read and checked off the step (the loader thread; synchronous loads in
``start_load_kv``): each blob is read and parsed once, CRC-checked once (the store's
``get_parsed``; one ``get_parsed_many`` per chunk where a chunk's blobs may vanish one by one),
then checked against its key (identity, prefix hash, ids, geometry): by
:meth:`~.fused.FusedLayers.prepare` for the one-launch path, else by :func:`~.chunks.read_chunk`,
the one per-layer path. CPU caches: the loader writes the chunks too (vLLM leaves a loading
request's blocks alone until it is reported), and with ``defer_crc`` (on: :data:`DEFER_CRC`) the CRC
is left out of the read (``verify_crc=False``) and checked in the C pass that writes each blob
(:func:`~.chunk_writes.write_chunk`; a mismatch found there fails the chunk after writing it, as any failure
does, and removes its keys); CUDA caches: ``get_finished`` writes them on the step.
A chunk that fails is reported through ``get_block_ids_with_load_errors`` (vLLM recomputes it
with ``kv_load_failure_policy="recompute"``) and its manifest removed, so a lookup does not
find it again; a damaged or misfiled blob removes the chunk's every key.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcodec.backends import cache_lanes_available
from kvcodec.errors import CodecError, CodecMismatchError, CorruptEncodedKVError, StoreUnavailableError
from kvcodec.format.header import MAX_SCALE_DIMS, SCALE_DIM
from kvcodec.store import BlobStore, GroupRead

from .background import BackgroundPool
from .buffers import ReadBuffers
from .caches import LayerCaches
from .chunk_keys import ChunkKeys, HeadSplit
from .chunk_writes import write_chunk
from .chunks import PreparedChunk, read_chunk
from .config import KvcodecConfig
from .counters import Counters
from .fused import FusedChunk
from .head_ranges import HeadRead, read_head_ranges
from .identity import HeadLayout
from .metadata import LoadSpec

__all__ = ["DEFER_CRC", "IDLE_LOAD_WAIT_S", "LoadHandler", "LoadResult", "PreparedLoad"]

logger = logging.getLogger("vllm.kvcodec")

IDLE_LOAD_WAIT_S = 0.005
"""In a step that computes nothing while loads are pending, ``get_finished`` waits up to this long for
one: vLLM would otherwise run another empty step at once, about a thousand of them per second of load,
each taking the GIL and a core from the loader. (A request that arrives meanwhile waits as long.)"""

DEFER_CRC = True
"""Whether CPU loads check each blob's CRC in the C pass that writes it rather than in the read (where
C is built), so that each blob's payload is read from memory once. On: measured with
``bench/connector_load.py`` (2048 tokens, 96 blobs), with the C CRC folded on 512-bit registers the
deferred load is 3-8% less CPU than checking in the read (the read saves the CRC pass, the write adds
less). A blob found damaged while written fails its chunk: vLLM recomputes the blocks written."""

WriteChunk = Callable[..., None]


@dataclass
class PreparedLoad:
    """A chunk read and checked off the step, ready to write into the paged cache."""

    chunk: int
    skip: int
    tokens: int
    kv: PreparedChunk | FusedChunk
    """Checked for the per-layer path (:func:`~.chunks.read_chunk`) or the fused one."""
    buffers: list[bytearray] = field(default_factory=list)
    """What the blobs view: back to the read buffers once written."""
    keys: list[str] = field(default_factory=list)
    """The chunk's keys when read from another head split (removed if a write finds one damaged)."""


@dataclass
class LoadResult:
    spec: LoadSpec
    chunks: list[PreparedLoad]
    failed_at: int | None = None
    """First request token of the chunk that failed (its blocks on are recomputed)."""
    written: bool = False
    """Already written into the cache (and its failures recorded) by the loader."""


class LoadHandler:
    """Loads of one worker; ``write`` writes a checked chunk into the caches (:func:`~.chunk_writes.write_chunk`)."""

    def __init__(
        self,
        cfg: KvcodecConfig,
        caches: LayerCaches,
        store: BlobStore,
        keys: ChunkKeys,
        counters: Counters,
        *,
        write: WriteChunk = write_chunk,
        idle_wait_s: float = IDLE_LOAD_WAIT_S,
        heads: HeadLayout | None = None,
    ) -> None:
        self.cfg, self.caches, self.store, self.keys, self.counters = cfg, caches, store, keys, counters
        self.write = write
        self.idle_wait_s = idle_wait_s
        self.buffers = ReadBuffers()
        self.loader = BackgroundPool("loader", threads=1, capacity=cfg.max_concurrent_loads, nice=0)
        """On its hit's TTFT, so at the engine's priority; at most as many jobs as loads in flight."""
        self._lock = threading.Lock()
        self._loaded = threading.Condition(self._lock)
        self._ready: list[LoadResult] = []
        self._errors: set[int] = set()
        self.prepare: Callable[[LoadSpec], LoadResult] = self.read_and_check
        """What reads and checks a load (replaceable: tests gate or break it)."""
        self.heads = heads
        """How chunks are split into head ranges (None: one rank, whole-head blobs only)."""
        self.defer_crc = DEFER_CRC and self.can_defer_crc
        """Whether CPU loads read blobs unchecked and check their CRC while writing them (settable,
        where :attr:`can_defer_crc`)."""

    @property
    def can_defer_crc(self) -> bool:
        """Whether the CRC can be left to the write: C built (every :class:`~kvcodec.store.BlobStore`
        takes ``verify_crc``)."""
        return cache_lanes_available()

    # ------------------------------------------------------------ the step's hooks

    def start(self, loads: Iterable[LoadSpec]) -> None:
        """Queue background loads; read, check and write synchronous ones here."""
        for spec in loads:
            if not spec.background:
                self._apply(self.prepare(spec))
            elif not self.loader.submit(lambda spec=spec: self._background(spec)):
                logger.warning("kvcodec: request %s not loaded (loader full or shut down)", spec.req_id)
                self._finish(LoadResult(spec, [], failed_at=spec.start))

    def take_ready(self, idle: bool) -> list[LoadResult]:
        """Loads read since the last call, written into the cache here unless the loader did (in a
        step that computes nothing, wait up to ``idle_wait_s`` for one first)."""
        with self._lock:
            if idle and not self._ready and self.loader.depth:
                w0 = time.perf_counter()
                self._loaded.wait(self.idle_wait_s)
                self.counters.add(idle_load_wait_seconds=time.perf_counter() - w0)
            ready, self._ready = self._ready, []
        for result in ready:
            if not result.written:
                self._apply(result)
        return ready

    def take_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    # ------------------------------------------------------------ read and check

    def _background(self, spec: LoadSpec) -> None:
        """The loader's job: whatever happens, the request reaches ``get_finished`` (failed: recomputed)."""
        try:
            result = self.prepare(spec)
        except Exception:  # a bug or resource failure outside one chunk's read: recompute it all
            logger.exception(
                "kvcodec: request %s not loaded; recomputed from token %d", spec.req_id, spec.start
            )
            result = LoadResult(spec, [], failed_at=spec.start)
        if self.caches.on_cpu:
            self._apply_or_fail(result)
        self._finish(result)
        self.counters.add(requests_loaded_async=1)

    def _finish(self, result: LoadResult) -> None:
        with self._lock:
            self._ready.append(result)
            self._loaded.notify_all()

    def _apply_or_fail(self, result: LoadResult) -> None:
        """The loader writes a CPU cache's chunks itself. A failure here fails the whole request
        (recomputed), never leaves it unreported."""
        try:
            self._apply(result)
        except Exception:  # pragma: no cover - _apply reports a chunk's failures itself
            logger.exception("kvcodec: request %s not written; recomputed", result.spec.req_id)
            self._fail_blocks(result.spec, result.spec.start)
        result.written = True

    def read_and_check(self, spec: LoadSpec) -> LoadResult:
        """Read and check every chunk of a load, stopping at the first that fails. Into CPU caches each
        chunk is written as soon as it is checked (:attr:`LoadResult.written`: failures reported too),
        so a remote store sends the next chunk while this one is written and its buffers go back at
        once; else nothing is written here."""
        result = LoadResult(spec, [])
        t0 = time.perf_counter()
        reads = self._own_split_reads(spec)
        ahead = len(reads) >= 2  # one read has nothing to overlap
        if ahead:
            self.store.read_ahead(list(reads.values()))
        bounds = {c: r.max_bytes for c, r in reads.items()}
        try:
            self._read_chunks(spec, result, self.caches.on_cpu, bounds)
        finally:
            if ahead:  # a chunk that failed leaves reads unread: dropped
                self.store.read_ahead([])
        self.counters.add(load_seconds=time.perf_counter() - t0)
        return result

    def _own_split_reads(self, spec: LoadSpec) -> dict[int, GroupRead]:
        """Per chunk, the read :meth:`_prepare_chunk` will make (its blobs in this engine's head split
        and their bound), up to the first chunk stored in another split: what the store is told
        ahead (:meth:`~kvcodec.store.BlobStore.read_ahead`), so a remote store's server prepares chunk
        ``c + 1`` while ``c`` is checked. Empty where reads go key by key (``get_parsed``)."""
        if not self.store.partial_groups:
            return {}
        cs, parts = self.cfg.chunk_size, self.keys.split.parts
        reads: dict[int, GroupRead] = {}
        for c in range(spec.start // cs, -(-spec.end // cs)):
            if spec.split(c, parts) != parts:
                break
            keys = tuple(self._blob_keys(spec, c).values())
            reads[c] = GroupRead(keys, self._max_blob_bytes(c, spec.ref(c).chunk_hash))
        return reads

    def _read_chunks(
        self, spec: LoadSpec, result: LoadResult, write: bool, bounds: Mapping[int, int | None]
    ) -> None:
        """:meth:`_prepare_chunk` of each chunk of ``spec`` into ``result``, stopping at the first failure;
        ``write``: each written once checked (:meth:`_apply`) and the load's failure reported here;
        ``bounds``: chunks' ``max_bytes`` already worked out."""
        try:
            self._each_chunk(spec, result, write, bounds)
        finally:
            if write:
                result.written = True
                if result.failed_at is not None:
                    self._fail_blocks(spec, result.failed_at)

    def _each_chunk(
        self, spec: LoadSpec, result: LoadResult, write: bool, bounds: Mapping[int, int | None]
    ) -> None:
        """The loop of :meth:`_read_chunks`: a read that fails sets ``result.failed_at``; a write that
        fails was reported by :meth:`_apply` and only ends the loop."""
        cs = self.cfg.chunk_size
        for c in range(spec.start // cs, -(-spec.end // cs)):
            first = max(spec.start, c * cs)
            try:
                prepared = self._prepare_chunk(spec, c, first - c * cs, bounds)
            except StoreUnavailableError:
                result.failed_at = first
                self.counters.add(load_unavailable=1)
                break
            except Exception as e:  # any failure (not only a bad blob) means: recompute from here
                result.failed_at = first
                self._forget(spec, c)
                logger.warning(
                    "kvcodec: request %s chunk %d not loaded (%s: %s); recomputed from token %d",
                    spec.req_id,
                    c,
                    type(e).__name__,
                    e,
                    first,
                    exc_info=not isinstance(e, (CodecError, KeyError, OSError)),
                )
                break
            if not write:
                result.chunks.append(prepared)
                continue
            written = LoadResult(spec, [prepared])
            self._apply(written)  # a write that fails is reported there: nothing more to do
            if written.failed_at is not None:
                break

    def _prepare_chunk(
        self, spec: LoadSpec, c: int, skip: int, bounds: Mapping[int, int | None]
    ) -> PreparedLoad:
        """Every layer's blob of chunk ``c``, read once and checked against its key."""
        parts = spec.split(c, self.keys.split.parts)
        if parts != self.keys.split.parts:
            return self._prepare_other_split(spec, c, skip, HeadSplit(self.keys.split.heads, parts))
        ref, caches, cs = spec.ref(c), self.caches, self.cfg.chunk_size
        keys = self._blob_keys(spec, c)
        defer = self.defer_crc and caches.on_cpu and caches.fused is None
        buffers: list[bytearray] = []
        try:
            with self._deleting_bad([*keys.values(), self.keys.manifest(ref)]):
                bound = bounds[c] if c in bounds else self._max_blob_bytes(c, ref.chunk_hash)
                parsed = self._read(keys, buffers, defer, bound)
                fused = caches.fused
                if fused is not None and fused.serves(c * cs, skip):
                    fc = fused.prepare(parsed, c, cs, skip, ref.chunk_hash)
                    if fc is not None:
                        return PreparedLoad(c, skip, cs - skip, fc, buffers)
                codecs = {n: caches.codec(n) for n in parsed}
                chunk = read_chunk(
                    parsed,
                    caches.caches,
                    codecs,
                    caches.layers,
                    chunk_id=c,
                    num_tokens=cs,
                    chunk_hash=ref.chunk_hash,
                    crc_checked=not defer,
                )
        except BaseException:
            self.buffers.give(buffers)
            raise
        return PreparedLoad(c, skip, cs - skip, chunk, buffers)

    def _prepare_other_split(self, spec: LoadSpec, c: int, skip: int, split: HeadSplit) -> PreparedLoad:
        """Chunk ``c`` written at another TP size: the blobs overlapping this rank's heads, each
        checked, decoded and cut to them (:mod:`.head_ranges`)."""
        ref, caches, cs, heads = spec.ref(c), self.caches, self.cfg.chunk_size, self.heads
        if heads is None:
            raise KeyError(f"chunk {c} is split in {split.parts} head ranges; this engine reads none")
        own = heads.own(caches.rank)
        want = {
            (n, split.range(p)): self.keys.part_blob(caches.layers[n], ref, split, p)
            for n in caches.caches
            for p in split.overlapping(*own)
        }
        keys = [*want.values(), self.keys.manifest(ref, split.parts)]
        buffers: list[bytearray] = []
        try:
            with self._deleting_bad(keys):
                parsed = self._read(want, buffers)  # type: ignore[arg-type]  # keyed by (layer, range)
                blobs: dict[str, dict[tuple[int, int], Any]] = {}
                for (name, rng), p in parsed.items():
                    blobs.setdefault(name, {})[rng] = p
                read = HeadRead(own, heads.hashes.__getitem__, c, cs, ref.chunk_hash)
                codecs = {n: caches.codec(n) for n in blobs}
                chunk, unused = read_head_ranges(blobs, caches.caches, codecs, caches.layers, read)
        except BaseException:
            self.buffers.give(buffers)
            raise
        self.counters.add(chunks_loaded_other_split=1, bytes_read_other_heads=unused)
        return PreparedLoad(c, skip, cs - skip, chunk, buffers, keys)

    def _blob_keys(self, spec: LoadSpec, c: int) -> dict[str, str]:
        caches, ref = self.caches, spec.ref(c)
        return {n: self.keys.blob(caches.rank, caches.layers[n], ref) for n in caches.caches}

    def _read(
        self,
        keys: dict[str, str],
        buffers: list[bytearray],
        defer: bool = False,
        max_bytes: int | None = None,
    ) -> dict[str, Any]:
        """Each blob read and parsed once, CRC checked (``defer``: left to the write): one
        ``get_parsed_many`` where one blob of a chunk may vanish alone (all or nothing), else
        ``get_parsed`` into reused buffers; no more than ``max_bytes`` of a value is read."""
        kw: dict[str, Any] = {"verify_crc": False} if defer else {}
        if max_bytes is not None:
            kw["max_bytes"] = max_bytes
        if self.store.partial_groups:
            got = self.store.get_parsed_many(list(keys.values()), buffers=self.buffers, **kw)
            parsed = dict(zip(keys, got))
            lent = {id(o): o for p in got if self.buffers.owns(o := p.buffer.obj)}
            buffers.extend(lent.values())  # given back once the chunk is written
        else:
            parsed = {name: self._read_into(key, buffers, kw) for name, key in keys.items()}
        self.counters.add(bytes_read=sum(len(p.blob) for p in parsed.values()))
        return parsed

    def _max_blob_bytes(self, c: int, chunk_hash: str) -> int | None:
        """The most one layer's blob of chunk ``c`` may hold (every :class:`~kvcodec.store.BlobStore`'s
        reads take ``max_bytes``): no more of a value is read, so a planted oversized value costs no more than a blob (issue 34). The
        chunk manifest's header with the most scale dims (+1 KiB), K and V of every KV head of the
        model at 2 bytes an element (or the cache's), a float32 scale a token and head."""
        caches = self.caches
        if not caches.caches:
            return None
        cache = next(iter(caches.caches.values()))  # every layer's view has the geometry's shape
        header = len(caches.manifest_blob(c, chunk_hash)) + MAX_SCALE_DIMS * SCALE_DIM.size + 1024
        heads = cache.shape[1] * max(1, caches.world)  # a rank may read blobs of every head
        return header + self.cfg.chunk_size * heads * (cache.shape[3] * max(cache.element_size(), 2) + 4)

    def _read_into(self, key: str, buffers: list[bytearray], kw: dict[str, Any]) -> Any:
        spare = self.buffers.take()
        try:
            parsed = self.store.get_parsed(key, into=spare, **kw)
        except BaseException:
            if spare is not None:
                buffers.append(spare)
            raise
        owner = parsed.buffer.obj
        if isinstance(owner, bytearray):
            buffers.append(owner)  # the spare, or a new one when the spare was too small (dropped)
        return parsed

    def _forget(self, spec: LoadSpec, c: int) -> None:
        """Delete a chunk's manifest after its load failed: vLLM looks the request up again before it
        recomputes, and a chunk still marked present would be loaded (and fail) again, forever. The
        recomputed chunk is saved again (its blobs that are still there are not rewritten)."""
        try:
            self.store.delete(self.keys.manifest(spec.ref(c), spec.split(c, self.keys.split.parts)))
        except Exception as e:  # nothing more to do: the failure is already reported
            logger.warning("kvcodec: request %s chunk %d: manifest not removed (%s)", spec.req_id, c, e)

    @contextlib.contextmanager
    def _deleting_bad(self, keys: Sequence[str]) -> Iterator[None]:
        """Delete every key of the chunk when one blob is damaged, another model's or misfiled."""
        try:
            yield
        except (CorruptEncodedKVError, CodecMismatchError):
            for key in keys:
                with contextlib.suppress(StoreUnavailableError):
                    self.store.delete(key)
            raise

    # ------------------------------------------------------------ write

    def _apply(self, result: LoadResult) -> None:
        """Write the prepared chunks into the request's blocks; report the rest as load errors
        (``result.failed_at``: the first token that failed). Nothing to do for a result written
        while it was read."""
        if result.written:
            return
        failed_at = result.failed_at
        try:
            failed_at = self._write_all(result, failed_at)
        finally:  # every chunk written or skipped: nothing views the buffers any more
            self.buffers.give([b for p in result.chunks for b in p.buffers])
        result.failed_at = failed_at
        if failed_at is not None:
            self._fail_blocks(result.spec, failed_at)

    def _fail_blocks(self, spec: LoadSpec, failed_at: int) -> None:
        """Report the load's blocks from token ``failed_at`` on (vLLM recomputes them)."""
        bs, groups = self.caches.geo.block_size, spec.group_blocks or [spec.block_ids]
        failed = {g[b] for g in groups for b in range(failed_at // bs, min(len(g), -(-spec.end // bs)))}
        if spec.group_blocks:
            failed.discard(NULL_BLOCK)  # a sliding window's blocks outside it: nothing was loaded there
        with self._lock:  # the loader may add while the step takes them
            self._errors |= failed
        self.counters.add(chunks_failed=1)

    def _write_all(self, result: LoadResult, failed_at: int | None) -> int | None:
        """Write the prepared chunks in order, stopping at the first that fails; the first failing token."""
        spec, cs = result.spec, self.cfg.chunk_size
        for p in result.chunks:
            try:
                self._write_one(spec, p)
            except Exception as e:  # the blocks from here on are reported, so vLLM recomputes them
                failed_at = p.chunk * cs + p.skip
                self._forget(spec, p.chunk)
                logger.warning(
                    "kvcodec: request %s chunk %d not written (%s: %s)",
                    spec.req_id,
                    p.chunk,
                    type(e).__name__,
                    e,
                    exc_info=not isinstance(e, (CodecError, OSError)),
                )
                break
            self.counters.add(chunks_loaded=1, tokens_loaded=p.tokens)
        return failed_at

    def _write_one(self, spec: LoadSpec, p: PreparedLoad) -> None:
        if isinstance(p.kv, FusedChunk):
            self.caches.fused.load(p.kv, spec.block_ids)  # type: ignore[union-attr]  # set when prepared
            self.counters.add(chunks_loaded_fused=1)
            return
        keys = p.keys or [*self._blob_keys(spec, p.chunk).values(), self.keys.manifest(spec.ref(p.chunk))]
        cs, kv = self.cfg.chunk_size, p.kv
        with self._deleting_bad(keys):  # a CRC checked while writing: a damaged blob goes too
            if not spec.group_blocks:
                self.write(kv, self.caches.caches, spec.block_ids, start=p.chunk * cs, skip=p.skip)
                return
            for group, names in self.caches.by_group():
                blocks = spec.blocks(group)
                skip = _live_from(blocks, p.chunk, cs, self.caches.geo.block_size, p.skip)
                if skip is None:
                    continue  # the whole chunk is outside this sliding window: vLLM reads none of it
                sub = PreparedChunk(kv.chunk_id, kv.num_tokens, {n: kv.layers[n] for n in names})
                self.write(sub, self.caches.caches, blocks, start=p.chunk * cs, skip=skip)

    def shutdown(self) -> None:
        """Drop pending loads."""
        self.loader.shutdown(0)


NULL_BLOCK = 0
"""vLLM's null block: what a sliding-window group's block table holds outside the window."""


def _live_from(blocks: Sequence[int], chunk: int, cs: int, bs: int, skip: int) -> int | None:
    """The first token of chunk ``chunk`` (at least ``skip``) in a block that is not the null block;
    None when every block of the chunk is (outside a sliding window)."""
    first = chunk * cs
    for b in range((first + skip) // bs, min(len(blocks), -(-(first + cs) // bs))):
        if blocks[b] != NULL_BLOCK:
            return max(skip, b * bs - first)
    return None
