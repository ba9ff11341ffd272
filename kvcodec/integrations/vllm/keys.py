"""What names a blob: connector config, cache geometry, model identity, prefix hashes.

Kept free of vLLM imports (configs are read duck-typed), so it is testable and
importable anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcodec import UnsupportedConfigError
from kvcodec.codec import resolve_scope
from kvcodec.format import COMPUTED_SCOPES
from kvcodec.format.header import MAX_DIM, MAX_HASH_STR

__all__ = [
    "CacheGeometry",
    "KvcodecConfig",
    "ModelSource",
    "cache_geometry",
    "chunk_suffix",
    "identity",
    "layer_ids",
    "model_source",
    "prefix_hashes",
    "request_seed",
]

_HASH_DOMAIN = b"kvcodec.vllm.prefix.v1\x00"


# ----------------------------------------------------------------------------
# Configuration and identity
# ----------------------------------------------------------------------------


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
    async_save: bool = True
    """Encode and write chunks on the connector's writer threads (the step waits only for the gather)."""
    async_load: bool = True
    """Read and check chunks on a loader thread between steps (``load_async=True`` to the scheduler)."""
    save_queue: int = 8
    """Most chunks waiting for the writer; a save that finds the queue full is skipped and counted."""
    writer_threads: int = 2

    def __post_init__(self) -> None:
        """Check every field, so a bad config stops the engine at start, not every chunk save."""
        object.__setattr__(self, "root", _check_root(self.root))
        for name, top in (
            ("chunk_size", MAX_DIM),
            ("page_size", MAX_DIM),
            ("save_queue", 1 << 20),
            ("writer_threads", 64),
        ):
            val = getattr(self, name)
            if not _is_int(val) or not 1 <= val <= top:
                raise UnsupportedConfigError(f"{name} must be an int in 1..{top}; got {val!r}")
        if self.max_bytes is not None and (not _is_int(self.max_bytes) or self.max_bytes < 1):
            raise UnsupportedConfigError(f"max_bytes must be an int >= 1 or null; got {self.max_bytes!r}")
        for name in ("fsync", "async_save", "async_load"):
            if type(getattr(self, name)) is not bool:
                raise UnsupportedConfigError(f"{name} must be true or false; got {getattr(self, name)!r}")
        if not isinstance(self.fused, str) or self.fused not in ("auto", "on", "off"):
            raise UnsupportedConfigError(f'fused must be "auto", "on" or "off"; got {self.fused!r}')
        if self.model_id is not None:
            _check_hash_text("model_id", self.model_id)
        object.__setattr__(self, "scope", _scope_name(self.scope))

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KvcodecConfig:
        """The config from vLLM's ``kv_connector_extra_config``; unknown keys and bad values are refused."""
        if extra is not None and not isinstance(extra, dict):
            raise UnsupportedConfigError(
                f"kv_connector_extra_config must be a JSON object; got {type(extra).__name__}"
            )
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


def _check_root(root: Any) -> str:
    """``root`` as a str, refused unless it can be (or is) a directory: no NUL, no file on its path."""
    if not isinstance(root, (str, os.PathLike)):
        raise UnsupportedConfigError(f'root must be a path string ("root": "<store dir>"); got {root!r}')
    try:
        path = os.fspath(root)
    except TypeError as e:
        raise UnsupportedConfigError(f"root {root!r} is not a path: {e}") from None
    if not isinstance(path, str) or not path:
        raise UnsupportedConfigError(
            f'KvcodecConnector needs kv_connector_extra_config {{"root": "<store dir>"}}; got root={root!r}'
        )
    if "\x00" in path:
        raise UnsupportedConfigError(f"root {path!r} contains a NUL byte")
    _check_hash_text("root", path)
    at = os.path.abspath(path)
    while True:
        try:
            st = os.stat(at)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        except OSError as e:
            raise UnsupportedConfigError(f"root {path!r}: cannot inspect {at!r}: {e.strerror}") from None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise UnsupportedConfigError(f"root {path!r}: {at!r} exists and is not a directory")
        if st is not None or os.path.dirname(at) == at:
            return path
        at = os.path.dirname(at)


def _check_hash_text(name: str, text: Any) -> None:
    """A string the blob header can carry: UTF-8 encodable, at most the format's hash-string length."""
    if not isinstance(text, str):
        raise UnsupportedConfigError(f"{name} must be a string; got {text!r}")
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnsupportedConfigError(f"{name} is not encodable as UTF-8 ({e.reason} at {e.start})") from None
    if name == "model_id" and len(raw) > MAX_HASH_STR:
        raise UnsupportedConfigError(
            f"model_id is {len(raw)} bytes in UTF-8; blobs hold at most {MAX_HASH_STR}"
        )


def _scope_name(scope: Any) -> str:
    """The lower-case name of a computed scope given by name or number (JSON has no enums)."""
    if not isinstance(scope, str) and not _is_int(scope):
        raise UnsupportedConfigError(f"scope must be a scope name; got {scope!r}")
    sc = resolve_scope(scope)
    if sc not in COMPUTED_SCOPES:
        raise UnsupportedConfigError(
            f"scope {scope!r} cannot be written by the connector; use one of {[s.name.lower() for s in COMPUTED_SCOPES]}"
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
    return f"{getattr(mc, 'quantization', None) or 'none'}:{_short_hash(qcfg) if qcfg else '-'}"


def identity(
    vllm_config: Any, cfg: KvcodecConfig, geo: CacheGeometry, rank: int, world: int
) -> dict[str, str]:
    """Blob identity hashes: what must match for a blob to be valid in this engine.

    * ``model_id``: ``cfg.model_id``, else the model's resolved local path or hub id;
    * ``model_revision_hash``: the weights digest of :func:`model_source`;
    * ``rope_config_hash``: the checkpoint's RoPE settings;
    * ``kv_layout``: blob layout, cache dtype and its storage dtype, model dtype,
      quantization method and config digest, KV heads, K/V head sizes, TP rank/world.
    """
    mc = vllm_config.model_config
    src = model_source(str(mc.model), getattr(mc, "revision", None))
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else {}
    rope = {k: hf.get(k) for k in ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")}
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    layout = (
        f"vllm-token-major;kv_dtype={cache_dtype}:{str(geo.dtype).removeprefix('torch.')};"
        f"model_dtype={str(mc.dtype).removeprefix('torch.')};quant={_quantization(mc)};heads={geo.num_kv_heads};"
        f"dk={geo.head_size};dv={geo.head_size_v};tp={rank}/{world}"
    )
    return {
        "model_id": cfg.model_id or src.name,
        "model_revision_hash": src.weights,
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


def chunk_suffix(chunk: int, chunk_hash: str, parent_hash: str | None) -> str:
    """``-C<chunk>-H<hash>[-P<parent hash>]``: the tail of every key of one chunk (its blobs, rank
    markers and manifest), which is how the store groups a chunk's files and finds its predecessor."""
    tail = f"-C{chunk}-H{chunk_hash}"
    return f"{tail}-P{parent_hash}" if chunk > 0 and parent_hash else tail


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
