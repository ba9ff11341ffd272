"""The connector's scheduler side: which prompt tokens the store can serve, which chunks to save.

It imports neither torch nor vLLM (a contract in ``pyproject.toml``), reads vLLM's requests and
scheduler outputs duck-typed, and reaches the store only through a :class:`ChunkLookup` (one
``contains_many`` call per prompt). Every key comes from :class:`~.chunk_keys.ChunkKeys`.

* Lookup: the longest run of a prompt's leading chunks that are present: the manifest of each
  (written after every layer's and rank's blob) or, on a store that may lose one blob of a chunk
  on its own (``partial_groups``, e.g. Redis LRU), every blob key too. A store that fails (unreachable,
  an I/O error such as EIO/ESTALE on a shared directory, any CodecError) is a miss, counted
  (``lookup_unavailable``) and logged once per outage: nothing a store raises reaches vLLM's scheduler.
* Loads: at most ``max_concurrent_loads`` asynchronous loads in flight; over it, a request that
  would load is answered ``(None, False)`` and vLLM asks again in a later step.
* Saves: each chunk completed by a step and not present, in order (a chunk whose predecessor is
  neither stored nor planned could never be hit). With asynchronous saves a finished request that
  had chunks to save keeps its blocks (``request_finished`` -> True) until the worker reports it.
  A request with no recorded seed (never looked up) is not saved: its keys are unknown.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvcodec.errors import CodecError, StoreUnavailableError

from .chunk_keys import ChunkKeys, ChunkRef, HeadSplit
from .config import KvcodecConfig
from .generation import Generations
from .keys import prefix_hashes, request_seed
from .metadata import ChunkEvent, LoadSpec, SaveSpec, StepPlan

__all__ = ["ChunkLookup", "KvcodecScheduler", "LookupShape"]

logger = logging.getLogger("vllm.kvcodec")


class ChunkLookup(Protocol):
    """What the scheduler side needs of a store: whether keys are present, in one call."""

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` of each key, in order (one round trip on a remote store)."""
        ...


@dataclass(frozen=True)
class LookupShape:
    """Which keys make a chunk present: for one of ``splits`` (how many head ranges its blobs hold,
    whatever TP size wrote them; this engine's own first), the manifest, and with ``partial_groups``
    every blob of every head range of every layer (``layers``: the layer ids; ``heads``: the model's
    KV heads). A chunk is present when every key of one split is."""

    layers: tuple[int, ...]
    heads: int = 1
    splits: tuple[int, ...] = (1,)
    partial_groups: bool = False

    def keys(self, keys: ChunkKeys, ref: ChunkRef) -> list[list[str]]:
        """Per split, the keys whose presence marks ``ref`` loadable from it, the manifest first."""
        return [self.split_keys(keys, ref, parts) for parts in self.splits]

    def split_keys(self, keys: ChunkKeys, ref: ChunkRef, parts: int) -> list[str]:
        """The keys whose presence marks ``ref`` loadable from the split into ``parts`` head ranges."""
        ks = [keys.manifest(ref, parts)]
        if self.partial_groups:
            split = HeadSplit(self.heads, parts)
            ks += [keys.part_blob(lid, ref, split, p) for p in range(parts) for lid in self.layers]
        return ks


def _slowest(tiers: Sequence[int | None]) -> int:
    """The tier a chunk's load reads: the slowest (highest index) among its keys'."""
    return max((t or 0 for t in tiers), default=0)


@dataclass
class _ReqState:
    hashes: list[str]
    """Prefix hash of each full prompt chunk."""
    block_ids: list[list[int]]
    """Per KV cache group (one group without vLLM's hybrid allocator)."""
    request: Any = None
    """vLLM's request (its block hashes, prompt and LoRA name the KV events), when events are on."""
    next_chunk: int = 0
    saved_upto: int = 0
    """Chunks below this are stored or planned: a chunk is saved only after its predecessor."""
    planned: int = 0
    """Saves sent to the worker: with asynchronous saves the blocks are held at finish when any was."""


@dataclass
class _Lookup:
    """One request's lookup, for its DEBUG line."""

    prompt: int = 0
    hit: int = 0
    local: int = 0
    saves: int = 0


def _per_group(block_ids: Any, always: bool) -> list[list[int]]:
    """vLLM's per-group block ids as lists; none with a single full-attention group (``always``
    False: ``block_ids`` says it all)."""
    groups = [list(g) for g in block_ids]
    return groups if always or len(groups) > 1 else []


class KvcodecScheduler:
    """The scheduler-side hooks of ``KvcodecConnector``, over a :class:`ChunkLookup`."""

    def __init__(
        self,
        cfg: KvcodecConfig,
        keys: ChunkKeys,
        lookup: ChunkLookup,
        shape: LookupShape,
        block_size: int,
        generations: Generations | None = None,
    ) -> None:
        self.cfg, self.keys, self.lookup, self.shape = cfg, keys, lookup, shape
        self.generations = generations
        """The cache generation (:mod:`.generation`): seeds prefix hashes, checked by every lookup."""
        self.events = False
        """Attach a KV event to every save (vLLM's ``enable_kv_cache_events``)."""
        self.locate: Callable[[list[str]], list[int | None]] | None = None
        """A tiered store's ``locate_many`` (the tier holding each key): hits are then counted per tier."""
        self._tiers: dict[str, tuple[int, list[int]]] = {}
        """Per request looked up with ``locate``: tokens computed, the tier each hit chunk loads from."""
        self.windowed = False
        """A KV cache group is sliding-window: loads and saves carry every group's block table."""
        self.passive = False
        """The model has state groups (Mamba, linear attention): no lookup, no save, every prompt computed."""
        self._requests: dict[str, Any] = {}
        self._block_size = block_size
        self._reqs: dict[str, _ReqState] = {}
        self._seeds: dict[str, str | None] = {}
        """Per request: what besides token ids identifies its KV; None = never save (prompt embeddings)."""
        self._hits: dict[str, tuple[int, int, list[str], list[int]]] = {}
        """Per request looked up: tokens computed, tokens hit, chunk hashes, each hit chunk's split."""
        self._to_load: dict[str, LoadSpec] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._delta = dict.fromkeys(
            ("tokens_hit", "tokens_missed", "lookups_unavailable", "loads_deferred", "lookup_calls"), 0
        )
        self._held_new: list[str] = []
        self._stored_upto: dict[str, int] = {}
        """Per request allocated after a hit, the leading chunks its lookup found stored (planned
        saves start after them, without asking the store again)."""
        self._load_blocks: dict[str, set[int]] = {}
        """The blocks of each asynchronous load in flight: a failed one's request is planned by a lookup."""
        self.loading: set[str] = set()
        """Requests whose asynchronous load is in flight (until the worker reports it received)."""
        self._failing = False
        """A lookup failed and none has succeeded since: the outage is logged already."""

    # ------------------------------------------------------------ lookup

    def present(self, refs: Sequence[ChunkRef]) -> list[int | None]:
        """For each chunk, the head split (parts) it is loadable from, or None; one ``contains_many``
        (an unreachable store: none is)."""
        return [parts for parts, _ in self.present_where(refs)]

    def present_where(self, refs: Sequence[ChunkRef]) -> list[tuple[int | None, int]]:
        """:meth:`present`, each with the tier its load reads (the slowest tier among the keys that made
        it present; 0 without ``locate``).

        One call asks for every key of this engine's own split and only the manifests of the others
        (with ``partial_groups`` a split's blobs are many keys: the bench model's 12 layers in 4 head
        ranges are 49 keys a chunk); a chunk missing its own split but holding another's manifest
        is then asked for that split's blobs in a second call. A fleet of one TP size: one call."""
        if not refs:
            return []
        own, others = self.shape.splits[0], self.shape.splits[1:]
        first = [self.shape.split_keys(self.keys, r, own) for r in refs]
        first += [[self.keys.manifest(r, parts) for parts in others] for r in refs]
        got = self._locate(first, generation=True)
        if got is None:
            return [(None, 0)] * len(refs)
        out = [(own, _slowest(t)) if None not in t else (None, 0) for t in got[: len(refs)]]
        maybe = [
            (c, parts, tier)
            for c, tiers in enumerate(got[len(refs) :])
            for parts, tier in zip(others, tiers)
            if out[c][0] is None and tier is not None
        ]
        if not maybe:
            return out
        if not self.shape.partial_groups:  # the manifest alone marks a split present
            for c, parts, tier in maybe:
                out[c] = out[c] if out[c][0] is not None else (parts, tier)
            return out
        second = self._locate([self.shape.split_keys(self.keys, refs[c], p) for c, p, _ in maybe])
        for (c, parts, _), tiers in zip(maybe, second or []):
            if out[c][0] is None and None not in tiers:
                out[c] = (parts, _slowest(tiers))
        return out

    def _locate(self, groups: list[list[str]], generation: bool = False) -> list[list[int | None]] | None:
        """The tier of each key of each group, in one ``contains_many``/``locate`` call (with
        ``generation``, also the generation's key); None when the store cannot answer (counted and
        logged once) or the generation changed."""
        gens = self.generations if generation else None
        flat = ([gens.check_key] if gens is not None else []) + [k for g in groups for k in g]
        self._delta["lookup_calls"] += 1
        try:
            where = self._where(flat)
        except (CodecError, OSError) as e:  # never into vLLM's schedule(): the engine would die
            self._lookup_failed(e)
            return None
        if self._failing:
            self._failing = False
            logger.info("kvcodec: store lookups answer again")
        if gens is not None and not gens.confirmed(where.pop(0) is not None):
            return None  # another generation now: these keys are not its
        out, at = [], 0
        for g in groups:
            out.append(where[at : at + len(g)])
            at += len(g)
        return out

    def _where(self, keys: list[str]) -> list[int | None]:
        """The tier holding each key (``locate``), or 0 / None from ``contains_many``."""
        if self.locate is not None:
            return self.locate(keys)
        return [0 if ok else None for ok in self.lookup.contains_many(keys)]

    def _lookup_failed(self, e: Exception) -> None:
        """Count a failed lookup; log the first of an outage (an unreachable store logs it itself)."""
        self._delta["lookups_unavailable"] += 1
        if self._failing:
            return
        self._failing = True
        if not isinstance(e, StoreUnavailableError):
            logger.warning(
                "kvcodec: store lookup failed (%s: %s): prompts miss until lookups answer again "
                "(counter lookup_unavailable)",
                type(e).__name__,
                e,
            )

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` covered by the prompt's leading present chunks; ``(None,
        False)`` (ask again later) while ``max_concurrent_loads`` asynchronous loads are in flight."""
        rid = request.request_id
        if self.passive:  # no seed recorded: nothing of it is saved either
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        embeds = getattr(request, "prompt_embeds", None) is not None
        seed = self._seeds[rid] = None if embeds else self._seed(request)
        if self.events:
            self._requests[rid] = request
        hit, hashes, splits, tiers = 0, [], [], []
        if seed is not None and tokens:
            cs = self.cfg.chunk_size
            hashes = prefix_hashes(tokens[: (len(tokens) - 1) // cs * cs], cs, seed)
            refs = [ChunkRef.of(hashes, c) for c in range(len(hashes))]
            for c, (parts, tier) in enumerate(self.present_where(refs)):
                if parts is None:
                    break
                hit = (c + 1) * cs
                splits.append(parts)
                tiers.append(tier)
        if hit <= num_computed_tokens:
            self._count_lookup(rid, len(tokens), hit, num_computed_tokens)
            self._hits.pop(rid, None)
            return 0, False
        if (
            self.cfg.async_load
            and rid not in self.loading
            and len(self.loading) >= self.cfg.max_concurrent_loads
        ):
            self._delta["loads_deferred"] += 1
            return None, False
        self._count_lookup(rid, len(tokens), hit, num_computed_tokens)
        self._hits[rid] = (num_computed_tokens, hit, hashes, splits)
        if self.locate is not None:
            self._tiers[rid] = (num_computed_tokens, tiers)
        return hit - num_computed_tokens, self.cfg.async_load

    def hit_tiers(self, request_id: str, num_external_tokens: int) -> dict[int, int] | None:
        """Tokens of the request's planned load per tier index (None: not known, or not adding up to
        ``num_external_tokens``); forgotten once asked."""
        known = self._tiers.pop(request_id, None)
        if known is None:
            return None
        start, tiers = known
        cs = self.cfg.chunk_size
        out: dict[int, int] = {}
        for c, tier in enumerate(tiers):
            n = max(0, (c + 1) * cs - max(c * cs, start))
            if n:
                out[tier] = out.get(tier, 0) + n
        return out if sum(out.values()) == num_external_tokens else None

    def _seed(self, request: Any) -> str:
        """The request's prefix-hash seed: what changes its KV besides token ids, and the generation."""
        seed = request_seed(request)
        return seed if self.generations is None else self.generations.seed(seed)

    def reset(self) -> bool:
        """``reset_cache``: a new generation, so no blob written before loads (False: not stored)."""
        if self.generations is None:
            return False
        return self.generations.reset()

    def _count_lookup(self, req_id: str, prompt: int, hit: int, local: int) -> None:
        """Tokens hit and missed, once per request (a request may be looked up again while it waits)."""
        if req_id in self._lookups:
            return
        self._lookups[req_id] = _Lookup(prompt, max(0, hit - local), local)
        self._delta["tokens_hit"] += max(0, hit - local)
        self._delta["tokens_missed"] += max(0, prompt - max(hit, local))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of a request vLLM allocated blocks for."""
        hit = self._hits.pop(request.request_id, None)
        if hit is not None:  # its lookup found these chunks stored: no save plan asks again
            self._stored_upto[request.request_id] = hit[1] // self.cfg.chunk_size
            if self.cfg.async_load and num_external_tokens > 0:  # unless its load fails first
                self._load_blocks[request.request_id] = {b for g in blocks.get_block_ids() for b in g}
        if num_external_tokens > 0 and hit is not None:
            start, _, hashes, splits = hit
            rid = request.request_id
            self._to_load[rid] = LoadSpec(
                rid,
                start,
                start + num_external_tokens,
                hashes,
                list(blocks.get_block_ids()[0]),
                background=self.cfg.async_load,
                group_blocks=_per_group(blocks.get_block_ids(), self.windowed),
                splits=splits,
            )
            if self.cfg.async_load:
                self.loading.add(rid)

    def update_connector_output(self, connector_output: Any) -> None:
        """A load the worker reports received no longer counts against ``max_concurrent_loads``; one
        that failed (its blocks among ``invalid_block_ids``, or its request in ``failed_recving``) had
        its chunks removed, so the save plan asks the store again which are stored."""
        bad = set(getattr(connector_output, "invalid_block_ids", None) or ())
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self.loading.discard(rid)
            if rid in failed or self._load_blocks.pop(rid, set()) & bad:
                self._stored_upto.pop(rid, None)

    # ------------------------------------------------------------ the step's plan

    def build_connector_meta(self, scheduler_output: Any, meta: StepPlan) -> StepPlan:
        """Fill ``meta`` with this step's loads, saves, held and preempted requests and lookup counts."""
        meta.loads = list(self._to_load.values())
        self._to_load.clear()
        meta.tokens_hit, meta.tokens_missed = self._delta["tokens_hit"], self._delta["tokens_missed"]
        meta.lookups_unavailable = self._delta["lookups_unavailable"]
        meta.loads_deferred = self._delta["loads_deferred"]
        meta.lookup_calls = self._delta["lookup_calls"]
        self._delta = dict.fromkeys(self._delta, 0)
        meta.held, self._held_new = self._held_new, []
        meta.idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            seed = self._seeds.get(new.req_id)  # none recorded: its keys are unknown, never save it
            tokens = list(new.prompt_token_ids or []) if seed is not None else []
            hashes = prefix_hashes(tokens, self.cfg.chunk_size, seed or "")
            request = self._requests.pop(new.req_id, None)
            stored = min(self._stored_upto.pop(new.req_id, 0), len(hashes))
            self._reqs[new.req_id] = _ReqState(
                hashes, [list(g) for g in new.block_ids], request, stored, stored
            )
            self._plan(meta, new.req_id, new.num_computed_tokens + sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                state.block_ids = [list(g) for g in new_ids]  # a resumed request gets its whole table anew
            elif new_ids is not None:
                for have, more in zip(state.block_ids, new_ids):
                    have.extend(more)
            self._plan(meta, req_id, cached.num_computed_tokens[i] + sched.get(req_id, 0))
        return meta

    def _plan(self, meta: StepPlan, req_id: str, computed_after: int) -> None:
        """Save the request's chunks completed by this step that are not present (one lookup)."""
        state = self._reqs[req_id]
        cs, bs = self.cfg.chunk_size, self._block_size
        done = min(computed_after // cs, len(state.hashes))
        todo = range(state.next_chunk, done)
        for c, present in zip(todo, self.present([ChunkRef.of(state.hashes, c) for c in todo])):
            if present is not None:  # stored, by this TP size or another
                state.saved_upto = c + 1
                continue
            if c > state.saved_upto:
                break  # its predecessor is neither stored nor being saved: it could never be hit
            ref = ChunkRef.of(state.hashes, c)
            upto = -(-(c + 1) * cs // bs)
            groups = [g[:upto] for g in state.block_ids]
            event = self._event(state.request, c)
            spec = SaveSpec(req_id, c, ref.chunk_hash, ref.parent_hash, groups[0], event)
            spec.group_blocks = groups if self.windowed or len(groups) > 1 else []
            meta.saves.append(spec)
            state.saved_upto = c + 1
            state.planned += 1
            if req_id in self._lookups:
                self._lookups[req_id].saves += 1
        state.next_chunk = max(state.next_chunk, done)

    def _event(self, request: Any, chunk: int) -> ChunkEvent | None:
        """The KV event of a request's chunk: its blocks' vLLM hashes (None when events are off, the
        chunk is not whole blocks, or vLLM has not hashed its blocks)."""
        cs, bs = self.cfg.chunk_size, self._block_size
        hashes = getattr(request, "block_hashes", None) or []
        first, end = chunk * cs // bs, (chunk + 1) * cs // bs
        if request is None or cs % bs or len(hashes) < end:
            return None
        lora = getattr(request, "lora_request", None)
        return ChunkEvent(
            list(hashes[first:end]),
            hashes[first - 1] if first else None,
            list(request.prompt_token_ids[chunk * cs : (chunk + 1) * cs]),
            bs,
            getattr(lora, "adapter_id", None),
            getattr(lora, "name", None),
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """With asynchronous saves, a request that had any chunk to save keeps its blocks (True) until
        the worker's ``get_finished`` reports that every copy out of them is done; otherwise they go
        at once (synchronous saves copy inside the step)."""
        rid = request.request_id
        state = self._reqs.pop(rid, None)
        hold = self.cfg.async_save and state is not None and state.planned > 0
        if hold:
            self._held_new.append(rid)
        self._seeds.pop(rid, None)
        self._requests.pop(rid, None)
        self._hits.pop(rid, None)
        self._tiers.pop(rid, None)
        self._stored_upto.pop(rid, None)
        self._load_blocks.pop(rid, None)
        self.loading.discard(rid)
        look = self._lookups.pop(rid, None)
        if look is not None:
            logger.debug(
                "kvcodec: request %s: prompt %d tokens, %d from vLLM's cache, %d from the store "
                "(%s), %d chunks to save",
                rid,
                look.prompt,
                look.local,
                look.hit,
                "async" if self.cfg.async_load else "sync",
                look.saves,
            )
        return hold, None
