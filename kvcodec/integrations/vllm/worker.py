"""The connector's worker side: the registered caches, one load handler and one save handler.

The caches and both handlers are built in ``register_kv_caches``, once the caches exist (as vLLM builds
its offloading worker there); a hook that needs them before that is a ``RuntimeError``. The facade's
worker hooks land here; each hands its part of the step's :class:`~.metadata.StepPlan`
to :class:`~.loads.LoadHandler` or :class:`~.saves.SaveHandler`. What tests and benchmarks replace
(the store, the copy out of the cache, the write into it, the idle wait) comes in through
:class:`ConnectorParts`, never by patching modules.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcodec.errors import Reason, UnsupportedConfigError
from kvcodec.store import BlobStore

from .caches import LayerCaches
from .chunk_keys import ChunkKeys
from .chunk_writes import write_chunk
from .chunks import ChunkCodec, FP8Scales
from .config import KvcodecConfig
from .counters import Counters
from .fused import FusedLayers
from .identity import CacheGeometry, HeadLayout
from .layout import gather_kv
from .loads import IDLE_LOAD_WAIT_S, LoadHandler, WriteChunk
from .metadata import StepPlan
from .saves import Gather, SaveHandler

__all__ = ["SHUTDOWN_DRAIN_S", "ConnectorParts", "KvcodecWorker"]

logger = logging.getLogger("vllm.kvcodec")

SHUTDOWN_DRAIN_S = 10.0
"""How long ``shutdown`` waits for pending writes before abandoning them (``shutdown_timeout_s``)."""


@dataclass(frozen=True)
class ConnectorParts:
    """What the connector uses that a test or benchmark may replace; vLLM builds it with these defaults."""

    store: BlobStore | None = None
    """The store to use instead of opening the configured one."""
    gather: Gather = gather_kv
    """Copies one layer's chunk out of the cache (saves)."""
    write: WriteChunk = write_chunk
    """Writes a checked chunk into every layer's cache (per-layer loads)."""
    idle_load_wait_s: float = IDLE_LOAD_WAIT_S


@dataclass(frozen=True)
class WorkerSetup:
    """What the worker side is built from (the facade derives it from vLLM's configs)."""

    cfg: KvcodecConfig
    geo: CacheGeometry
    layers: dict[str, int]
    heads: HeadLayout
    """How the ranks split a chunk's KV heads, and the identity of each head range's blob."""
    model_dtype: Any
    fp8_layers: Any = None
    """vLLM's static forward context (layer name -> attention layer), for FP8 caches' scales."""
    cache_dtype: str = "auto"
    groups: dict[str, int] = field(default_factory=dict)
    """Layer name -> its KV cache group (vLLM's hybrid allocator); used where a group is sliding-window."""


@dataclass(frozen=True)
class Registered:
    """What the worker has once vLLM registered its caches: the caches and the handlers over them."""

    caches: LayerCaches
    loads: LoadHandler
    saves: SaveHandler


class KvcodecWorker:
    """The worker-side hooks of ``KvcodecConnector``."""

    def __init__(
        self, setup: WorkerSetup, store: BlobStore, keys: ChunkKeys, counters: Counters, parts: ConnectorParts
    ) -> None:
        self.cfg = setup.cfg
        self.setup, self.store, self.keys, self.counters, self.parts = setup, store, keys, counters, parts
        self.registered: Registered | None = None
        """The caches and handlers, from ``register_kv_caches`` on."""
        self.held: set[str] = set()
        """Finished requests whose blocks vLLM holds until ``get_finished`` reports them."""
        self.shutdown_timeout_s = SHUTDOWN_DRAIN_S

    def _registered(self) -> Registered:
        if self.registered is None:
            raise RuntimeError("kvcodec: a worker hook called before register_kv_caches")
        return self.registered

    @property
    def caches(self) -> LayerCaches:
        return self._registered().caches

    @property
    def loads(self) -> LoadHandler:
        return self._registered().loads

    @property
    def saves(self) -> SaveHandler:
        return self._registered().saves

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], rank: int) -> None:
        """Keep this model's layer views, build the fused path when it serves them (logged once), then
        the load and save handlers over them. Called again (vLLM does not), the views are replaced and
        the handlers kept."""
        if self.registered is not None:
            self._register(self.registered.caches, kv_caches, rank)
            return
        setup, cfg, parts = self.setup, self.cfg, self.parts
        windowed = bool(setup.geo.windows)  # vLLM's hybrid allocator: each layer's group, copies in the step
        caches = LayerCaches(
            setup.geo,
            setup.layers,
            cfg.chunk_size,
            world=setup.heads.world,
            groups=dict(setup.groups) if windowed else {},
            windowed=windowed,
        )
        self._register(caches, kv_caches, rank)
        store, keys, counters = self.store, self.keys, self.counters
        loads = LoadHandler(
            cfg,
            caches,
            store,
            keys,
            counters,
            write=parts.write,
            idle_wait_s=parts.idle_load_wait_s,
            heads=setup.heads,
        )
        saves = SaveHandler(cfg, caches, store, keys, counters, gather=parts.gather)
        self.registered = Registered(caches, loads, saves)

    def _register(self, caches: LayerCaches, kv_caches: dict[str, torch.Tensor], rank: int) -> None:
        """Fill ``caches`` with this model's views, its codec and the fused path (logged once)."""
        setup, geo = self.setup, self.setup.geo
        caches.rank = rank
        codec = ChunkCodec(  # one for every layer: a load plans each chunk once for all of them
            head_size=geo.head_size,
            block_size=geo.block_size,
            model_dtype=setup.model_dtype,
            scope=self.cfg.scope,
            page_size=self.cfg.page_size,
            hashes=setup.heads.hashes[setup.heads.own(rank)],
        )
        caches.register(kv_caches, codec)
        if geo.fp8:
            caches.fp8_scales = self._fp8_scales
        mode = "off" if caches.windowed else self.cfg.fused  # fused: one block table for all layers
        fused, why = FusedLayers.build(caches.caches, setup.layers, codec, mode)
        caches.fused = fused
        if fused is not None and fused.device.type == "cuda":
            caches.side_stream = torch.cuda.Stream(fused.device)
        logger.info("kvcodec: %s path (%s)", "fused" if fused is not None else "per-layer", why)

    def _fp8_scales(self, name: str) -> FP8Scales:
        layer = (self.setup.fp8_layers or {}).get(name)
        ks, vs = getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)
        if ks is None or vs is None:
            raise UnsupportedConfigError(
                f"FP8 cache layer {name} has no _k_scale/_v_scale", reason=Reason.MISSING_ARGUMENT
            )
        e5m2 = self.setup.cache_dtype == "fp8_e5m2"
        return FP8Scales(
            torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn, ks.detach().float(), vs.detach().float()
        )

    # ------------------------------------------------------------ hooks

    def start_load_kv(self, meta: StepPlan) -> None:
        t0 = time.perf_counter()
        self.loads.start(meta.loads)
        self.counters.add(
            tokens_hit=meta.tokens_hit,
            tokens_missed=meta.tokens_missed,
            lookup_unavailable=meta.lookups_unavailable,
            loads_deferred=meta.loads_deferred,
            lookup_calls=meta.lookup_calls,
            start_load_kv_seconds=time.perf_counter() - t0,
        )

    def get_finished(self, meta: StepPlan | None) -> tuple[set[str] | None, set[str] | None]:
        """Report loads received (written first unless the loader wrote them) and held requests sent
        once nothing copies out of their blocks."""
        t0 = time.perf_counter()
        if meta is not None:
            self.held.update(meta.held)
            self.counters.add(requests_held=len(meta.held))
        ready = self.loads.take_ready(idle=meta is not None and meta.idle)
        sent = {r for r in self.held if not self.saves.copying(r)}
        self.held -= sent
        self.counters.add(get_finished_seconds=time.perf_counter() - t0)
        return sent or None, {r.spec.req_id for r in ready} or None

    def handle_preemptions(self, meta: StepPlan) -> None:
        if not meta.preempted:
            return
        t0 = time.perf_counter()
        self.saves.handle_preemptions(meta.preempted)
        self.counters.add(
            handle_preemptions_seconds=time.perf_counter() - t0, requests_preempted=len(meta.preempted)
        )

    def wait_for_save(self, meta: StepPlan) -> None:
        t0 = time.perf_counter()
        self.saves.wait_for_save(meta.saves)
        self.counters.add(wait_for_save_seconds=time.perf_counter() - t0)

    def gauges(self) -> dict[str, float]:
        """The save side's queue depth and held bytes (0 before the caches are registered)."""
        if self.registered is None:
            return {"writer_queue_depth": 0, "pending_save_bytes": 0}
        saves = self.registered.saves
        return {"writer_queue_depth": saves.depth, "pending_save_bytes": saves.pending.held}

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for the saves (True: none pending; nothing is before the caches are registered)."""
        return self.registered is None or self.registered.saves.drain(timeout)

    def shutdown(self) -> None:
        """Drain the saves for up to ``shutdown_timeout_s`` and abandon the rest; drop pending loads
        (nothing to do before the caches are registered)."""
        if self.registered is None:
            return
        abandoned = self.saves.shutdown(self.shutdown_timeout_s)
        self.loads.shutdown()
        if abandoned:
            logger.warning("kvcodec: shutdown abandoned %d pending chunk saves", abandoned)
