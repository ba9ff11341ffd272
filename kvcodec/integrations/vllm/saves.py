"""The worker's save handler: chunks out of the paged cache, encoded, into the store.

``wait_for_save`` hands each new chunk over. CPU caches with asynchronous saves leave even the
copy out of the cache to the gatherer thread, so vLLM must keep off the blocks until it is done:
the scheduler holds a finished request's blocks until :meth:`SaveHandler.copying` says none of
its chunks waits, and :meth:`SaveHandler.handle_preemptions` copies a preempted request's chunks
itself. Host memory held by copied, unwritten chunks is bounded (``max_pending_save_bytes``):
the gatherer waits for room (the chunks stay in the held blocks), and only a copy that cannot
wait (a preemption, a GPU cache's copy inside the step) is skipped, counted and logged (rate
limited). Writers encode and store a chunk's blobs with one ``put_many``, then its manifest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvcodec.errors import CodecError, StoreUnavailableError
from kvcodec.store import BlobStore, StoreFullError

from .background import BackgroundPool
from .caches import LayerCaches
from .chunk_keys import ChunkKeys
from .chunks import encode_kv
from .config import KvcodecConfig
from .counters import Counters
from .layout import gather_kv
from .metadata import ChunkEvent, SaveSpec
from .pending import PendingBytes, SkipLog

__all__ = ["SaveHandler"]

logger = logging.getLogger("vllm.kvcodec")

_UNBOUNDED = 1 << 30
"""Queue capacity where the byte bound (or the blocks vLLM holds) is what limits."""

Gather = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class _Gather:
    """A chunk waiting to be copied out of the cache: by the gatherer, or by ``handle_preemptions``."""

    spec: SaveSpec
    claimed: bool = False
    """Taken by whoever copies it (under the handler's lock): it is copied once."""


class SaveHandler:
    """Saves of one worker; ``gather`` copies one layer's chunk out (:func:`~.layout.gather_kv`)."""

    def __init__(
        self,
        cfg: KvcodecConfig,
        caches: LayerCaches,
        store: BlobStore,
        keys: ChunkKeys,
        counters: Counters,
        *,
        gather: Gather = gather_kv,
    ) -> None:
        self.cfg, self.caches, self.store, self.keys, self.counters = cfg, caches, store, keys, counters
        self.gather = gather
        self.pending = PendingBytes(cfg.max_pending_save_bytes)
        self.skips = SkipLog()
        self.full_log = SkipLog(counter="store_full")
        """Chunks a full store refused (Redis ``noeviction``/``volatile-*`` with nothing to evict)."""
        self._lock = threading.Lock()
        self.inflight: set[str] = set()
        """Chunks (key suffixes) queued or being saved: not queued twice."""
        self.gathering: dict[str, list[_Gather]] = {}
        """Per request: chunks not copied out yet (their blocks must stay untouched until they are)."""
        self._gathered = threading.Condition(self._lock)
        self.writer = BackgroundPool("writer", threads=cfg.writer_threads, capacity=_UNBOUNDED)
        self.gatherer = BackgroundPool("gather", threads=1, capacity=_UNBOUNDED)
        """Copies chunks out of CPU caches off the step, each once its bytes fit the bound."""
        self._host_bufs: list[torch.Tensor] = []
        self._stored: list[ChunkEvent] = []
        """KV events of chunks made loadable since the last :meth:`take_stored`."""

    @property
    def depth(self) -> int:
        """Chunks waiting for a copy or a write."""
        return self.writer.depth + self.gatherer.depth

    @property
    def deferred(self) -> bool:
        """Asynchronous saves from CPU caches: the copy out of the cache leaves the step too."""
        return self.cfg.async_save and self.caches.on_cpu and not self.caches.windowed

    def copying(self, req_id: str) -> bool:
        """Whether any chunk of ``req_id`` still waits to be copied out of its blocks."""
        with self._lock:
            return bool(self.gathering.get(req_id))

    # ------------------------------------------------------------ the step's hooks

    def wait_for_save(self, saves: Iterable[SaveSpec]) -> None:
        """Hand each new chunk over (or, synchronous, save it here)."""
        for spec in saves:
            if self._already(spec):
                continue
            if self.deferred:
                self._queue_gather(spec)
            elif not self.cfg.async_save:
                self._save_inline(spec)
            else:
                self._gather_in_step(spec)
        self.counters.gauge("writer_queue_depth", self.depth)
        self.counters.gauge("pending_save_bytes", self.pending.held)

    def _already(self, spec: SaveSpec) -> bool:
        """Queued or being saved already (whether another engine stored it meanwhile is asked off the
        step, by the writer: on a remote store that is a round trip)."""
        with self._lock:
            return spec.ref.suffix in self.inflight

    def _save_inline(self, spec: SaveSpec) -> None:
        try:
            job = self._save_job(spec)
        except Exception as e:  # a save is optional: count and log it, the step goes on
            self._save_failed(spec, e)
            return
        job()

    def _gather_in_step(self, spec: SaveSpec) -> None:
        """Copy (or launch the fused copy) here, within the byte bound, and queue the write."""
        n = self._chunk_bytes(spec)
        if not self.pending.try_take(n):
            self._skip("pending-save memory full (max_pending_save_bytes)")
            return
        try:
            job = self._save_job(spec)
        except Exception as e:
            self.pending.give(n)
            self._save_failed(spec, e)
            return
        with self._lock:
            self.inflight.add(spec.ref.suffix)
        self._submit_write(spec, job, n)

    def _skip(self, why: str) -> None:
        self.counters.add(saves_skipped=1)
        self.skips.skipped(why)

    def handle_preemptions(self, preempted: Iterable[str]) -> None:
        """Before the forward may overwrite a preempted request's freed blocks, copy its chunks still
        waiting for the gatherer out of them here (memory copies only, within the byte bound: one
        that does not fit is skipped) and wait for any the gatherer is copying now."""
        for rid in preempted:
            with self._lock:
                mine = [g for g in self.gathering.get(rid, ()) if not g.claimed]
                for g in mine:
                    g.claimed = True
            for g in mine:  # copied here and now rather than after the gatherer's queue
                n = self._chunk_bytes(g.spec)
                if self.pending.try_take(n):
                    self._gather_then_queue(g, n)
                else:
                    self._gather_done(g, drop=True)
                    self._skip("pending-save memory full when a preempted request's blocks were freed")
            with self._gathered:  # and those the gatherer is copying right now (memory copies)
                self._gathered.wait_for(lambda rid=rid: not self.gathering.get(rid))

    # ------------------------------------------------------------ the gatherer

    def _queue_gather(self, spec: SaveSpec) -> None:
        """Queue the copy out of the cache; the request's blocks stay held until it has run."""
        g = _Gather(spec)
        with self._lock:
            self.inflight.add(spec.ref.suffix)
            self.gathering.setdefault(spec.req_id, []).append(g)
        if not self.gatherer.submit(lambda: self._claim_and_gather(g)):  # shut down
            self._gather_done(g, drop=True)

    def _claim_and_gather(self, g: _Gather) -> None:
        """The gatherer's job: wait for room (nothing claimed meanwhile, so a preemption never waits
        for the disk), then copy the chunk unless ``handle_preemptions`` took it first."""
        n = self._chunk_bytes(g.spec)
        took = self.pending.take(n, on_wait=lambda: self.counters.add(saves_waited=1))
        if took is None:  # shutting down
            self._gather_done(g, drop=True)
            return
        with self._lock:
            mine = not g.claimed
            g.claimed = True
        if not mine:
            self.pending.give(n)
            return
        self._gather_then_queue(g, n)

    def _gather_then_queue(self, g: _Gather, n: int) -> None:
        """Copy a claimed chunk out (``n`` bytes taken), release its blocks, queue the write."""
        try:
            job = self._save_job(g.spec)
        except Exception as e:  # a save is optional: count and log it
            self.pending.give(n)
            self._gather_done(g, drop=True)
            self._save_failed(g.spec, e)
            return
        self._gather_done(g)
        self._submit_write(g.spec, job, n)

    def _gather_done(self, g: _Gather, *, drop: bool = False) -> None:
        with self._gathered:
            pending = self.gathering.get(g.spec.req_id, [])
            if g in pending:
                pending.remove(g)
            if not pending:
                self.gathering.pop(g.spec.req_id, None)
            if drop:
                self.inflight.discard(g.spec.ref.suffix)
            self._gathered.notify_all()

    def _submit_write(self, spec: SaveSpec, job: Callable[[], None], n: int) -> None:
        def run() -> None:
            try:
                job()
            finally:
                self.pending.give(n)

        if not self.writer.submit(run):  # shut down: the copy is abandoned
            self.pending.give(n)
            with self._lock:
                self.inflight.discard(spec.ref.suffix)

    # ------------------------------------------------------------ copy, encode, write

    def _chunk_bytes(self, spec: SaveSpec) -> int:
        """What a chunk's copy holds until written: its K and V at the cache's width (the fused
        path's encoded buffer is smaller, so this bounds both)."""
        return self.caches.chunk_bytes()

    def _save_job(self, spec: SaveSpec) -> Callable[[], None]:
        """Do what must happen before vLLM may reuse the blocks; return the rest (encode, write)."""
        cs, caches = self.cfg.chunk_size, self.caches
        fused = caches.fused
        if fused is not None and fused.serves(spec.chunk * cs):
            buf = self._host_bufs.pop() if self._host_bufs else fused.host_buffer(cs)
            pending = self._launch_fused(fused, spec, buf)

            def blobs() -> Iterable[tuple[str, Any]]:
                return zip(fused.names, pending.wait())

            return lambda: self._write_chunk(spec, blobs, fused=True, release=buf)
        gathered = {}
        for name, cache in caches.caches.items():
            cc = caches.codec(name)
            k, v = self.gather(
                cache,
                spec.blocks(caches.groups.get(name, 0)),
                head_size=cc.head_size,
                block_size=cc.block_size,
                start=spec.chunk * cs,
                num_tokens=cs,
            )
            gathered[name] = (k, v, cc)

        def encoded() -> Iterator[tuple[str, Any]]:
            for name, (k, v, cc) in gathered.items():
                lid = caches.layers[name]
                yield name, encode_kv(k, v, cc, layer_id=lid, chunk_id=spec.chunk, chunk_hash=spec.chunk_hash)

        return lambda: self._write_chunk(spec, encoded, fused=False)

    def _launch_fused(self, fused: Any, spec: SaveSpec, buf: torch.Tensor) -> Any:
        """One gather+encode launch; on CUDA on the side stream, ordered after this step's forward, and
        the next forward after it (the blocks may be reused then), never waiting on the host."""
        cs, side = self.cfg.chunk_size, self.caches.side_stream
        if side is None:
            return fused.launch(spec.block_ids, spec.chunk, cs, spec.chunk_hash, out=buf)
        side.wait_stream(torch.cuda.current_stream(side.device))
        pending = fused.launch(spec.block_ids, spec.chunk, cs, spec.chunk_hash, out=buf, stream=side)
        torch.cuda.current_stream(side.device).wait_stream(side)
        return pending

    def _write_chunk(
        self,
        spec: SaveSpec,
        blobs: Callable[[], Iterable[tuple[str, Any]]],
        *,
        fused: bool,
        release: torch.Tensor | None = None,
    ) -> None:
        """Store every layer's blob of a chunk (one ``put_many``), then its manifest; count and log
        what fails (a full store: the rate-limited skip WARNING; an unreachable store: counted only,
        the store logs each outage once)."""
        t0 = time.perf_counter()
        ref, rank, layers = spec.ref, self.caches.rank, self.caches.layers
        todo: list[tuple[str, Any]] = []
        try:
            items = [
                (self.keys.blob(rank, layers[name], ref), blob) for name, blob in blobs()
            ]  # (fused: waits)
            present = self.store.contains_many([self.keys.manifest(ref)] + [k for k, _ in items])
            if present[0]:
                return  # stored meanwhile (by this engine or another one)
            present = present[1:]
            todo = [item for item, there in zip(items, present) if not there]
            self.store.put_many(todo)
            self.counters.add(blobs_saved=len(todo), bytes_written=sum(len(b) for _, b in todo))
            self._mark_saved(spec)
            self.counters.add(chunks_saved=1, chunks_saved_fused=int(fused))
        except StoreFullError as e:
            self._give_back(todo)  # a chunk without all its layers can never be hit: give the room back
            self.counters.add(store_full=1)
            logger.debug("kvcodec: request %s chunk %d not saved: %s", spec.req_id, spec.chunk, e)
            self.full_log.skipped(f"the store is full ({e})")
        except StoreUnavailableError:
            self.counters.add(save_unavailable=1)
        except Exception as e:  # any failure: counted and logged here, never left to the pool
            self._save_failed(spec, e)
        finally:
            if release is not None:
                self._host_bufs.append(release)
            with self._lock:
                self.inflight.discard(ref.suffix)
            self.counters.add(save_seconds=time.perf_counter() - t0)

    def _give_back(self, items: list[tuple[str, Any]]) -> None:
        for key, _ in items:
            try:
                self.store.delete(key)
            except CodecError:  # unreachable now: the orphan blobs are never hit and age out
                break

    def _mark_saved(self, spec: SaveSpec) -> None:
        """The chunk's manifest, once this rank's blobs (and, with TP, every rank's marker) are written."""
        ref, caches = spec.ref, self.caches
        blob = caches.manifest_blob(spec.chunk, spec.chunk_hash)
        if caches.world > 1:
            self.store.put(self.keys.rank_marker(caches.rank, ref), blob)
            markers = [self.keys.rank_marker(r, ref) for r in range(caches.world)]
            if not all(self.store.contains_many(markers)):
                return
        self.store.put(self.keys.manifest(ref), blob)
        if spec.event is not None:  # the rank that writes the manifest reports it, once
            with self._lock:
                self._stored.append(spec.event)

    def take_stored(self) -> list[ChunkEvent]:
        """The KV events of chunks made loadable since the last call."""
        with self._lock:
            out, self._stored = self._stored, []
        return out

    def _save_failed(self, spec: SaveSpec, e: Exception) -> None:
        """Count and log one chunk not saved (a traceback for what is neither a codec nor an I/O error)."""
        self.counters.add(save_errors=1)
        logger.warning(
            "kvcodec: request %s chunk %d not saved (%s: %s)",
            spec.req_id,
            spec.chunk,
            type(e).__name__,
            e,
            exc_info=not isinstance(e, (CodecError, OSError)),
        )

    # ------------------------------------------------------------ lifecycle

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no chunk is being copied out or written (True) or ``timeout`` s pass (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        if not self.gatherer.wait_idle(timeout):
            return False
        return self.writer.wait_idle(None if end is None else max(0.0, end - time.monotonic()))

    def shutdown(self, timeout: float) -> int:
        """Drain for up to ``timeout`` s; the number of chunk saves abandoned."""
        end = time.monotonic() + timeout
        abandoned = self.gatherer.shutdown(timeout)
        self.pending.close()
        abandoned += self.writer.shutdown(max(0.0, end - time.monotonic()))
        return abandoned
