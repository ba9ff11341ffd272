"""Who wrote a blob: the cache geometry the blobs are written for, the model's identity (what must
match for a blob to load in this engine) and the layer ids. Configs are read duck-typed (no vLLM, no
torch import), so this runs anywhere."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvcodec.errors import Reason, UnsupportedConfigError

from .chunk_keys import HeadSplit, splits_for
from .config import KvcodecConfig

__all__ = [
    "CacheGeometry",
    "HeadLayout",
    "ModelSource",
    "cache_geometry",
    "check_windows",
    "head_layout",
    "identity",
    "layer_groups",
    "layer_ids",
    "model16",
    "model_source",
    "short_hash",
    "total_kv_heads",
]


@dataclass(frozen=True)
class CacheGeometry:
    """The attention cache spec the blobs are written for."""

    num_kv_heads: int
    head_size: int
    head_size_v: int
    block_size: int
    dtype: Any
    """The cache's ``torch.dtype`` (read from vLLM's spec; this module does not import torch)."""
    fp8: bool
    latent: str = ""
    """An MLA latent cache: ``"<kv_lora_rank>+<qk_rope_head_dim>"`` (one 'head' of their sum, no V);
    empty for K/V attention."""
    window: int | None = None
    """One group's sliding window (tokens), None for full attention."""
    windows: tuple[int | None, ...] = ()
    """With several KV cache groups (vLLM's hybrid allocator): each attention group's window."""
    state: tuple[str, ...] = ()
    """The model's state groups (Mamba, linear attention: their spec names). With any, the connector
    stores and loads nothing: a prompt's state at a chunk boundary is not what vLLM hands a connector."""


def _latent(spec: Any, vllm_config: Any) -> str:
    """An MLA spec's latent split, from the model's config (``""``: not an MLA cache)."""
    if "MLA" not in type(spec).__name__:
        return ""
    hf = getattr(vllm_config.model_config, "hf_text_config", None) or vllm_config.model_config.hf_config
    lora, rope = getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None)
    if type(spec).__name__ != "MLAAttentionSpec" or not lora or not rope or lora + rope != spec.head_size:
        raise UnsupportedConfigError(
            f"KvcodecConnector serves MLA latent caches of kv_lora_rank + qk_rope_head_dim; got "
            f"{type(spec).__name__} of head size {spec.head_size} (kv_lora_rank {lora}, rope {rope})",
            reason=Reason.UNSUPPORTED,
        )
    return f"{lora}+{rope}"


def cache_geometry(kv_cache_config: Any, vllm_config: Any) -> CacheGeometry:
    """The attention caches' geometry: one group, or several of one geometry (vLLM's hybrid
    allocator: full and sliding-window attention); anything else is refused clearly."""
    groups = [] if kv_cache_config is None else kv_cache_config.kv_cache_groups
    if not groups:
        raise UnsupportedConfigError(
            "KvcodecConnector needs the model's KV cache groups", reason=Reason.UNSUPPORTED
        )
    state = tuple(type(g.kv_cache_spec).__name__ for g in groups if _is_state(g.kv_cache_spec))
    attention = [g for g in groups if not _is_state(g.kv_cache_spec)]
    if not attention:
        raise UnsupportedConfigError(
            f"KvcodecConnector needs attention caches; this model has only {sorted(set(state))}",
            reason=Reason.UNSUPPORTED,
        )
    geos = [_group_geometry(g.kv_cache_spec, vllm_config) for g in attention]
    first = geos[0]
    for geo in geos[1:]:
        if dataclasses.replace(geo, window=None) != dataclasses.replace(first, window=None):
            raise UnsupportedConfigError(
                f"KvcodecConnector serves KV cache groups of one geometry; got {first} and {geo}",
                reason=Reason.UNSUPPORTED,
            )
    windows = tuple(g.window for g in geos)
    keep = len(geos) > 1 or windows[0] is not None
    return dataclasses.replace(first, window=None, windows=windows if keep else (), state=state)


def _is_state(spec: Any) -> bool:
    """A Mamba / linear-attention state group (vLLM's ``MambaSpec`` and kin), not K/V attention."""
    return "Mamba" in type(spec).__name__ or (hasattr(spec, "shapes") and not hasattr(spec, "num_kv_heads"))


def _group_geometry(spec: Any, vllm_config: Any) -> CacheGeometry:
    """One group's geometry: dense K/V attention (full or sliding window) or an MLA latent cache."""
    need = ("num_kv_heads", "head_size", "head_size_v", "dtype")
    dense = all(hasattr(spec, a) for a in need) and getattr(spec, "state_content_bytes", None) is None
    name = type(spec).__name__
    if not dense or getattr(spec, "num_head_slots", None) is not None or "ChunkedLocal" in name:
        raise UnsupportedConfigError(
            f"KvcodecConnector needs full or sliding-window K/V attention or MLA latent caches; got {name}",
            reason=Reason.UNSUPPORTED,
        )
    latent = _latent(spec, vllm_config)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if latent and cache_dtype not in ("auto", "bfloat16", "float16", "half", "float"):
        raise UnsupportedConfigError(
            f"kv_cache_dtype={cache_dtype!r}: KvcodecConnector stores MLA latent caches at 16/32 bits only",
            reason=Reason.UNSUPPORTED_DTYPE,
        )
    if cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "half", "float"):
        raise UnsupportedConfigError(
            f"kv_cache_dtype={cache_dtype!r} is not served by KvcodecConnector",
            reason=Reason.UNSUPPORTED_DTYPE,
        )
    window = getattr(spec, "sliding_window", None) if "SlidingWindow" in name else None
    return CacheGeometry(
        spec.num_kv_heads,
        spec.head_size,
        spec.head_size_v,
        spec.block_size,
        spec.dtype,
        cache_dtype.startswith("fp8"),
        latent,
        window,
    )


def layer_groups(kv_cache_config: Any) -> dict[str, int]:
    """Attention layer name -> its KV cache group (vLLM's index), over every attention group."""
    groups = enumerate(kv_cache_config.kv_cache_groups)
    return {n: gi for gi, g in groups if not _is_state(g.kv_cache_spec) for n in g.layer_names}


def short_hash(obj: Any) -> str:
    """16 hex digits of SHA-256 over ``obj`` as canonical JSON."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from: a resolved local directory, or a hub id at a revision."""

    name: str
    """The absolute, symlink-resolved directory, or the hub id as given."""
    weights: str
    """Digest of what decides the weights (see :func:`model_source`)."""


def model_source(model: str, revision: str | None) -> ModelSource:
    """The model's stable name and weights digest, cheap enough for every engine start.

    A local directory: its real path, and a SHA-256 over ``config.json``, the
    weight index files and the name and size of every weight file
    (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``, ``*.npz``),
    so two spellings of one checkpoint agree and new weights under the same
    path do not. A hub id: the id and the revision (``"unpinned"`` without one).
    """
    path = os.path.realpath(os.path.expanduser(model)) if os.path.isdir(os.path.expanduser(model)) else None
    if path is None:
        return ModelSource(model, f"hub:{revision or 'unpinned'}")
    md = hashlib.sha256(b"kvcodec.vllm.weights.v1\x00")
    names = sorted(os.listdir(path))
    for name in ("config.json", *_WEIGHT_INDEXES):
        if name in names:
            with open(os.path.join(path, name), "rb") as f:
                md.update(f"{name}\x00".encode() + hashlib.sha256(f.read()).digest())
    for name in names:
        if name.endswith(_WEIGHT_SUFFIXES):
            md.update(f"{name}\x00{os.path.getsize(os.path.join(path, name))}\x00".encode())
    md.update(f"revision\x00{revision or ''}".encode())
    return ModelSource(path, "weights:" + md.hexdigest()[:32])


def _quantization(mc: Any) -> str:
    hf = getattr(mc, "hf_config", None)
    qcfg = getattr(hf, "quantization_config", None) if hf is not None else None
    return f"{getattr(mc, 'quantization', None) or 'none'}:{short_hash(qcfg) if qcfg else '-'}"


def total_kv_heads(vllm_config: Any, geo: CacheGeometry) -> int:
    """The model's KV heads, all tensor-parallel ranks together (an MLA latent: 1, on every rank)."""
    if geo.latent:
        return 1
    get = getattr(vllm_config.model_config, "get_total_num_kv_heads", None)
    if callable(get):
        return int(get())
    return geo.num_kv_heads * vllm_config.parallel_config.tensor_parallel_size


def identity(
    vllm_config: Any, cfg: KvcodecConfig, geo: CacheGeometry, heads: tuple[int, int], total: int
) -> dict[str, str]:
    """Blob identity hashes of a blob holding KV heads ``heads[0] .. heads[1]-1`` of ``total``: what
    must match for a blob to be valid in this engine, whatever its tensor-parallel size.

    * ``model_id``: ``cfg.model_id``, else the model's resolved local path or hub id;
    * ``model_revision_hash``: the weights digest of :func:`model_source`;
    * ``rope_config_hash``: the checkpoint's RoPE settings;
    * ``kv_layout``: blob layout, cache dtype and its storage dtype, model dtype,
      quantization method and config digest, the model's KV heads and the blob's head range,
      K/V head sizes.
    """
    mc = vllm_config.model_config
    src = model_source(str(mc.model), getattr(mc, "revision", None))
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else {}
    rope = {k: hf.get(k) for k in ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")}
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    layout = (
        f"vllm-token-major;kv_dtype={cache_dtype}:{str(geo.dtype).removeprefix('torch.')};"
        f"model_dtype={str(mc.dtype).removeprefix('torch.')};quant={_quantization(mc)};heads={total};"
        f"kvh={heads[0]}-{heads[1]};dk={geo.head_size};dv={geo.head_size_v}"
        + (f";mla={geo.latent}" if geo.latent else "")
    )
    return {
        "model_id": cfg.model_id or src.name,
        "model_revision_hash": src.weights,
        "rope_config_hash": short_hash(rope),
        "kv_layout": layout,
    }


def layer_ids(names: Iterable[str]) -> dict[str, int]:
    """Layer name -> layer index: the ``layers.N`` number when every name has one, else sorted order."""
    names = list(names)
    found = {n: re.search(r"layers\.(\d+)\.", n) for n in names}
    nums = {n: int(m.group(1)) for n, m in found.items() if m}
    if len(nums) == len(names) and len(set(nums.values())) == len(names):
        return nums
    return {n: i for i, n in enumerate(sorted(names))}


def model16(hashes: dict[str, str]) -> str:
    """The 16 hex digits that start every key of one identity: the store's model digest
    (:meth:`~kvcodec.store.DirectoryStore.make_key`), so the connector's keys are the store's."""
    from kvcodec.store import DirectoryStore

    return DirectoryStore.make_key(hashes, 0, 0).split("-")[0]


@dataclass(frozen=True)
class HeadLayout:
    """How this engine's tensor-parallel ranks split a chunk's KV heads, and which splits it reads."""

    split: HeadSplit
    """This engine's: one part per rank (or per KV head, when ranks replicate heads)."""
    world: int
    splits: tuple[int, ...]
    """The splits a lookup tries, this engine's first (FP8 caches: only this engine's)."""
    hashes: dict[tuple[int, int], dict[str, str]]
    """The identity of a blob of each head range of every split in ``splits``."""
    base: dict[str, str]
    """The identity of a blob of every head: its digest starts every key (:func:`model16`)."""

    def own(self, rank: int) -> tuple[int, int]:
        """The head range rank ``rank`` holds."""
        return self.split.range(self.split.part_of_rank(rank, self.world))


def head_layout(vllm_config: Any, cfg: KvcodecConfig, geo: CacheGeometry) -> HeadLayout:
    """This engine's :class:`HeadLayout`; a cache whose heads are not its rank's share is refused."""
    world = vllm_config.parallel_config.tensor_parallel_size
    total = total_kv_heads(vllm_config, geo)
    split = HeadSplit.of_world(total, world)
    if total % split.parts or geo.num_kv_heads != total // split.parts:
        raise UnsupportedConfigError(
            f"KV cache of {geo.num_kv_heads} heads per rank; the model has {total} KV heads at "
            f"tensor-parallel size {world}",
            reason=Reason.BAD_SHAPE,
        )
    splits = (split.parts,) if geo.fp8 else splits_for(total, split.parts)
    hashes = {}
    for parts in splits:
        for p in range(parts):
            rng = HeadSplit(total, parts).range(p)
            hashes[rng] = identity(vllm_config, cfg, geo, rng, total)
    base = identity(vllm_config, cfg, geo, (0, total), total)
    return HeadLayout(split, world, splits, hashes, base)


def check_windows(geo: CacheGeometry, cfg: KvcodecConfig) -> None:
    """A sliding window must cover a whole chunk: vLLM frees blocks outside it, and a chunk's first
    blocks must still be there in the step that completes the chunk."""
    small = [w for w in geo.windows if w is not None and w <= cfg.chunk_size]
    if small:
        raise UnsupportedConfigError(
            f"sliding window {min(small)} <= chunk_size {cfg.chunk_size}: set chunk_size below the window",
            reason=Reason.BAD_VALUE,
        )
