"""``KvcodecConnector``: vLLM KV connector that keeps prompt chunks as kvcodec blobs.

Every full ``chunk_size``-token chunk of a prompt is saved, per layer, as one
blob in a :class:`~kvcodec.store.DirectoryStore`, keyed by the model identity
(:func:`~.keys.identity`), the layer and the chunk's prefix hash (all token ids
up to the chunk's end), and bound to that key: each blob's header carries its
layer and chunk ids and the prefix hash (in ``kv_layout``), all checked on
load, so a blob copied under another key is refused. After every layer's (and
every TP rank's) blob of a chunk is written, one manifest file marks the chunk
present: a lookup costs one ``stat`` per chunk, whatever the layer count.
A later request, in this engine or another one, loads the longest run of
leading chunks with manifests, and vLLM computes only the rest of the prompt.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KvcodecConnector",
      "kv_connector_module_path": "kvcodec.integrations.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"root": "/path/to/store", "chunk_size": 256}}'

What the engine step waits for (defaults ``async_save`` and ``async_load``):

* saves: ``wait_for_save`` only hands each new chunk over. CPU caches: even the
  copy out of the paged cache runs off the step, on the connector's gatherer
  thread, so vLLM must keep off the blocks until it is done: a finished request
  that had chunks to save keeps its blocks (``request_finished`` returns True)
  until ``get_finished`` reports it sent, and ``handle_preemptions`` copies a
  preempted request's pending chunks out itself before the forward may reuse its
  freed blocks. CUDA with the fused path: one gather+encode launch on a side
  stream into pinned memory, which the next forward is ordered after. Encoding
  and the atomic file writes run on the writer threads (``writer_threads``); at
  most ``save_queue`` chunks wait (copy or write), a save that finds the queue
  full is skipped and counted (``saves_skipped``).
* loads: ``get_num_new_matched_tokens`` answers ``load_async=True``; a loader
  thread reads every blob of the request's chunks and checks them (CRC,
  identity, ids, geometry) off the step and, with CPU caches, writes them
  into the request's blocks too (vLLM leaves them alone until the request is
  reported); ``get_finished`` reports it received (CUDA caches: it writes the
  chunks first, on the step). In a step that computes nothing, ``get_finished``
  waits up to ``IDLE_LOAD_WAIT_S`` for the loader rather than let vLLM spin
  through empty steps. A chunk that fails goes to ``get_block_ids_with_load_errors`` in
  that same step and, with ``kv_load_failure_policy="recompute"``, is computed.

With ``async_save=false`` / ``async_load=false`` both happen inside the step
(the same code, inline); the blobs are the same bytes either way.
``shutdown`` drains the writer for up to 10 s and abandons the rest (writes are
atomic: nothing half-written is ever served).

``kv_connector_extra_config`` keys: ``root`` (required), ``chunk_size`` (256),
``scope`` (``per_page_head``; or ``per_layer_head``, ``per_tensor``),
``page_size`` (16), ``model_id``, ``max_bytes`` (prefix-aware eviction, see
:class:`~kvcodec.store.DirectoryStore`), ``fsync`` (false), ``async_save``
(true), ``async_load`` (true), ``save_queue`` (8), ``writer_threads`` (2), and
``fused``: ``"auto"`` (default) saves and loads each chunk of every layer in one
Triton launch (:mod:`.fused`) when the caches are on CUDA, fp16/bf16/fp32, with
``head_size == head_size_v``; ``"on"`` requires that path (the engine stops at
start if it cannot serve the caches; CPU caches then run the kernels in
Triton's interpreter, which needs ``TRITON_INTERPRET=1``: for tests);
``"off"`` always goes layer by layer. Both paths write the same blob bytes.

Counters (``stats``; per interval through ``get_kv_connector_stats`` and
Prometheus, :mod:`.stats`): tokens hit/missed, chunks loaded/saved/failed,
saves skipped, bytes read/written, background load/save seconds, writer
queue depth. One DEBUG line per finished request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvcodec import CodecError, CodecMismatchError, CorruptEncodedKVError, UnsupportedConfigError
from kvcodec.format import Hashes, Header, ScaleScope, assemble
from kvcodec.store import DirectoryStore, StoreFullError

from .background import BackgroundPool
from .buffers import ReadBuffers
from .chunks import ChunkCodec, FP8Scales, PreparedChunk, blob_identity, encode_kv, read_chunk, write_chunk
from .fused import ChunkLoad, FusedLayers, load_layers
from .keys import (
    KvcodecConfig,
    cache_geometry,
    chunk_suffix,
    identity,
    layer_ids,
    prefix_hashes,
    request_seed,
)
from .layout import gather_kv
from .stats import Counters, KvcodecPromMetrics, KvcodecStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvcodecConnector", "KvcodecMetadata", "LoadSpec", "SaveSpec"]

logger = logging.getLogger("vllm.kvcodec")
"""A child of the one logger vLLM configures ("vllm"): the connector's lines (which path serves, chunks
not saved or loaded) appear in the engine's log with its format and level."""

IDLE_LOAD_WAIT_S = 0.005
"""In a step that computes nothing while loads are pending, ``get_finished`` waits up to this long for
one: vLLM would otherwise run another empty step at once, about a thousand of them per second of load,
each taking the GIL and a core from the loader. (A request that arrives meanwhile waits as long.)"""

SHUTDOWN_DRAIN_S = 10.0
"""How long ``shutdown`` waits for pending writes before abandoning them (``shutdown_timeout_s``)."""

# ----------------------------------------------------------------------------
# Scheduler -> worker metadata
# ----------------------------------------------------------------------------


@dataclass
class SaveSpec:
    """Save chunk ``chunk`` (tokens ``chunk * chunk_size ..``) of a request."""

    req_id: str
    chunk: int
    chunk_hash: str
    parent_hash: str | None
    block_ids: list[int]


@dataclass
class LoadSpec:
    """Load tokens ``start .. end`` of a request from chunks ``start // chunk_size ..``."""

    req_id: str
    start: int
    end: int
    chunk_hashes: list[str]
    """Hashes of every chunk from the request's first on (only those covering start..end are read)."""
    block_ids: list[int]
    background: bool = False
    """Read on the loader thread, written and reported through ``get_finished``."""


@dataclass
class KvcodecMetadata(KVConnectorMetadata):
    """What the worker does this step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    tokens_hit: int = 0
    """Lookups since the last step: prompt tokens the connector will load ..."""
    tokens_missed: int = 0
    """... and prompt tokens neither it nor vLLM's own prefix cache had."""
    held: list[str] = field(default_factory=list)
    """Requests finished since the last step whose blocks vLLM keeps (``request_finished`` returned
    True) until ``get_finished`` reports them sent: their chunks may still be being copied out."""
    idle: bool = False
    """This step computes no token (vLLM steps anyway while requests wait for their loads)."""
    preempted: list[str] = field(default_factory=list)
    """Requests preempted by this step's schedule: their blocks are free, so ``handle_preemptions``
    waits for any copy still reading them before the forward may overwrite them."""


@dataclass
class _ReqState:
    hashes: list[str]
    """Prefix hash of each full prompt chunk."""
    block_ids: list[int]
    next_chunk: int = 0
    saved_upto: int = 0
    """Chunks below this are stored or planned: a chunk is saved only after its predecessor."""
    planned: int = 0
    """Saves sent to the worker: with asynchronous saves the blocks are held at finish when any was."""


@dataclass
class _Lookup:
    """Scheduler-side record of one request, for its DEBUG line."""

    prompt: int = 0
    hit: int = 0
    local: int = 0
    saves: int = 0


@dataclass
class _Prepared:
    """A chunk read and checked off the step, ready to write into the paged cache."""

    chunk: int
    skip: int
    tokens: int
    blobs: dict[str, Any]
    kv: PreparedChunk | None
    """Per-layer path: every layer read and checked (:func:`~.chunks.read_chunk`); None: the fused path
    writes ``blobs``."""
    buffers: list[bytearray] = field(default_factory=list)
    """What ``blobs`` (and ``kv``) view: back to the connector's read buffers once written."""


@dataclass(eq=False)
class _Gather:
    """A chunk waiting to be copied out of the cache: by the gatherer, or by ``handle_preemptions``."""

    spec: SaveSpec
    suffix: str
    claimed: bool = False
    """Taken by whoever copies it (under the connector's lock): it is copied once."""


@dataclass
class _LoadResult:
    spec: LoadSpec
    chunks: list[_Prepared]
    failed_at: int | None = None
    """First request token of the chunk that failed (its blocks on are recomputed)."""
    written: bool = False
    """Already written into the cache (and its failures recorded) by the loader."""


# ----------------------------------------------------------------------------
# The connector
# ----------------------------------------------------------------------------


class KvcodecConnector(KVConnectorBase_V1):
    """Saves prompt chunks as kvcodec blobs and loads them back into vLLM's paged cache."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # Every extra-config key is checked here, so a bad config stops the engine at start.
        self._cfg = KvcodecConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self._geo = cache_geometry(kv_cache_config, vllm_config)
        self._world = vllm_config.parallel_config.tensor_parallel_size
        try:
            self._store = DirectoryStore(
                self._cfg.root, max_bytes=self._cfg.max_bytes, fsync=self._cfg.fsync, verify=False
            )
        except OSError as e:
            raise UnsupportedConfigError(f"root {self._cfg.root!r}: cannot open the store: {e}") from None
        names = kv_cache_config.kv_cache_groups[0].layer_names  # type: ignore[union-attr]
        self._layers = layer_ids(names)
        self._hashes = {
            r: identity(vllm_config, self._cfg, self._geo, r, self._world) for r in range(self._world)
        }
        self._model16 = {r: DirectoryStore.make_key(h, 0, 0).split("-")[0] for r, h in self._hashes.items()}
        self.counters = Counters()
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._seeds: dict[str, str | None] = {}
        """Per request: what besides token ids identifies its KV; None = never save (prompt embeddings)."""
        self._hits: dict[str, tuple[int, int, list[str]]] = {}
        self._to_load: dict[str, LoadSpec] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._lookup_delta = [0, 0]
        self._held_new: list[str] = []
        # worker side
        self._rank = 0
        self._caches: dict[str, torch.Tensor] = {}
        self._codecs: dict[str, ChunkCodec] = {}
        self._fused: FusedLayers | None = None
        self._side_stream: Any = None
        self._host_bufs: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        """Chunks (key suffixes) queued for the writer: not queued twice."""
        self._ready: list[_LoadResult] = []
        self._loaded = threading.Condition(self._lock)
        """Notified when the loader has a result ready."""
        self._writer = BackgroundPool(
            "writer", threads=self._cfg.writer_threads, capacity=self._cfg.save_queue
        )
        self._loader = BackgroundPool("loader", threads=1, capacity=1 << 30, nice=0)  # on its hit's TTFT
        self._buffers = ReadBuffers()
        self._gatherer = BackgroundPool("gather", threads=1, capacity=self._cfg.save_queue)
        """Copies chunks out of CPU caches off the step; its jobs only memcpy, so a wait on it is short."""
        self._gathering: dict[str, list[_Gather]] = {}
        """Per request: chunks not copied out yet (their blocks must stay untouched until they are)."""
        self._gathered = threading.Condition(self._lock)
        self._held: set[str] = set()
        """Finished requests whose blocks vLLM holds until ``get_finished`` reports them."""
        self._defer_gather = False
        """Asynchronous saves from CPU caches: the gather copy leaves the step too."""
        self._write_in_loader = False
        """CPU caches: asynchronous loads are written by the loader, not in ``get_finished``."""
        self.shutdown_timeout_s = SHUTDOWN_DRAIN_S
        """How long ``shutdown`` drains pending writes before abandoning them."""
        logger.info(
            "KvcodecConnector(%s): store %s, chunk_size %d, scope %s, async save %s / load %s",
            role.name,
            self._cfg.root,
            self._cfg.chunk_size,
            self._cfg.scope,
            self._cfg.async_save,
            self._cfg.async_load,
        )

    @property
    def stats(self) -> dict[str, float]:
        """This process's cumulative counters (:data:`~.stats.COUNTERS`), for logs, tests and benchmarks."""
        self.counters.gauge("writer_queue_depth", self._writer.depth + self._gatherer.depth)
        return self.counters.total

    # ------------------------------------------------------------ keys

    def _blob_key(self, rank: int, layer: int, chunk: int, chunk_hash: str, parent: str | None) -> str:
        return f"{self._model16[rank]}-L{layer}{chunk_suffix(chunk, chunk_hash, parent)}"

    def _manifest_key(self, chunk: int, chunk_hash: str, parent: str | None) -> str:
        return f"{self._model16[0]}-M{chunk_suffix(chunk, chunk_hash, parent)}"

    def _chunk_present(self, chunk: int, hashes: list[str]) -> bool:
        """One ``stat``: the chunk's manifest, written after every layer's and rank's blob."""
        parent = hashes[chunk - 1] if chunk else None
        return self._store.contains(self._manifest_key(chunk, hashes[chunk], parent))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Any layout: blobs are token-major, whatever the cache's memory order."""
        return None

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` covered by leading chunks with manifests (one stat each)."""
        tokens = list(request.prompt_token_ids or [])
        embeds = getattr(request, "prompt_embeds", None) is not None
        seed = self._seeds[request.request_id] = None if embeds else request_seed(request)
        hit = 0
        hashes: list[str] = []
        if seed is not None and tokens:
            cs = self._cfg.chunk_size
            hashes = prefix_hashes(tokens[: (len(tokens) - 1) // cs * cs], cs, seed)
            for c in range(len(hashes)):
                if not self._chunk_present(c, hashes):
                    break
                hit = (c + 1) * cs
        self._count_lookup(request.request_id, len(tokens), hit, num_computed_tokens)
        if hit <= num_computed_tokens:
            self._hits.pop(request.request_id, None)
            return 0, False
        self._hits[request.request_id] = (num_computed_tokens, hit, hashes)
        return hit - num_computed_tokens, self._cfg.async_load

    def _count_lookup(self, req_id: str, prompt: int, hit: int, local: int) -> None:
        """Tokens hit and missed, once per request (a request may be looked up again while it waits)."""
        if req_id in self._lookups:
            return
        self._lookups[req_id] = _Lookup(prompt, max(0, hit - local), local)
        self._lookup_delta[0] += max(0, hit - local)
        self._lookup_delta[1] += max(0, prompt - max(hit, local))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        hit = self._hits.pop(request.request_id, None)
        if num_external_tokens > 0 and hit is not None:
            start, _, hashes = hit
            self._to_load[request.request_id] = LoadSpec(
                request.request_id,
                start,
                start + num_external_tokens,
                hashes,
                list(blocks.get_block_ids()[0]),
                background=self._cfg.async_load,
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvcodecMetadata(loads=list(self._to_load.values()))
        meta.tokens_hit, meta.tokens_missed = self._lookup_delta
        self._lookup_delta = [0, 0]
        meta.held, self._held_new = self._held_new, []
        meta.idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        self._to_load.clear()
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            seed = self._seeds.get(new.req_id, "")
            tokens = list(new.prompt_token_ids or []) if seed is not None else []
            state = _ReqState(prefix_hashes(tokens, self._cfg.chunk_size, seed or ""), list(new.block_ids[0]))
            self._reqs[new.req_id] = state
            self._plan(meta, new.req_id, new.num_computed_tokens + sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                state.block_ids = list(new_ids[0])  # a resumed request gets its whole table anew
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._plan(meta, req_id, cached.num_computed_tokens[i] + sched.get(req_id, 0))
        return meta

    def _plan(self, meta: KvcodecMetadata, req_id: str, computed_after: int) -> None:
        """Save the request's chunks completed by this step that no manifest marks present."""
        state = self._reqs[req_id]
        cs, bs = self._cfg.chunk_size, self._geo.block_size
        done = min(computed_after // cs, len(state.hashes))
        for c in range(state.next_chunk, done):
            if self._chunk_present(c, state.hashes):
                state.saved_upto = c + 1
                continue
            if c > state.saved_upto:
                break  # its predecessor is neither stored nor being saved: it could never be hit
            parent = state.hashes[c - 1] if c else None
            blocks = state.block_ids[: -(-(c + 1) * cs // bs)]
            meta.saves.append(SaveSpec(req_id, c, state.hashes[c], parent, blocks))
            state.saved_upto = c + 1
            state.planned += 1
            if req_id in self._lookups:
                self._lookups[req_id].saves += 1
        state.next_chunk = max(state.next_chunk, done)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """With asynchronous saves, a request that had any chunk to save keeps its blocks (True) until
        the worker's ``get_finished`` reports that every copy out of them is done; otherwise they go
        at once (synchronous saves copy inside the step)."""
        rid = request.request_id
        state = self._reqs.pop(rid, None)
        hold = self._cfg.async_save and state is not None and state.planned > 0
        if hold:
            self._held_new.append(rid)
        self._seeds.pop(rid, None)
        self._hits.pop(rid, None)
        look = self._lookups.pop(rid, None)
        if look is not None:
            logger.debug(
                "kvcodec: request %s: prompt %d tokens, %d from vLLM's cache, %d from the store "
                "(%s), %d chunks to save",
                rid,
                look.prompt,
                look.local,
                look.hit,
                "async" if self._cfg.async_load else "sync",
                look.saves,
            )
        return hold, None

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank() if self._world > 1 else 0
        self._rank = rank
        geo = self._geo
        codec = ChunkCodec(  # one for every layer: a load plans each chunk once for all of them
            head_size=geo.head_size,
            block_size=geo.block_size,
            model_dtype=self._vllm_config.model_config.dtype,
            scope=self._cfg.scope,
            page_size=self._cfg.page_size,
            hashes=self._hashes[rank],
        )
        for name, cache in kv_caches.items():
            if name not in self._layers:
                continue
            want_c = geo.head_size + geo.head_size_v
            if cache.dim() != 4 or cache.shape[1] != geo.num_kv_heads or cache.shape[3] != want_c:
                raise UnsupportedConfigError(
                    f"layer {name}: expected a [blocks, {geo.num_kv_heads}, block, {want_c}] view; got {tuple(cache.shape)}"
                )
            self._caches[name] = cache
            self._codecs[name] = codec
        self._build_fused()
        on_cpu = all(c.device.type == "cpu" for c in self._caches.values())
        self._defer_gather = self._cfg.async_save and on_cpu
        self._write_in_loader = on_cpu

    def _build_fused(self) -> None:
        """The fused path when it can serve these caches (``fused="on"``: or stop here); logged once."""
        codec = next(iter(self._codecs.values()), None)
        if codec is None:
            return
        self._fused, why = FusedLayers.build(self._caches, self._layers, codec, self._cfg.fused)
        if self._fused is not None and self._fused.device.type == "cuda":
            self._side_stream = torch.cuda.Stream(self._fused.device)
        logger.info("kvcodec: %s path (%s)", "fused" if self._fused is not None else "per-layer", why)

    def _codec(self, name: str) -> ChunkCodec:
        """The layer's codec, with its FP8 scales read now (they may be set after registration)."""
        cc = self._codecs[name]
        if not self._geo.fp8:
            return cc
        layer = self._vllm_config.compilation_config.static_forward_context.get(name)
        ks, vs = getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)
        if ks is None or vs is None:
            raise UnsupportedConfigError(f"FP8 cache layer {name} has no _k_scale/_v_scale")
        e5m2 = str(self._vllm_config.cache_config.cache_dtype) == "fp8_e5m2"
        fp8 = FP8Scales(
            torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn, ks.detach().float(), vs.detach().float()
        )
        return dataclasses.replace(cc, fp8=fp8)

    # ------------------------------------------------------------ loads

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvcodecMetadata):
            return
        t0 = time.perf_counter()
        for spec in meta.loads:
            if spec.background:
                self._loader.submit(lambda spec=spec: self._prepare_background(spec))
            else:
                self._apply(self._prepare(spec))
        self.counters.add(
            tokens_hit=meta.tokens_hit,
            tokens_missed=meta.tokens_missed,
            start_load_kv_seconds=time.perf_counter() - t0,
        )

    def _prepare_background(self, spec: LoadSpec) -> None:
        """The loader's job: whatever happens, the request reaches ``get_finished`` (failed: recomputed)."""
        try:
            result = self._prepare(spec)
        except Exception:  # a bug or resource failure outside one chunk's read: recompute it all
            logger.exception(
                "kvcodec: request %s not loaded; recomputed from token %d", spec.req_id, spec.start
            )
            result = _LoadResult(spec, [], failed_at=spec.start)
        if self._write_in_loader:
            self._apply_or_fail(result)
        with self._lock:
            self._ready.append(result)
            self._loaded.notify_all()
        self.counters.add(requests_loaded_async=1)

    def _apply_or_fail(self, result: _LoadResult) -> None:
        """The loader writes a CPU cache's chunks itself: until ``get_finished`` reports the request,
        vLLM touches none of its blocks (even an aborted one's are held until then). A failure here
        fails the whole request (recomputed), never leaves it unreported."""
        try:
            self._apply(result)
        except Exception:  # pragma: no cover - _apply reports a chunk's failures itself
            logger.exception("kvcodec: request %s not written; recomputed", result.spec.req_id)
            self._fail_blocks(result.spec, result.spec.start)
        result.written = True

    def _prepare(self, spec: LoadSpec) -> _LoadResult:
        """Read and check every chunk of a load (stopping at the first that fails); nothing is written."""
        cs = self._cfg.chunk_size
        result = _LoadResult(spec, [])
        t0 = time.perf_counter()
        for c in range(spec.start // cs, -(-spec.end // cs)):
            first = max(spec.start, c * cs)
            try:
                result.chunks.append(self._prepare_chunk(spec, c, first - c * cs))
            except Exception as e:  # any failure (not only a bad blob) means: recompute from here
                result.failed_at = first
                self._forget_chunk(spec, c)
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
        self.counters.add(load_seconds=time.perf_counter() - t0)
        return result

    def _prepare_chunk(self, spec: LoadSpec, c: int, skip: int) -> _Prepared:
        """Every layer's blob of chunk ``c``, checked against its key (CRC, identity, prefix, ids)."""
        h = spec.chunk_hashes[c]
        parent = spec.chunk_hashes[c - 1] if c else None
        keys = {
            n: self._blob_key(self._rank, lid, c, h, parent)
            for n, lid in self._layers.items()
            if n in self._caches
        }
        cs = self._cfg.chunk_size
        buffers: list[bytearray] = []
        try:
            with self._deleting_bad([*keys.values(), self._manifest_key(c, h, parent)]):
                blobs = {name: self._read_blob(key, buffers) for name, key in keys.items()}
                fused = self._fused
                if fused is not None and fused.serves(c * cs, skip):
                    raw = {n: p.blob for n, p in blobs.items()}
                    for name, lid in zip(fused.names, fused.layer_ids):
                        fused.check(raw[name], cs, h, (lid, c))
                    return _Prepared(c, skip, cs - skip, raw, None, buffers)
                codecs = {n: self._codec(n) for n in blobs}
                chunk = read_chunk(
                    blobs, self._caches, codecs, self._layers, chunk_id=c, num_tokens=cs, chunk_hash=h
                )
        except BaseException:
            self._buffers.give(buffers)
            raise
        return _Prepared(c, skip, cs - skip, blobs, chunk, buffers)

    def _read_blob(self, key: str, buffers: list[bytearray]) -> Any:
        """One read and one CRC-checked parse, into a reused buffer when one is idle and large enough;
        the buffer the blob lives in is added to ``buffers`` (returned after the chunk is written)."""
        spare = self._buffers.take()
        try:
            parsed = self._store.get_parsed(key, into=spare)
        except BaseException:
            if spare is not None:
                buffers.append(spare)
            raise
        owner = parsed.buffer.obj
        if isinstance(owner, bytearray):
            buffers.append(owner)  # the spare, or a new one when the spare was too small (dropped)
        self.counters.add(bytes_read=len(parsed.blob))
        return parsed

    def _forget_chunk(self, spec: LoadSpec, c: int) -> None:
        """Delete a chunk's manifest after its load failed: vLLM looks the request up again before it
        recomputes, and a chunk still marked present would be loaded (and fail) again, forever. The
        recomputed chunk is saved again (its blobs that are still there are not rewritten)."""
        parent = spec.chunk_hashes[c - 1] if c else None
        try:
            self._store.delete(self._manifest_key(c, spec.chunk_hashes[c], parent))
        except Exception as e:  # nothing more to do: the failure is already reported
            logger.warning("kvcodec: request %s chunk %d: manifest not removed (%s)", spec.req_id, c, e)

    @contextlib.contextmanager
    def _deleting_bad(self, keys: list[str]) -> Iterator[None]:
        """Delete every file of the chunk when one blob is damaged, another model's or misfiled."""
        try:
            yield
        except (CorruptEncodedKVError, CodecMismatchError):
            for key in keys:
                self._store.delete(key)
            raise

    def _apply(self, result: _LoadResult) -> None:
        """Write the prepared chunks into the request's blocks; report the rest as load errors."""
        spec = result.spec
        failed_at = result.failed_at
        try:
            failed_at = self._write_all(result, failed_at)
        finally:  # every chunk written or skipped: nothing views the buffers any more
            self._buffers.give([b for p in result.chunks for b in p.buffers])
        if failed_at is not None:
            self._fail_blocks(spec, failed_at)

    def _fail_blocks(self, spec: LoadSpec, failed_at: int) -> None:
        """Report the load's blocks from token ``failed_at`` on (vLLM recomputes them)."""
        bs = self._geo.block_size
        with self._lock:  # the loader may add while the step takes them
            self._load_errors |= {spec.block_ids[b] for b in range(failed_at // bs, -(-spec.end // bs))}
        self.counters.add(chunks_failed=1)

    def _write_all(self, result: _LoadResult, failed_at: int | None) -> int | None:
        """Write the prepared chunks in order, stopping at the first that fails; the first failing token."""
        spec, cs = result.spec, self._cfg.chunk_size
        for p in result.chunks:
            try:
                self._write_prepared(spec, p)
            except Exception as e:  # the blocks from here on are reported, so vLLM recomputes them
                failed_at = p.chunk * cs + p.skip
                self._forget_chunk(spec, p.chunk)
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

    def _write_prepared(self, spec: LoadSpec, p: _Prepared) -> None:
        cs = self._cfg.chunk_size
        if p.kv is None:
            req = ChunkLoad(spec.block_ids, p.chunk, cs, p.skip, spec.chunk_hashes[p.chunk], self._layers)
            if load_layers(p.blobs, self._caches, self._codec, req, self._fused):
                self.counters.add(chunks_loaded_fused=1)
            return
        write_chunk(p.kv, self._caches, spec.block_ids, start=p.chunk * cs, skip=p.skip)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Synchronous loads finish in ``start_load_kv``; background ones in ``get_finished``."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report the loader's finished requests received (CUDA caches: writing their chunks first; CPU
        caches: the loader wrote them) and held requests sent once nothing copies out of their blocks."""
        t0 = time.perf_counter()
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, KvcodecMetadata) and meta.idle
        if isinstance(meta, KvcodecMetadata):
            self._held.update(meta.held)
            self.counters.add(requests_held=len(meta.held))
        with self._lock:
            if idle and not self._ready and self._loader.depth:
                w0 = time.perf_counter()
                self._loaded.wait(IDLE_LOAD_WAIT_S)
                self.counters.add(idle_load_wait_seconds=time.perf_counter() - w0)
            ready, self._ready = self._ready, []
            sent = {r for r in self._held if not self._gathering.get(r)}
        self._held -= sent
        for result in ready:
            if not result.written:
                self._apply(result)
        self.counters.add(get_finished_seconds=time.perf_counter() - t0)
        return sent or None, {r.spec.req_id for r in ready} or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------ saves

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Saves run once per step in ``wait_for_save``, from the registered caches."""

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward may overwrite a preempted request's freed blocks, copy its chunks still
        waiting for the gatherer out of them here (memory copies only, never a disk write; other
        requests' copies are not waited for) and wait for any the gatherer is copying now."""
        if not isinstance(kv_connector_metadata, KvcodecMetadata) or not kv_connector_metadata.preempted:
            return
        t0 = time.perf_counter()
        for rid in kv_connector_metadata.preempted:
            with self._lock:
                mine = [g for g in self._gathering.get(rid, ()) if not g.claimed]
                for g in mine:
                    g.claimed = True
            for g in mine:  # copied here and now rather than after the gatherer's queue
                self._gather_then_queue(g)
            with self._gathered:  # and those the gatherer is copying right now
                self._gathered.wait_for(lambda rid=rid: not self._gathering.get(rid))
        self.counters.add(
            handle_preemptions_seconds=time.perf_counter() - t0,
            requests_preempted=len(kv_connector_metadata.preempted),
        )

    def wait_for_save(self) -> None:
        """Hand each new chunk over: CPU caches with asynchronous saves queue even the copy out of the
        cache (the blocks are held until it is done); otherwise copy it here and queue the encode and
        write (or do everything here, if sync)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvcodecMetadata):
            return
        t0 = time.perf_counter()
        for spec in meta.saves:
            suffix = chunk_suffix(spec.chunk, spec.chunk_hash, spec.parent_hash)
            with self._lock:
                if suffix in self._inflight:
                    continue
            if self._store.contains(self._manifest_key(spec.chunk, spec.chunk_hash, spec.parent_hash)):
                continue
            if self._cfg.async_save and self._writer.depth + self._gatherer.depth >= self._cfg.save_queue:
                self.counters.add(saves_skipped=1)
                logger.debug("kvcodec: writer queue full; chunk %d of %s not saved", spec.chunk, spec.req_id)
                continue
            if self._defer_gather:
                self._queue_gather(spec, suffix)
                continue
            try:
                job = self._save_job(spec)
            except Exception as e:  # a save is optional: count and log it, the step goes on
                self._save_failed(spec, e)
                continue
            if not self._cfg.async_save:
                job()
                continue
            with self._lock:
                self._inflight.add(suffix)
            if not self._writer.submit(job):  # pragma: no cover - only the step thread submits
                self.counters.add(saves_skipped=1)
        self.counters.gauge("writer_queue_depth", self._writer.depth + self._gatherer.depth)
        self.counters.add(wait_for_save_seconds=time.perf_counter() - t0)

    def _queue_gather(self, spec: SaveSpec, suffix: str) -> None:
        """Queue the copy out of the cache; the request's blocks stay held until it has run."""
        g = _Gather(spec, suffix)
        with self._lock:
            self._inflight.add(suffix)
            self._gathering.setdefault(spec.req_id, []).append(g)
        if not self._gatherer.submit(lambda: self._claim_and_gather(g)):  # pragma: no cover
            self._gather_done(g)  # only the step thread submits, after checking the depth
            with self._lock:
                self._inflight.discard(suffix)
            self.counters.add(saves_skipped=1)

    def _claim_and_gather(self, g: _Gather) -> None:
        """The gatherer's job, unless ``handle_preemptions`` took the chunk first."""
        with self._lock:
            if g.claimed:
                return
            g.claimed = True
        self._gather_then_queue(g)

    def _gather_then_queue(self, g: _Gather) -> None:
        """Copy a claimed chunk out, release its blocks, queue the encode and write."""
        try:
            job = self._save_job(g.spec)
        except Exception as e:  # a save is optional: count and log it
            with self._lock:
                self._inflight.discard(g.suffix)
            self._save_failed(g.spec, e)
            return
        finally:
            self._gather_done(g)
        if not self._writer.submit(job):  # pragma: no cover - writer + gatherer depth <= save_queue
            with self._lock:
                self._inflight.discard(g.suffix)
            self.counters.add(saves_skipped=1)

    def _gather_done(self, g: _Gather) -> None:
        with self._gathered:
            pending = self._gathering.get(g.spec.req_id, [])
            if g in pending:
                pending.remove(g)
            if not pending:
                self._gathering.pop(g.spec.req_id, None)
            self._gathered.notify_all()

    def _save_job(self, spec: SaveSpec) -> Callable[[], None]:
        """Do what must happen before vLLM may reuse the blocks; return the rest (encode, write)."""
        cs = self._cfg.chunk_size
        fused = self._fused
        if fused is not None and fused.serves(spec.chunk * cs):
            buf = self._host_bufs.pop() if self._host_bufs else fused.host_buffer(cs)
            pending = self._launch_fused(fused, spec, buf)

            def blobs() -> Iterable[tuple[str, Any]]:
                return zip(fused.names, pending.wait())

            return lambda: self._write_chunk(spec, blobs, fused=True, release=buf)
        gathered = {}
        for name in self._layers:
            if name in self._caches:
                cc = self._codec(name)
                k, v = gather_kv(
                    self._caches[name],
                    spec.block_ids,
                    head_size=cc.head_size,
                    block_size=cc.block_size,
                    start=spec.chunk * cs,
                    num_tokens=cs,
                )
                gathered[name] = (k, v, cc)

        def encoded() -> Iterator[tuple[str, Any]]:
            for name, (k, v, cc) in gathered.items():
                yield (
                    name,
                    encode_kv(
                        k, v, cc, layer_id=self._layers[name], chunk_id=spec.chunk, chunk_hash=spec.chunk_hash
                    ),
                )

        return lambda: self._write_chunk(spec, encoded, fused=False)

    def _launch_fused(self, fused: FusedLayers, spec: SaveSpec, buf: torch.Tensor) -> Any:
        """One gather+encode launch; on CUDA on the side stream, ordered after this step's forward, and
        the next forward after it (the blocks may be reused then), never waiting on the host."""
        cs, side = self._cfg.chunk_size, self._side_stream
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
        """Write every layer's blob of a chunk, then its manifest; count and log what fails."""
        t0 = time.perf_counter()
        suffix = chunk_suffix(spec.chunk, spec.chunk_hash, spec.parent_hash)
        written = []
        try:
            for name, blob in blobs():
                key = self._blob_key(
                    self._rank, self._layers[name], spec.chunk, spec.chunk_hash, spec.parent_hash
                )
                if not self._store.contains(key):
                    self._store.put(key, blob)
                    written.append(key)
                    self.counters.add(blobs_saved=1, bytes_written=len(blob))
            self._mark_saved(spec)
            self.counters.add(chunks_saved=1, chunks_saved_fused=int(fused))
        except StoreFullError as e:
            for key in written:  # a chunk without all its layers can never be hit: give the room back
                self._store.delete(key)
            self.counters.add(store_full=1)
            logger.debug("kvcodec: request %s chunk %d not saved: %s", spec.req_id, spec.chunk, e)
        except Exception as e:  # any failure: counted and logged here, never left to the pool
            self._save_failed(spec, e)
        finally:
            if release is not None:
                self._host_bufs.append(release)
            with self._lock:
                self._inflight.discard(suffix)
            self.counters.add(save_seconds=time.perf_counter() - t0)

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

    def _mark_saved(self, spec: SaveSpec) -> None:
        """The chunk's manifest, once this rank's blobs (and, with TP, every rank's marker) are written."""
        suffix = chunk_suffix(spec.chunk, spec.chunk_hash, spec.parent_hash)
        blob = self._manifest_blob(spec)
        if self._world > 1:
            self._store.put(f"{self._model16[self._rank]}-R{suffix}", blob)
            if not all(self._store.contains(f"{self._model16[r]}-R{suffix}") for r in range(self._world)):
                return
        self._store.put(self._manifest_key(spec.chunk, spec.chunk_hash, spec.parent_hash), blob)

    def _manifest_blob(self, spec: SaveSpec) -> bytearray:
        """A payload-free LMCKV blob with the chunk's identity (``kvcodec verify`` reads it like a blob)."""
        cc = next(iter(self._codecs.values()))
        hashes = blob_identity(cc, self._geo.head_size, self._geo.head_size_v, spec.chunk_hash)
        header = Header(
            k_dtype=torch.bfloat16,
            v_dtype=torch.float8_e4m3fn,
            scale_scope=ScaleScope.EXTERNAL,
            version=2,
            layer_id=-1,
            chunk_id=spec.chunk,
            chunk_size=self._cfg.chunk_size,
            hashes=Hashes.coerce(hashes),
        )
        return assemble(header)

    # ------------------------------------------------------------ lifecycle and metrics

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no chunk is being copied out or written (True) or ``timeout`` s pass (False): for
        tests and benchmarks that read the store right after a request."""
        end = None if timeout is None else time.monotonic() + timeout
        if not self._gatherer.wait_idle(timeout):
            return False
        return self._writer.wait_idle(None if end is None else max(0.0, end - time.monotonic()))

    def shutdown(self) -> None:
        """Drain the gatherer and the writer for up to ``shutdown_timeout_s`` and abandon the rest; drop
        pending loads."""
        end = time.monotonic() + self.shutdown_timeout_s
        abandoned = self._gatherer.shutdown(self.shutdown_timeout_s)
        abandoned += self._writer.shutdown(max(0.0, end - time.monotonic()))
        self._loader.shutdown(0)
        if abandoned:
            logger.warning("kvcodec: shutdown abandoned %d pending chunk saves", abandoned)

    def get_kv_connector_stats(self) -> KvcodecStats | None:
        self.counters.gauge("writer_queue_depth", self._writer.depth + self._gatherer.depth)
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
