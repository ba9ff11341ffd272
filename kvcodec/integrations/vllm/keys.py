"""What names a blob: connector config, cache geometry, model identity, prefix hashes.

Kept free of vLLM imports (configs are read duck-typed), so it is testable and
importable anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcodec import ScaleScope, UnsupportedConfigError
from kvcodec.codec import resolve_scope

__all__ = [
    "CacheGeometry",
    "KvcodecConfig",
    "cache_geometry",
    "identity",
    "layer_ids",
    "prefix_hashes",
    "request_seed",
]

_HASH_DOMAIN = b"kvcodec.vllm.prefix.v1\x00"


# ----------------------------------------------------------------------------
# Configuration and identity
# ----------------------------------------------------------------------------


_SCOPES = (ScaleScope.PER_TENSOR, ScaleScope.PER_LAYER_HEAD, ScaleScope.PER_PAGE_HEAD)
"""The scopes a connector can write: scales computed from V (not external, not raw)."""


@dataclass(frozen=True)
class KvcodecConfig:
    """``kv_connector_extra_config``, validated."""

    root: str
    chunk_size: int = 256
    scope: str = "per_page_head"
    """Scale scope name (``per_tensor``, ``per_layer_head`` or ``per_page_head``; stored lower-case)."""
    page_size: int = 16
    model_id: str | None = None
    max_bytes: int | None = None
    fsync: bool = False
    """KV blobs can always be recomputed, so a machine crash may lose recent ones."""
    fused: str = "auto"
    """Fused Triton save/load (``auto``: on CUDA caches that qualify; ``on``: required, else the engine
    stops; CPU caches then run the kernels in Triton's interpreter, for tests; ``off``: per layer)."""

    def __post_init__(self) -> None:
        """Check every field, so a bad config stops the engine at start, not every chunk save."""
        if not isinstance(self.root, (str, os.PathLike)) or not os.fspath(self.root):
            raise UnsupportedConfigError(
                f'KvcodecConnector needs kv_connector_extra_config {{"root": "<store dir>"}}; got root={self.root!r}'
            )
        for name in ("chunk_size", "page_size"):
            val = getattr(self, name)
            if not _is_int(val) or val < 1:
                raise UnsupportedConfigError(f"{name} must be an int >= 1; got {val!r}")
        if self.max_bytes is not None and (not _is_int(self.max_bytes) or self.max_bytes < 1):
            raise UnsupportedConfigError(f"max_bytes must be an int >= 1 or null; got {self.max_bytes!r}")
        if type(self.fsync) is not bool:
            raise UnsupportedConfigError(f"fsync must be true or false; got {self.fsync!r}")
        if self.fused not in ("auto", "on", "off"):
            raise UnsupportedConfigError(f'fused must be "auto", "on" or "off"; got {self.fused!r}')
        if self.model_id is not None and not isinstance(self.model_id, str):
            raise UnsupportedConfigError(f"model_id must be a string or null; got {self.model_id!r}")
        object.__setattr__(self, "root", os.fspath(self.root))
        object.__setattr__(self, "scope", _scope_name(self.scope))

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KvcodecConfig:
        """The config from vLLM's ``kv_connector_extra_config``; unknown keys and bad values are refused."""
        if extra is not None and not isinstance(extra, dict):
            raise UnsupportedConfigError(f"kv_connector_extra_config must be a JSON object; got {type(extra).__name__}")
        extra = dict(extra or {})
        unknown = set(extra) - set(cls.__dataclass_fields__)
        if unknown:
            raise UnsupportedConfigError(
                f"unknown kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}"
            )
        if "root" not in extra:
            raise UnsupportedConfigError(
                'KvcodecConnector needs kv_connector_extra_config {"root": "<store dir>"}'
            )
        return cls(**extra)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _scope_name(scope: Any) -> str:
    """The lower-case name of a computed scope given by name or number (JSON has no enums)."""
    if not isinstance(scope, str) and not _is_int(scope):
        raise UnsupportedConfigError(f"scope must be a scope name; got {scope!r}")
    sc = resolve_scope(scope)
    if sc not in _SCOPES:
        raise UnsupportedConfigError(
            f"scope {scope!r} cannot be written by the connector; use one of {[s.name.lower() for s in _SCOPES]}"
        )
    return sc.name.lower()


@dataclass(frozen=True)
class CacheGeometry:
    """The attention cache spec the blobs are written for."""

    num_kv_heads: int
    head_size: int
    head_size_v: int
    block_size: int
    dtype: torch.dtype
    fp8: bool


def cache_geometry(kv_cache_config: Any, vllm_config: Any) -> CacheGeometry:
    """One dense attention group's geometry; anything else is refused clearly."""
    groups = [] if kv_cache_config is None else kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedConfigError(
            f"KvcodecConnector serves models with one KV cache group; this one has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    need = ("num_kv_heads", "head_size", "head_size_v", "dtype")
    dense = all(hasattr(spec, a) for a in need) and getattr(spec, "state_content_bytes", None) is None
    if not dense or "MLA" in type(spec).__name__ or getattr(spec, "num_head_slots", None) is not None:
        raise UnsupportedConfigError(
            f"KvcodecConnector needs dense K/V attention caches; got {type(spec).__name__}"
        )
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "half", "float"):
        raise UnsupportedConfigError(f"kv_cache_dtype={cache_dtype!r} is not served by KvcodecConnector")
    return CacheGeometry(
        spec.num_kv_heads,
        spec.head_size,
        spec.head_size_v,
        spec.block_size,
        spec.dtype,
        cache_dtype.startswith("fp8"),
    )


def _short_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def identity(
    vllm_config: Any, cfg: KvcodecConfig, geo: CacheGeometry, rank: int, world: int
) -> dict[str, str]:
    """Blob identity hashes: what must match for a blob to be valid in this engine."""
    mc = vllm_config.model_config
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else {}
    rope = {k: hf.get(k) for k in ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")}
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    layout = (
        f"vllm-token-major;kv_dtype={cache_dtype}:{str(geo.dtype).removeprefix('torch.')};"
        f"model_dtype={str(mc.dtype).removeprefix('torch.')};heads={geo.num_kv_heads};"
        f"dk={geo.head_size};dv={geo.head_size_v};tp={rank}/{world}"
    )
    return {
        "model_id": cfg.model_id or str(mc.model),
        "model_revision_hash": str(mc.revision or ""),
        "rope_config_hash": _short_hash(rope),
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


def prefix_hashes(tokens: Sequence[int], chunk_size: int, seed: str = "") -> list[str]:
    """One hash per full chunk, each over every token id up to that chunk's end (chained)."""
    h = hashlib.sha256(_HASH_DOMAIN + seed.encode()).digest()
    out = []
    for end in range(chunk_size, len(tokens) + 1, chunk_size):
        chunk = tokens[end - chunk_size : end]
        h = hashlib.sha256(h + struct.pack(f"<{len(chunk)}q", *chunk)).digest()
        out.append(h.hex()[:32])
    return out


def request_seed(request: Any) -> str:
    """What, besides token ids, changes a request's KV: LoRA, multimodal inputs, cache salt."""
    lora = getattr(request, "lora_request", None)
    mm = [getattr(f, "identifier", str(f)) for f in (getattr(request, "mm_features", None) or [])]
    salt = getattr(request, "cache_salt", None)
    if lora is None and not mm and not salt:
        return ""
    return _short_hash([getattr(lora, "lora_name", None), mm, salt])
