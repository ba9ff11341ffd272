"""A ``"kvcodec"`` serde for LMCache 0.5.6's multiprocess storage (L2 adapters).

LMCache hands a serializer one memory object per (chunk, kv rank, group),
shaped ``[2, num_layers, chunk_tokens, num_kv_heads * head_dim]`` in the
model dtype. Each object becomes **one** LMCKV version-1 blob, written
straight into LMCache's destination buffer by ``kvcodec.encode(out=...)``:

* one blob per object (not per layer) because LMCache stores one file or
  value per object: every stored object is then exactly one blob that
  LMCache's own ``lmcache.v1.kv_codec`` reader and ``kvcodec inspect`` /
  ``verify`` read as it is, with one header and one CRC for all layers;
* tokens are laid out layer-major (``L * T`` tokens of ``H`` heads), so with
  ``per_page_head`` scales and a page size dividing the chunk, no scale group
  spans two layers: the quality of per-layer blobs at a fraction of the
  headers;
* the size depends on the layout alone, so :meth:`estimate_serialized_size`
  is exact (0.5.6's ``fs`` adapter reads back exactly the estimate);
* the model name goes into the blob's ``model_id`` hash and a blob of
  another model is refused on load (:class:`~kvcodec.CodecMismatchError`).

Configured from the ``"serde"`` object of an L2 adapter's JSON, e.g.
``{"type": "kvcodec", "head_dim": 128, "model": "meta-llama/Llama-3.1-8B"}``.
Importing this module registers the type (:func:`register` is idempotent).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

import kvcodec

from ...codec.layout import resolve_scope
from ...errors import UnsupportedConfigError
from ...format import Hashes, ScaleScope

try:
    from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
    from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
    from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory
except ImportError as e:  # pragma: no cover - exercised only without LMCache
    raise ImportError(
        "kvcodec.integrations.lmcache.serde needs LMCache 0.5.6's multiprocess storage "
        f"(pip install lmcache==0.5.6; `make lmcache-full` here): {e}"
    ) from e

__all__ = [
    "SERDE_TYPE",
    "KvcodecDeserializer",
    "KvcodecSerdeConfig",
    "KvcodecSerializer",
    "create_processor",
    "register",
]

SERDE_TYPE = "kvcodec"
"""The ``"type"`` of the serde in an L2 adapter's JSON."""

KV_LAYOUT = "lmcache-mp:[2,L,T,H*D]"
"""The ``kv_layout`` hash of every blob: one object of LMCache's multiprocess storage."""

_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MLA_KEYS = ("mla", "use_mla", "is_mla")


@dataclass(frozen=True)
class KvcodecSerdeConfig:
    """The serde's options (the keys of its JSON object besides ``"type"``)."""

    head_dim: int
    """Channels per KV head: required, since LMCache's layout folds heads into ``H * D``."""
    page_size: int = 16
    """Tokens per V scale group (``per_page_head``); should divide LMCache's chunk size."""
    scope: str = "per_page_head"
    """``per_page_head`` (default, best quality), ``per_layer_head`` or ``per_tensor`` (groups span all layers)."""
    max_workers: int = 1
    """Threads of LMCache's serde pool (kvcodec's calls are single-threaded and release the GIL)."""
    model: str = ""
    """Model name written into each blob's ``model_id`` hash and checked on load ("" = not checked)."""

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> KvcodecSerdeConfig:
        """Validate the JSON options; anything this serde cannot serve is refused here, with the reason."""
        opts = dict(kwargs)
        if "model_name" in opts:
            opts.setdefault("model", opts.pop("model_name"))
        for key in _MLA_KEYS:
            if opts.pop(key, False):
                raise UnsupportedConfigError(
                    "the kvcodec serde does not serve MLA caches ([num_layers, tokens, hidden] latents): "
                    "it keeps K at 16 bits and V in FP8, which needs separate K and V; use LMCache's fp8 serde"
                )
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(opts) - names)
        if unknown:
            raise UnsupportedConfigError(f"unknown kvcodec serde option(s) {unknown}; expected some of {sorted(names)}")
        if "head_dim" not in opts:
            raise UnsupportedConfigError(
                'the kvcodec serde needs "head_dim" (LMCache\'s layout [2, L, T, H*D] does not carry it)'
            )
        cfg = cls(**opts)
        for name in ("head_dim", "page_size", "max_workers"):
            val = getattr(cfg, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise UnsupportedConfigError(f"kvcodec serde option {name} must be an int >= 1; got {val!r}")
        scope = resolve_scope(cfg.scope)
        if scope not in (ScaleScope.PER_TENSOR, ScaleScope.PER_LAYER_HEAD, ScaleScope.PER_PAGE_HEAD):
            raise UnsupportedConfigError(
                f"kvcodec serde scope {cfg.scope!r}: expected per_page_head, per_layer_head or per_tensor"
            )
        if not isinstance(cfg.model, str) or "@" in cfg.model:
            raise UnsupportedConfigError(f"kvcodec serde model must be a string without '@'; got {cfg.model!r}")
        return cfg

    @property
    def hashes(self) -> Hashes:
        """The identity written into (and expected from) every blob."""
        return Hashes(model_id=self.model, kv_layout=KV_LAYOUT)


def _layout(shape: Any, dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """(layers, tokens, heads, head_dim) of a ``[2, L, T, H*D]`` object; a clear error for anything else."""
    dims = tuple(int(d) for d in shape)
    if len(dims) != 4 or dims[0] != 2:
        kind = " (an MLA latent cache?)" if len(dims) == 3 else ""
        raise UnsupportedConfigError(
            f"the kvcodec serde serves KV objects shaped [2, num_layers, tokens, heads*head_dim]; got {list(dims)}{kind}"
        )
    if dtype not in _KV_DTYPES:
        raise UnsupportedConfigError(f"the kvcodec serde serves float16, bfloat16 or float32 KV; got {dtype}")
    _, layers, tokens, hd = dims
    if hd % head_dim:
        raise UnsupportedConfigError(f"last dim {hd} is not a multiple of the configured head_dim {head_dim}")
    return layers, tokens, hd // head_dim, head_dim


def _single(shapes: list[Any], dtypes: list[torch.dtype]) -> tuple[Any, torch.dtype]:
    if len(shapes) != 1 or len(dtypes) != 1:
        raise UnsupportedConfigError(f"the kvcodec serde serves single-group objects; got {len(shapes)} groups")
    return shapes[0], dtypes[0]


class _Codec:
    """What serializer and deserializer share: the config and the per-layout exact size."""

    def __init__(self, cfg: KvcodecSerdeConfig) -> None:
        self.cfg = cfg
        self.spec = kvcodec.EncodeSpec(
            scope=cfg.scope, page_size=cfg.page_size, hashes=cfg.hashes, version=1, chunk_id=-1, layer_id=-1
        )
        self._sizes: dict[tuple[tuple[int, ...], torch.dtype], int] = {}

    def size(self, shape: Any, dtype: torch.dtype) -> int:
        """Bytes of the blob of one object of this layout (exact; no data needed)."""
        key = (tuple(int(d) for d in shape), dtype)
        n = self._sizes.get(key)
        if n is None:
            layers, tokens, heads, dim = _layout(shape, dtype, self.cfg.head_dim)
            ghost = torch.empty((), dtype=dtype).expand(layers * tokens, heads, dim)
            n = self._sizes[key] = kvcodec.encoded_size(ghost, ghost, self.spec)
        return n

    def kv_views(self, t: torch.Tensor, shape: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of an object's tensor as ``[L*T, H, D]`` views (no copy)."""
        layers, tokens, heads, dim = _layout(shape, dtype, self.cfg.head_dim)
        x = t.view(dtype).reshape(2, layers * tokens, heads, dim)
        return x[0], x[1]


def _tensor(obj: Any, what: str) -> torch.Tensor:
    t = obj.tensor
    if t is None:
        raise UnsupportedConfigError(f"the kvcodec serde needs the {what} memory object's tensor; it has none")
    return t


class KvcodecSerializer(Serializer):
    """LMCache KV object -> one LMCKV v1 blob, written in place into the destination buffer."""

    def __init__(self, cfg: KvcodecSerdeConfig) -> None:
        self._c = _Codec(cfg)

    def serialize(self, src: Any, dst: Any, key: Any = None) -> int:
        """Encode ``src`` into ``dst``; returns the bytes written (the exact estimate)."""
        shape, dtype = _single(src.get_shapes(), src.get_dtypes())
        k, v = self._c.kv_views(_tensor(src, "source"), shape, dtype)
        out = _tensor(dst, "destination").reshape(-1).view(torch.uint8)
        size = self._c.size(shape, dtype)
        if out.numel() < size:
            raise UnsupportedConfigError(f"destination holds {out.numel()} bytes; the blob needs {size}")
        blob = kvcodec.encode(k, v, self._c.spec, out=out.numpy())
        n = len(blob)
        if n < size:  # never with today's layouts; 0.5.6's fs adapter reads back exactly the estimate
            out[n:size].zero_()
        return size

    def estimate_serialized_size(self, layout_desc: Any) -> int:
        """The exact blob size of one object of ``layout_desc``."""
        return self._c.size(*_single(layout_desc.shapes, layout_desc.dtypes))


class KvcodecDeserializer(Deserializer):
    """One LMCKV blob -> LMCache KV object: K bit-exact, V dequantized to the object's dtype."""

    def __init__(self, cfg: KvcodecSerdeConfig) -> None:
        self._c = _Codec(cfg)

    def deserialize(self, src: Any, dst: Any, key: Any = None) -> None:
        """Decode ``src``'s blob into ``dst``; another model's blob raises CodecMismatchError."""
        shape, dtype = _single(dst.get_shapes(), dst.get_dtypes())
        k, v = self._c.kv_views(_tensor(dst, "destination"), shape, dtype)
        blob = _tensor(src, "source").reshape(-1).view(torch.uint8).numpy()
        kvcodec.decode(blob, out_k=k, out_v=v, expected_hashes=self._c.cfg.hashes)


def create_processor(kwargs: dict[str, Any]) -> SerdeProcessor:
    """LMCache's factory hook: the options of the ``"serde"`` JSON object -> a processor."""
    cfg = KvcodecSerdeConfig.from_kwargs(kwargs)
    return AsyncSerdeProcessor(KvcodecSerializer(cfg), KvcodecDeserializer(cfg), max_workers=cfg.max_workers)


def register(name: str = SERDE_TYPE) -> None:
    """Register the serde with LMCache under ``name``; registering twice is a no-op."""
    if name in get_registered_serde_types():
        return
    try:
        register_serde_factory(name, create_processor)
    except ValueError:  # registered by another thread meanwhile
        if name not in get_registered_serde_types():
            raise


register()
