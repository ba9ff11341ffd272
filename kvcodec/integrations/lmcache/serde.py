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

No ``compression="lossless"`` option (issue 38): a lossless blob's size depends on the KV, and
LMCache 0.5.6's framing reads an object back at exactly :meth:`estimate_serialized_size` bytes (its
``fs`` adapter drops a shorter file as an incomplete read), so a coded object would have to be padded
to the plain size and would save nothing; its blobs also stay version 1 for LMCache's own reader.
Lossless blobs are for kvcodec's own stores (the vLLM connector's ``compression`` key).

Configured from the ``"serde"`` object of an L2 adapter's JSON, e.g.
``{"type": "kvcodec", "head_dim": 128, "model": "meta-llama/Llama-3.1-8B"}``.
Importing this module registers the type (:func:`register` is idempotent).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, fields
from typing import Any

import torch

import kvcodec

from ...codec.layout import resolve_scope
from ...errors import Reason, UnsupportedConfigError
from ...format import COMPUTED_SCOPES, Hashes

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
    "ObjectLayout",
    "create_processor",
    "object_layout",
    "register",
]

SERDE_TYPE = "kvcodec"
"""The ``"type"`` of the serde in an L2 adapter's JSON."""

KV_LAYOUT_PREFIX = "lmcache-mp"
"""Start of every blob's ``kv_layout`` hash; the rest binds the object's split and the codec settings."""

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
                    "it keeps K at 16 bits and V in FP8, which needs separate K and V; use LMCache's fp8 serde",
                    reason=Reason.BAD_VALUE,
                )
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(opts) - names)
        if unknown:
            raise UnsupportedConfigError(
                f"unknown kvcodec serde option(s) {unknown}; expected some of {sorted(names)}",
                reason=Reason.BAD_VALUE,
            )
        if "head_dim" not in opts:
            raise UnsupportedConfigError(
                'the kvcodec serde needs "head_dim" (LMCache\'s layout [2, L, T, H*D] does not carry it)',
                reason=Reason.MISSING_ARGUMENT,
            )
        cfg = cls(**opts)
        for name in ("head_dim", "page_size", "max_workers"):
            val = getattr(cfg, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                bad_type = isinstance(val, bool) or not isinstance(val, int)
                raise UnsupportedConfigError(
                    f"kvcodec serde option {name} must be an int >= 1; got {val!r}",
                    reason=Reason.BAD_TYPE if bad_type else Reason.BAD_VALUE,
                )
        scope = resolve_scope(cfg.scope)
        if scope not in COMPUTED_SCOPES:
            raise UnsupportedConfigError(
                f"kvcodec serde scope {cfg.scope!r}: expected per_page_head, per_layer_head or per_tensor",
                reason=Reason.BAD_SCOPE,
            )
        if not isinstance(cfg.model, str) or "@" in cfg.model:
            raise UnsupportedConfigError(
                f"kvcodec serde model must be a string without '@'; got {cfg.model!r}", reason=Reason.BAD_HASH
            )
        return cfg

    def hashes_for(self, lay: ObjectLayout) -> Hashes:
        """The identity written into (and, strictly, expected from) a blob of one object of ``lay``.

        ``kv_layout`` names the object's split ``[2, L, T, H*D]``, its dtype and the V scale
        grouping, so a blob loads only into an object shaped, and configured, as the one it came from.
        """
        dtype = str(lay.dtype).removeprefix("torch.")
        tag = (
            f"{KV_LAYOUT_PREFIX}:[2,{lay.layers},{lay.tokens},{lay.heads}*{lay.head_dim}]:{dtype}"
            f":{resolve_scope(self.scope).name.lower()}/{self.page_size}"
        )
        return Hashes(model_id=self.model, kv_layout=tag)


_MAX_OBJECT_BYTES = 1 << 40
"""Largest object served (1 TiB): far above any KV chunk, and keeps every size an exact int64."""


@dataclass(frozen=True)
class ObjectLayout:
    """What shapes one LMCache object: ``[2, layers, tokens, heads * head_dim]`` of ``dtype``."""

    layers: int
    tokens: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (2, self.layers, self.tokens, self.heads * self.head_dim)

    @property
    def nbytes(self) -> int:
        return 2 * self.layers * self.tokens * self.heads * self.head_dim * self.dtype.itemsize


def _dims(shape: Any) -> tuple[int, ...]:
    """The dims of a declared shape as ints >= 1; anything else is refused."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise UnsupportedConfigError(
            f"the kvcodec serde needs an object's shape as a sequence of ints; got {shape!r}",
            reason=Reason.BAD_TYPE,
        )
    try:
        if any(isinstance(d, bool) for d in shape):
            raise TypeError("bool")
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise UnsupportedConfigError(
            f"shape {shape!r} has a non-integer dim", reason=Reason.BAD_TYPE
        ) from None
    if any(d < 1 for d in dims):
        raise UnsupportedConfigError(f"shape {list(dims)} has a dim < 1", reason=Reason.BAD_SHAPE)
    return dims


def object_layout(shape: Any, dtype: Any, head_dim: int) -> ObjectLayout:
    """The layout of a ``[2, L, T, H*D]`` object; :class:`UnsupportedConfigError` for anything else."""
    dims = _dims(shape)
    if len(dims) != 4 or dims[0] != 2:
        kind = " (an MLA latent cache?)" if len(dims) == 3 else ""
        raise UnsupportedConfigError(
            f"the kvcodec serde serves KV objects shaped [2, num_layers, tokens, heads*head_dim]; got {list(dims)}{kind}",
            reason=Reason.BAD_SHAPE,
        )
    if not isinstance(dtype, torch.dtype) or dtype not in _KV_DTYPES:
        raise UnsupportedConfigError(
            f"the kvcodec serde serves float16, bfloat16 or float32 KV; got {dtype}",
            reason=Reason.UNSUPPORTED_DTYPE,
        )
    _, layers, tokens, hd = dims
    if hd % head_dim:
        raise UnsupportedConfigError(
            f"last dim {hd} is not a multiple of the configured head_dim {head_dim}", reason=Reason.BAD_SHAPE
        )
    lay = ObjectLayout(layers, tokens, hd // head_dim, head_dim, dtype)
    if lay.nbytes > _MAX_OBJECT_BYTES:
        raise UnsupportedConfigError(
            f"an object of shape {list(dims)} ({lay.nbytes} bytes) exceeds 1 TiB",
            reason=Reason.LIMIT_EXCEEDED,
        )
    return lay


def _single(shapes: Any, dtypes: Any) -> tuple[Any, Any]:
    if not isinstance(shapes, (list, tuple)) or not isinstance(dtypes, (list, tuple)):
        raise UnsupportedConfigError(
            f"an object's shapes and dtypes must be lists; got {shapes!r}, {dtypes!r}", reason=Reason.BAD_TYPE
        )
    if len(shapes) != 1 or len(dtypes) != 1:
        raise UnsupportedConfigError(
            f"the kvcodec serde serves single-group objects; got {len(shapes)} groups",
            reason=Reason.BAD_SHAPE,
        )
    return shapes[0], dtypes[0]


class _Codec:
    """What serializer and deserializer share: the config, and per layout the identity and exact size."""

    def __init__(self, cfg: KvcodecSerdeConfig) -> None:
        self.cfg = cfg
        self._specs: dict[ObjectLayout, tuple[kvcodec.EncodeSpec, int]] = {}

    def layout(self, obj_or_desc: Any) -> ObjectLayout:
        """The layout of a memory object (``get_shapes``/``get_dtypes``) or a ``MemoryLayoutDesc``."""
        if hasattr(obj_or_desc, "get_shapes"):
            shapes, dtypes = obj_or_desc.get_shapes(), obj_or_desc.get_dtypes()
        else:
            shapes, dtypes = getattr(obj_or_desc, "shapes", None), getattr(obj_or_desc, "dtypes", None)
        return object_layout(*_single(shapes, dtypes), self.cfg.head_dim)

    def spec(self, lay: ObjectLayout) -> tuple[kvcodec.EncodeSpec, int]:
        """The encode options of one object of ``lay`` and its blob's exact size (no data needed)."""
        got = self._specs.get(lay)
        if got is None:
            spec = kvcodec.EncodeSpec(
                scope=self.cfg.scope,
                page_size=self.cfg.page_size,
                hashes=self.cfg.hashes_for(lay),
                version=1,
                chunk_id=-1,
                layer_id=-1,
            )
            ghost = torch.empty((), dtype=lay.dtype).expand(lay.layers * lay.tokens, lay.heads, lay.head_dim)
            got = self._specs[lay] = (spec, kvcodec.encoded_size(ghost, ghost, spec))
        return got


def _tensor(obj: Any, what: str, nbytes: int, *, at_least: bool = False) -> torch.Tensor:
    """``obj``'s tensor on CPU holding ``nbytes`` (or, with ``at_least``, no fewer)."""
    t = getattr(obj, "tensor", None)
    if not isinstance(t, torch.Tensor):
        raise UnsupportedConfigError(
            f"the kvcodec serde needs the {what} memory object's tensor; it has {t!r}", reason=Reason.BAD_TYPE
        )
    if t.device.type != "cpu":
        raise UnsupportedConfigError(
            f"the kvcodec serde works on CPU memory objects; the {what} is on {t.device}",
            reason=Reason.BAD_DEVICE,
        )
    have = t.numel() * t.element_size()
    if have < nbytes or (have != nbytes and not at_least):
        need = f"{'at least ' if at_least else ''}{nbytes}"
        raise UnsupportedConfigError(
            f"the {what} memory object holds {have} bytes; its layout needs {need}",
            reason=Reason.BAD_OUTPUT if what == "destination" else Reason.BAD_SHAPE,
        )
    return t


def _as(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous tensor's bytes reinterpreted as ``dtype`` of ``shape`` (a view, never a copy)."""
    n = math.prod(shape) * dtype.itemsize
    return t.reshape(-1).view(torch.uint8)[:n].view(dtype).view(shape)


class KvcodecSerializer(Serializer):
    """LMCache KV object -> one LMCKV v1 blob, written in place into the destination buffer."""

    def __init__(self, cfg: KvcodecSerdeConfig) -> None:
        self._c = _Codec(cfg)

    def serialize(self, src: Any, dst: Any, key: Any = None) -> int:
        """Encode ``src`` into ``dst``; returns the bytes written (the exact estimate)."""
        lay = self._c.layout(src)
        spec, size = self._c.spec(lay)
        x = _tensor(src, "source", lay.nbytes)
        x = x if x.is_contiguous() else x.contiguous()  # read side: a copy reads the same values
        kv = _as(x, lay.dtype, (2, lay.layers * lay.tokens, lay.heads, lay.head_dim))
        out_t = _tensor(dst, "destination", size, at_least=True)
        if not out_t.is_contiguous():  # a reshape would copy, and the blob would land in the copy
            raise UnsupportedConfigError(
                "the kvcodec serde writes blobs into contiguous destination memory only",
                reason=Reason.BAD_OUTPUT,
            )
        out = _as(out_t, torch.uint8, (size,))
        n = len(kvcodec.encode(kv[0], kv[1], spec, out=out.numpy()))
        if n < size:  # never with today's layouts; 0.5.6's fs adapter reads back exactly the estimate
            out[n:].zero_()
        return size

    def estimate_serialized_size(self, layout_desc: Any) -> int:
        """The exact blob size of one object of ``layout_desc``."""
        return self._c.spec(self._c.layout(layout_desc))[1]


class KvcodecDeserializer(Deserializer):
    """One LMCKV blob -> LMCache KV object: K bit-exact, V dequantized to the object's dtype."""

    def __init__(self, cfg: KvcodecSerdeConfig) -> None:
        self._c = _Codec(cfg)

    def deserialize(self, src: Any, dst: Any, key: Any = None) -> None:
        """Decode ``src``'s blob into ``dst``; a blob of another identity raises CodecMismatchError.

        The identity is strict: the blob must carry this object's layout tag (and the model, when
        one is configured), so a blob of another model, split or codec setting never loads.
        """
        lay = self._c.layout(dst)
        t = _tensor(dst, "destination", lay.nbytes)
        blob_t = getattr(src, "tensor", None)
        if not isinstance(blob_t, torch.Tensor) or blob_t.device.type != "cpu":
            raise UnsupportedConfigError(
                f"the kvcodec serde reads blobs from CPU memory objects; got {blob_t!r}",
                reason=Reason.BAD_BUFFER,
            )
        blob = blob_t.contiguous().reshape(-1).view(torch.uint8)
        target = t if t.is_contiguous() else torch.empty(lay.shape, dtype=lay.dtype)
        kv = _as(target, lay.dtype, (2, lay.layers * lay.tokens, lay.heads, lay.head_dim))
        kvcodec.decode(
            blob.numpy(),
            out_k=kv[0],
            out_v=kv[1],
            expected_hashes=self._c.cfg.hashes_for(lay),
            strict_hashes=True,
        )
        if target is not t:  # a strided destination is filled through a contiguous copy
            t.copy_(_as(target, t.dtype, tuple(t.shape)))


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
