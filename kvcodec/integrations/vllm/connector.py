"""``KvcodecConnector``: vLLM KV connector that keeps prompt chunks as kvcodec blobs.

Every full ``chunk_size``-token chunk of a prompt is saved, per layer, as one blob in a store
(a local directory, ``root``, by default; or any :func:`~kvcodec.store.open_store` URL,
``store``, e.g. Redis), keyed by the model identity (:func:`~.identity.identity`), the layer and
the chunk's prefix hash (all token ids up to the chunk's end), and bound to that key: each blob's
header carries its layer and chunk ids and the prefix hash (in ``kv_layout``), all checked on load,
so a blob copied under another key is refused. After every layer's (and every TP rank's) blob of a
chunk is written, one manifest marks the chunk present. A later request, in this engine or another
one, loads the longest run of leading present chunks, and vLLM computes only the rest.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KvcodecConnector",
      "kv_connector_module_path": "kvcodec.integrations.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"root": "/path/to/store", "chunk_size": 256}}'

Model families (docs/vllm.md): dense K/V attention at any TP size (a blob per layer, chunk and
KV-head range, so every TP size reads every other's: :mod:`.head_ranges`); MLA latent caches
(LATENT blobs, bit for bit: :mod:`.latent`); several KV cache groups of one geometry, full and
sliding-window, under vLLM's hybrid allocator (``SupportsHMA``). vLLM 0.32's hooks:
``requires_kv_delivery`` False, hits counted as ``DISK`` for a directory store, ``reset_cache`` starts
a new cache generation (:mod:`.generation`), stored chunks published as ``BlockStored`` KV events
(:mod:`.events`).

The connector is split as vLLM's OffloadingConnector is: this module is the facade whose hooks
delegate; :mod:`.scheduler` is the scheduler side (no torch, the store only through
``contains_many``); :mod:`.worker` the worker side with one load handler (:mod:`.loads`) and one
save handler (:mod:`.saves`); :mod:`.metadata`, :mod:`.config`, :mod:`.identity`, :mod:`.keys` and
:mod:`.chunk_keys` (the only place key strings are written or parsed) hold the rest.

What the engine step waits for (defaults ``async_save`` and ``async_load``):

* saves: ``wait_for_save`` only hands each new chunk over. CPU caches: even the copy out of the
  paged cache runs off the step, on the gatherer thread, so a finished request that had chunks to
  save keeps its blocks (``request_finished`` returns True) until ``get_finished`` reports it sent,
  and ``handle_preemptions`` copies a preempted request's pending chunks out itself. Copied,
  unwritten chunks hold at most ``max_pending_save_bytes`` of host memory: at the bound the
  gatherer waits (the chunks stay in the held blocks); only a copy that cannot wait is skipped,
  counted (``saves_skipped``) and logged (one WARNING per 10 s with the count). CUDA with the
  fused path: one gather+encode launch on a side stream into pinned memory. Encoding and the store
  writes run on the writer threads (``writer_threads``).
* loads: ``get_num_new_matched_tokens`` answers ``load_async=True`` (``(None, False)``, "ask again
  later", while ``max_concurrent_loads`` loads are in flight); a loader thread reads every blob of
  the request's chunks once and checks them (CRC, identity, ids, geometry) off the step and, with
  CPU caches, writes them into the request's blocks too; ``get_finished`` reports it received
  (CUDA caches: it writes the chunks first, on the step). In a step that computes nothing,
  ``get_finished`` waits up to ``IDLE_LOAD_WAIT_S`` for the loader. A chunk that fails goes to
  ``get_block_ids_with_load_errors`` and, with ``kv_load_failure_policy="recompute"``, is computed.

With ``async_save=false`` / ``async_load=false`` both happen inside the step (the same code,
inline); the blobs are the same bytes either way. ``shutdown`` drains the writer for up to 10 s
and abandons the rest (writes are atomic: nothing half-written is ever served). An unreachable
store (``StoreUnavailableError``) is a miss for a lookup, a dropped save, a recomputed load, each
counted (``lookup_unavailable``, ``save_unavailable``, ``load_unavailable``); any other error of a
lookup (an ``OSError`` such as EIO on a shared directory) is a miss too, counted and logged once
per outage. A full store's refused saves are counted (``store_full``) and logged, rate limited.
At start the connector asks the store once (a config error a store finds only when it connects
stops the engine then), warns when a fleet key is set for a store that does not use one (refuses
``fleet_key_file`` there) and when ``kv_load_failure_policy`` is not ``"recompute"``;
``shutdown`` closes the store it opened.

``kv_connector_extra_config`` keys (:class:`~.config.KvcodecConfig`): ``root`` (the store
directory; required unless ``store``), ``store`` (a store URL), ``store_timeout_ms`` (50),
``key_prefix``, ``fleet_key_env`` (``"KVCODEC_FLEET_KEY"``), ``fleet_key_file``, ``chunk_size``
(256), ``scope`` (``per_page_head``; or ``per_layer_head``, ``per_tensor``), ``page_size`` (16),
``model_id``, ``max_bytes`` (a capped directory store), ``fsync`` (false), ``async_save`` (true),
``async_load`` (true), ``max_pending_save_bytes`` (1 GiB), ``max_concurrent_loads`` (16),
``writer_threads`` (2), and ``fused``: ``"auto"`` (default) saves and loads each chunk of every
layer in one Triton launch (:mod:`.fused`) when the caches are on CUDA, fp16/bf16/fp32, with
``head_size == head_size_v``; ``"on"`` requires that path (CPU caches then run the kernels in
Triton's interpreter, which needs ``TRITON_INTERPRET=1``: for tests); ``"off"`` always goes layer
by layer. Both paths write the same blob bytes.

Counters (``stats``; per interval through ``get_kv_connector_stats`` and Prometheus,
:mod:`.counters`, :mod:`.stats`), the store's own as ``store_<name>``. One DEBUG line per finished
request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvcodec.store import DirectoryStore

from .chunk_keys import ChunkKeys
from .config import KvcodecConfig
from .counters import Counters
from .events import KvcodecKVEvents, block_stored
from .generation import Generations
from .identity import (
    CacheGeometry,
    cache_geometry,
    check_windows,
    head_layout,
    layer_groups,
    layer_ids,
    model16,
)
from .loads import IDLE_LOAD_WAIT_S
from .metadata import LoadSpec, SaveSpec, StepPlan
from .scheduler import KvcodecScheduler, LookupShape
from .stats import KvcodecPromMetrics, KvcodecStats
from .store_tiers import by_source, flat_stats, hit_source, open_connector_store, tier_sources
from .worker import ConnectorParts, KvcodecWorker, WorkerSetup

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "IDLE_LOAD_WAIT_S",
    "ConnectorParts",
    "KvcodecConnector",
    "KvcodecMetadata",
    "LoadSpec",
    "SaveSpec",
    "open_connector_store",
]

logger = logging.getLogger("vllm.kvcodec")
"""A child of the one logger vLLM configures ("vllm"): the connector's lines (which path serves, chunks
not saved or loaded) appear in the engine's log with its format and level."""


@dataclass
class KvcodecMetadata(StepPlan, KVConnectorMetadata):
    """What the worker does this step (:class:`~.metadata.StepPlan`, as vLLM's metadata type)."""


def _check_failure_policy(ktc: Any) -> None:
    """WARNING unless ``kv_load_failure_policy`` is "recompute": vLLM's default ("fail") fails the
    request on every load error, and on a shared store some are routine (a chunk evicted between the
    lookup and the load, a value the fleet key refuses, an outage)."""
    policy = getattr(ktc, "kv_load_failure_policy", None)
    if policy is not None and policy != "recompute":
        logger.warning(
            "kvcodec: kv_load_failure_policy is %r: a chunk that fails to load (evicted since the "
            'lookup, refused, store unreachable) fails its request; set "recompute" to compute it instead',
            policy,
        )


def _passive(geo: CacheGeometry) -> bool:
    """A model with state groups: logged once; the connector then stores and loads nothing."""
    if geo.state:
        logger.warning(
            "kvcodec: the model has state groups (%s): KvcodecConnector stores and loads nothing for it "
            "(every prompt is computed; its attention layers' chunks alone cannot replace the state)",
            ", ".join(sorted(set(geo.state))),
        )
    return bool(geo.state)


def _metadata(meta: Any, hook: str) -> KvcodecMetadata:
    if not isinstance(meta, KvcodecMetadata):
        raise TypeError(f"KvcodecConnector.{hook} needs KvcodecMetadata; got {type(meta).__name__}")
    return meta


class KvcodecConnector(KVConnectorBase_V1, SupportsHMA):
    """Saves prompt chunks as kvcodec blobs and loads them back into vLLM's paged cache.

    A facade: the scheduler role's hooks go to :attr:`scheduler`, the worker role's to
    :attr:`worker`. ``parts`` (not passed by vLLM) replaces the store or a transfer step.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
        *,
        parts: ConnectorParts | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        parts = parts if parts is not None else ConnectorParts()
        # Every extra-config key is checked here, so a bad config stops the engine at start.
        cfg = self.cfg = KvcodecConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        geo = cache_geometry(kv_cache_config, vllm_config)
        groups = layer_groups(kv_cache_config)
        layers = layer_ids(groups)
        check_windows(geo, cfg)
        heads = head_layout(vllm_config, cfg, geo)
        self.keys = ChunkKeys(model16(heads.base), heads.split, heads.world)
        self._owns_store = parts.store is None
        self.store = parts.store if parts.store is not None else open_connector_store(cfg)
        self._cache_hit_source = hit_source(self.store, getattr(type(self), "_cache_hit_source", None))
        self._tier_sources = tier_sources(self.store)
        if role == KVConnectorRole.SCHEDULER:  # once per engine, not once per worker
            _check_failure_policy(self._kv_transfer_config)
        self.counters = Counters()
        self.scheduler: KvcodecScheduler | None = None
        self._events: list[Any] = []
        """KV events the workers reported, until vLLM takes them (scheduler side)."""
        self.worker: KvcodecWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            shape = LookupShape(
                tuple(sorted(layers.values())),
                heads.split.heads,
                heads.splits,
                bool(self.store.partial_groups),
            )
            gens = Generations(self.store, self.keys.model16, heads.base)
            self.scheduler = KvcodecScheduler(cfg, self.keys, self.store, shape, geo.block_size, gens)
            ev = getattr(vllm_config, "kv_events_config", None)
            self.scheduler.events = bool(getattr(ev, "enable_kv_cache_events", False))
            if self._tier_sources is not None:
                self.scheduler.locate = self.store.locate_many  # type: ignore[attr-defined]
            self.scheduler.windowed = bool(geo.windows)
            self.scheduler.passive = _passive(geo)
        else:
            setup = WorkerSetup(
                cfg,
                geo,
                layers,
                heads,
                vllm_config.model_config.dtype,
                getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None),
                str(vllm_config.cache_config.cache_dtype),
                groups,
            )
            self.worker = KvcodecWorker(setup, self.store, self.keys, self.counters, parts)
        logger.info(
            "KvcodecConnector(%s): store %s, chunk_size %d, scope %s, async save %s / load %s",
            role.name,
            getattr(self.store, "location", cfg.location),
            cfg.chunk_size,
            cfg.scope,
            cfg.async_save,
            cfg.async_load,
        )

    def _sched(self) -> KvcodecScheduler:
        if self.scheduler is None:
            raise RuntimeError("a scheduler-side hook called on the worker-side connector")
        return self.scheduler

    def _work(self) -> KvcodecWorker:
        if self.worker is None:
            raise RuntimeError("a worker-side hook called on the scheduler-side connector")
        return self.worker

    @property
    def stats(self) -> dict[str, float]:
        """This process's cumulative counters, the store's as ``store_<name>``."""
        self._sample()
        return dict(self.counters.total)

    def _sample(self) -> None:
        if self.worker is not None:
            for name, value in self.worker.gauges().items():
                self.counters.gauge(name, value)
        self.counters.merge_store(flat_stats(self.store))

    @property
    def shutdown_timeout_s(self) -> float:
        """How long ``shutdown`` drains pending writes before abandoning them."""
        return self._work().shutdown_timeout_s

    @shutdown_timeout_s.setter
    def shutdown_timeout_s(self, value: float) -> None:
        self._work().shutdown_timeout_s = value

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a cache, not a hand-off. A save dropped by a preemption is a future miss, so vLLM need
        not recompute the preempted request to deliver it (as vLLM's own offloading connectors)."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Any layout: blobs are token-major, whatever the cache's memory order."""
        return None

    # ------------------------------------------------------------ scheduler side

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        split = (
            None
            if self._tier_sources is None
            else self._sched().hit_tiers(request.request_id, num_external_tokens)
        )
        if not split:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return by_source(split, self._tier_sources)  # type: ignore[arg-type]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output, KvcodecMetadata())  # type: ignore[return-value]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, KvcodecKVEvents):
            self._events.extend(events.get_all_events())

    def take_events(self) -> list[Any]:
        """``BlockStored`` events of the chunks made loadable since the last call (:mod:`.events`)."""
        events, self._events = self._events, []
        return events

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator: once per request, every group's blocks (held alike)."""
        return self._sched().request_finished(request, list(block_ids[0]) if block_ids else [])

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every group: a chunk's blob holds every layer of every group (sliding-window layers'
        tokens outside the window are in the blobs and not written back)."""
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def reset_cache(self) -> bool | None:
        """A new cache generation (:mod:`.generation`): no blob written before loads again, here or in
        an engine that reads this store later. False when the store could not record it (this engine
        still loads nothing older); None on the worker side (vLLM calls the scheduler's)."""
        return self.scheduler.reset() if self.scheduler is not None else None

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        rank = 0
        if self.caches_world > 1:
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        self._work().register_kv_caches(kv_caches, rank)

    @property
    def caches_world(self) -> int:
        """Tensor-parallel ranks the blobs are written for."""
        return self.keys.world

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work().start_load_kv(_metadata(self._get_connector_metadata(), "start_load_kv"))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Synchronous loads finish in ``start_load_kv``; background ones in ``get_finished``."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Saves run once per step in ``wait_for_save``, from the registered caches."""

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._work().handle_preemptions(_metadata(kv_connector_metadata, "handle_preemptions"))

    def wait_for_save(self) -> None:
        self._work().wait_for_save(_metadata(self._get_connector_metadata(), "wait_for_save"))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return self._work().get_finished(meta if isinstance(meta, KvcodecMetadata) else None)

    def get_kv_connector_kv_cache_events(self) -> KvcodecKVEvents | None:
        locality = "LOCAL" if isinstance(self.store, DirectoryStore) else "REMOTE"
        return block_stored(self._work().saves.take_stored(), locality)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().loads.take_errors()

    # ------------------------------------------------------------ lifecycle and metrics

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no chunk is being copied out or written (True) or ``timeout`` s pass (False): for
        tests and benchmarks that read the store right after a request."""
        return self._work().drain(timeout)

    def shutdown(self) -> None:
        """Drain the worker's saves (bounded), then close the store the connector opened (a store
        passed in ``parts`` belongs to the caller)."""
        if self.worker is not None:
            self.worker.shutdown()
        if self._owns_store:
            self.store.close()

    def get_kv_connector_stats(self) -> KvcodecStats | None:
        self._sample()
        data = self.counters.take_interval()
        return KvcodecStats(data=data) if any(data.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvcodecStats:
        return KvcodecStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvcodecPromMetrics:
        return KvcodecPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
