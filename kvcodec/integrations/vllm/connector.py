"""``KvcodecConnector``: vLLM KV connector that keeps prompt chunks as kvcodec blobs.

Every full ``chunk_size``-token chunk of a prompt is saved, per layer, as one
blob in a :class:`~kvcodec.store.DirectoryStore`, keyed by the chunk's prefix
hash (all token ids up to the chunk's end), the layer and the model identity.
A later request, in this engine or another one, loads the longest run of
leading chunks whose blobs exist for every layer, and vLLM computes only the
rest of the prompt.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KvcodecConnector",
      "kv_connector_module_path": "kvcodec.integrations.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"root": "/path/to/store", "chunk_size": 256}}'

Loads are synchronous (``start_load_kv`` writes every layer before the forward
pass) and saves happen in ``wait_for_save``. A chunk's blobs are all decoded and
checked (identity hashes, geometry, dtype, CRC) before any block is written;
a chunk that fails is reported through ``get_block_ids_with_load_errors`` and,
with ``kv_load_failure_policy="recompute"``, vLLM recomputes from there.

``kv_connector_extra_config`` keys: ``root`` (required), ``chunk_size`` (256),
``scope`` (``per_page_head``; or ``per_layer_head``, ``per_tensor``),
``page_size`` (16), ``model_id``, ``max_bytes``, ``fsync`` (false), and
``fused``: ``"auto"`` (default) saves and loads each chunk of every layer in one
Triton launch (:mod:`.fused`) when the caches are on CUDA, fp16/bf16/fp32, with
``head_size == head_size_v``; ``"on"`` requires that path (the engine stops at
start if it cannot serve the caches; CPU caches then run the kernels in
Triton's interpreter, which needs ``TRITON_INTERPRET=1``: for tests);
``"off"`` always goes layer by layer. Both paths write the same blob bytes.
Which one serves is logged once at ``register_kv_caches``. Chunks that start
mid-block, or whose loaded part starts mid-block or mid scale page, go
layer by layer either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvcodec import CodecError, CodecMismatchError, CorruptEncodedKVError, UnsupportedConfigError
from kvcodec.store import DirectoryStore

from .chunks import ChunkCodec, FP8Scales, encode_chunk
from .fused import ChunkLoad, FusedLayers, load_layers
from .keys import (
    KvcodecConfig,
    cache_geometry,
    identity,
    layer_ids,
    prefix_hashes,
    request_seed,
)

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

# ----------------------------------------------------------------------------
# Scheduler -> worker metadata
# ----------------------------------------------------------------------------


@dataclass
class SaveSpec:
    """Save chunk ``chunk`` (tokens ``chunk * chunk_size ..``) of a request."""

    req_id: str
    chunk: int
    chunk_hash: str
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


@dataclass
class KvcodecMetadata(KVConnectorMetadata):
    """What the worker does this step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _ReqState:
    hashes: list[str]
    """Prefix hash of each full prompt chunk."""
    block_ids: list[int]
    next_chunk: int = 0


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
        self._store = DirectoryStore(
            self._cfg.root, max_bytes=self._cfg.max_bytes, fsync=self._cfg.fsync, verify=False
        )
        names = kv_cache_config.kv_cache_groups[0].layer_names  # type: ignore[union-attr]
        self._layers = layer_ids(names)
        self._model16 = {
            r: DirectoryStore.make_key(
                identity(vllm_config, self._cfg, self._geo, r, self._world), 0, 0
            ).split("-")[0]
            for r in range(self._world)
        }
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._seeds: dict[str, str | None] = {}
        """Per request: what besides token ids identifies its KV; None = never save (prompt embeddings)."""
        self._hits: dict[str, tuple[int, int, list[str]]] = {}
        self._to_load: dict[str, tuple[int, int, list[str]]] = {}
        # worker side
        self._rank = 0
        self._caches: dict[str, torch.Tensor] = {}
        self._codecs: dict[str, ChunkCodec] = {}
        self._fused: FusedLayers | None = None
        self._load_errors: set[int] = set()
        self.stats = {
            "chunks_loaded": 0,
            "tokens_loaded": 0,
            "chunks_failed": 0,
            "blobs_saved": 0,
            "save_errors": 0,
            "chunks_saved_fused": 0,
            "chunks_loaded_fused": 0,
        }
        """Worker-side counters (this process's connector), for logs and tests."""
        logger.info("KvcodecConnector(%s): store %s, chunk_size %d, scope %s", role.name, self._cfg.root,
                    self._cfg.chunk_size, self._cfg.scope)  # fmt: skip

    # ------------------------------------------------------------ keys

    def _key(self, rank: int, layer: int, chunk: int, chunk_hash: str) -> str:
        return f"{self._model16[rank]}-L{layer}-C{chunk}-H{chunk_hash}"

    def _chunk_present(self, chunk: int, chunk_hash: str) -> bool:
        return all(
            self._store.contains(self._key(r, layer, chunk, chunk_hash))
            for r in range(self._world)
            for layer in self._layers.values()
        )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Any layout: blobs are token-major, whatever the cache's memory order."""
        return None

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` covered by leading chunks stored for every layer."""
        tokens = list(request.prompt_token_ids or [])
        embeds = getattr(request, "prompt_embeds", None) is not None
        seed = self._seeds[request.request_id] = None if embeds else request_seed(request)
        if seed is None or not tokens:
            return 0, False
        cs = self._cfg.chunk_size
        hashes = prefix_hashes(tokens[: (len(tokens) - 1) // cs * cs], cs, seed)
        hit = 0
        for c, h in enumerate(hashes):
            if not self._chunk_present(c, h):
                break
            hit = (c + 1) * cs
        if hit <= num_computed_tokens:
            self._hits.pop(request.request_id, None)
            return 0, False
        self._hits[request.request_id] = (num_computed_tokens, hit, hashes)
        return hit - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        hit = self._hits.pop(request.request_id, None)
        if num_external_tokens > 0 and hit is not None:
            start, _, hashes = hit
            self._to_load[request.request_id] = (start, start + num_external_tokens, hashes)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvcodecMetadata()
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
        self._to_load.clear()
        return meta

    def _plan(self, meta: KvcodecMetadata, req_id: str, computed_after: int) -> None:
        state = self._reqs[req_id]
        load = self._to_load.get(req_id)
        if load is not None:
            start, end, hashes = load
            meta.loads.append(LoadSpec(req_id, start, end, hashes, list(state.block_ids)))
        cs = self._cfg.chunk_size
        done = min(computed_after // cs, len(state.hashes))
        bs = self._geo.block_size
        for c in range(state.next_chunk, done):
            if not self._chunk_present(c, state.hashes[c]):
                meta.saves.append(
                    SaveSpec(req_id, c, state.hashes[c], state.block_ids[: -(-(c + 1) * cs // bs)])
                )
        state.next_chunk = max(state.next_chunk, done)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are synchronous, so the blocks are free to go at once."""
        self._reqs.pop(request.request_id, None)
        self._seeds.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank() if self._world > 1 else 0
        self._rank = rank
        hashes = identity(self._vllm_config, self._cfg, self._geo, rank, self._world)
        geo = self._geo
        model_dtype = self._vllm_config.model_config.dtype
        for name, cache in kv_caches.items():
            if name not in self._layers:
                continue
            want_c = geo.head_size + geo.head_size_v
            if cache.dim() != 4 or cache.shape[1] != geo.num_kv_heads or cache.shape[3] != want_c:
                raise UnsupportedConfigError(
                    f"layer {name}: expected a [blocks, {geo.num_kv_heads}, block, {want_c}] view; got {tuple(cache.shape)}"
                )
            self._caches[name] = cache
            self._codecs[name] = ChunkCodec(
                head_size=geo.head_size, block_size=geo.block_size, model_dtype=model_dtype, scope=self._cfg.scope,
                page_size=self._cfg.page_size, hashes=hashes,
            )  # fmt: skip
        self._build_fused()

    def _build_fused(self) -> None:
        """The fused path when it can serve these caches (``fused="on"``: or stop here); logged once."""
        codec = next(iter(self._codecs.values()), None)
        if codec is None:
            return
        self._fused, why = FusedLayers.build(self._caches, self._layers, codec, self._cfg.fused)
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

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvcodecMetadata):
            return
        for spec in meta.loads:
            self._load(spec)

    def _load(self, spec: LoadSpec) -> None:
        cs, bs = self._cfg.chunk_size, self._geo.block_size
        for c in range(spec.start // cs, -(-spec.end // cs)):
            first = max(spec.start, c * cs)
            try:
                self._load_chunk(spec, c, first - c * cs)
                self.stats["chunks_loaded"] += 1
                self.stats["tokens_loaded"] += min(spec.end, (c + 1) * cs) - first
            except (CodecError, KeyError, OSError) as e:
                bad = {spec.block_ids[t // bs] for t in range(first, spec.end)}
                self._load_errors |= bad
                self.stats["chunks_failed"] += 1
                logger.warning("kvcodec: request %s chunk %d not loaded (%s); %d blocks to recompute",
                               spec.req_id, c, e, len(bad))  # fmt: skip
                return

    def _load_chunk(self, spec: LoadSpec, c: int, skip: int) -> None:
        """Read and check every layer's blob of chunk ``c``, then write them all."""
        cs, h = self._cfg.chunk_size, spec.chunk_hashes[c]
        blobs = {}
        for name, layer in self._layers.items():
            if name in self._caches:
                key = self._key(self._rank, layer, c, h)
                blobs[name] = (key, self._store.get(key))
        with self._deleting_bad(blobs):
            fused = load_layers({n: b for n, (_, b) in blobs.items()}, self._caches, self._codec,
                                ChunkLoad(spec.block_ids, c, cs, skip), self._fused)  # fmt: skip
        if fused:
            self.stats["chunks_loaded_fused"] += 1

    @contextlib.contextmanager
    def _deleting_bad(self, blobs: dict[str, tuple[str, Any]]) -> Iterator[None]:
        """Delete every blob of the chunk when one is damaged or another model's (under this model's key)."""
        try:
            yield
        except (CorruptEncodedKVError, CodecMismatchError):
            for key, _ in blobs.values():
                self._store.delete(key)
            raise

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in ``start_load_kv``."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Saves run once per step in ``wait_for_save``, from the registered caches."""

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvcodecMetadata):
            return
        cs = self._cfg.chunk_size
        fused = self._fused
        for spec in meta.saves:
            if fused is not None and fused.serves(spec.chunk * cs):
                self._save_fused(fused, spec)
            else:
                self._save_layers(spec)

    def _save_fused(self, fused: FusedLayers, spec: SaveSpec) -> None:
        """Every layer's blob of one chunk from one launch: NaN/Inf in any V saves none, an I/O error stops there."""
        keys = {n: self._key(self._rank, self._layers[n], spec.chunk, spec.chunk_hash) for n in fused.names}
        missing = {n: k for n, k in keys.items() if not self._store.contains(k)}
        if not missing:
            return
        try:
            for name, blob in fused.save(spec.block_ids, spec.chunk, self._cfg.chunk_size):
                if name in missing:
                    self._store.put(missing[name], blob)
                    self.stats["blobs_saved"] += 1
            self.stats["chunks_saved_fused"] += 1
        except (CodecError, OSError) as e:
            self.stats["save_errors"] += 1
            logger.warning("kvcodec: request %s chunk %d not saved: %s", spec.req_id, spec.chunk, e)

    def _save_layers(self, spec: SaveSpec) -> None:
        """One blob per layer through a staging gather (FP8 caches, unaligned chunks, fused="off")."""
        cs = self._cfg.chunk_size
        for name, layer in self._layers.items():
            if name not in self._caches:
                continue
            key = self._key(self._rank, layer, spec.chunk, spec.chunk_hash)
            if self._store.contains(key):
                continue
            try:
                blob = encode_chunk(self._caches[name], spec.block_ids, self._codec(name), start=spec.chunk * cs,
                                    num_tokens=cs, layer_id=layer, chunk_id=spec.chunk)  # fmt: skip
                self._store.put(key, blob)
                self.stats["blobs_saved"] += 1
            except (CodecError, OSError) as e:
                self.stats["save_errors"] += 1
                logger.warning("kvcodec: request %s chunk %d layer %s not saved: %s",
                               spec.req_id, spec.chunk, name, e)  # fmt: skip
                break

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
