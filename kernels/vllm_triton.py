"""Fused kvcodec encode/decode over vLLM 0.33 KV-cache views: every layer of a chunk in one launch.

vLLM 0.33 hands a connector one view per attention layer, logically
``[num_blocks, H, block_size, C]`` with ``C = head_size + head_size_v`` (K is
``C[..., :head_size]``, V is ``C[..., head_size:]``), over any of
``KVCacheLayout``'s physical orders (``LBNHC``, ``LBHNC``, ``BLHNC``,
``BLNHC``, ``BHLNC``, ``LHBNC``), often several layers in one allocation.
The fused kernels of :mod:`kvcodec.kernels.quant_triton` already address
their operands by (block, slot, head, channel) strides through a block
table, and layers by a uniform stride or an offset table, so these views are
read and written in place, whatever the order: no staging copy.

* :func:`gather_encode_layers`: chunk tokens of every layer → each layer's
  LMCKV payload ``K ‖ FP8(V) ‖ scales`` (bit-exact with ``kvcodec.encode`` of
  the gathered ``[T, H, D]`` tensors); one launch (two for two-stage scopes).
* :func:`decode_scatter_layers`: each layer's payload → the chunk's blocks
  (bit-exact with ``kvcodec.decode(out_v_dtype=cache dtype)`` + a scatter; a
  NaN code, which kvcodec never writes, decodes to NaN either way, not always
  with the same NaN bits).
* :class:`ChunkEncoder`: the connector's host side. Per chunk: one launch,
  one asynchronous device→host copy of all payloads into a caller's (pinned)
  buffer on a caller-given stream, and after the copy the 32 headers packed
  from one :class:`~kvcodec.format.HeaderPacker` template, in place.

Token ``t`` of a chunk is slot ``t % block_size`` of block
``block_ids[t // block_size]``; the last block may be partly used. ``start``
(the chunk's first request token) must be a multiple of ``block_size``.
Only ``head_size == head_size_v`` is supported, and fp16/bf16/fp32 caches
(an FP8 cache already holds quantized V: copy it instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UnsupportedConfigError
from ..format import Hashes, Header, HeaderPacker, ScaleScheme, ScaleScope
from ..numerics import check_layers_amax, scale_shape
from ._launch import is_recording
from .quant_triton import (
    K_ELEM_VIEW,
    PAYLOAD_ALIGN,
    V_DTYPES,
    Strategy,
    _check_device,
    _check_scope,
    _decode_core,
    _encode_core,
    _listed,
    _out_kind,
    _payload_bytes,
    _payload_layers,
    _Rows,
    _same_layout,
)

__all__ = [
    "CacheViews",
    "ChunkEncoder",
    "HostChunk",
    "PendingChunk",
    "decode_scatter_layers",
    "gather_encode_layers",
    "prepare_views",
]

BlockIds = Sequence[int] | torch.Tensor


# ----------------------------------------------------------------------------
# Views
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheViews:
    """Kernel addressing of a model's vLLM layer views, built once (e.g. at ``register_kv_caches``).

    Passing it instead of the list of views skips per-chunk validation and
    layer-offset discovery.
    """

    k: _Rows
    """K: ``C[..., :head_size]`` of every layer (as same-width integers)."""
    v: _Rows
    """V: ``C[..., head_size:]`` of every layer (bf16 as int16 bits)."""
    count: int
    num_blocks: int
    heads: int
    block_size: int
    """Token slots per block of the views (vLLM's kernel block)."""
    head_size: int
    dtype: torch.dtype
    device: torch.device


def _check_views(views: Sequence[torch.Tensor], head_size: int) -> torch.Tensor:
    if not views:
        raise UnsupportedConfigError("no layer views given")
    x0 = views[0]
    if not isinstance(x0, torch.Tensor) or x0.dim() != 4:
        raise UnsupportedConfigError(
            f"a vLLM layer view is 4-D [num_blocks, H, block_size, C]; got {getattr(x0, 'shape', type(x0))}"
        )
    _same_layout(views, "layer views")
    c = x0.shape[3]
    if isinstance(head_size, bool) or not isinstance(head_size, int) or not 0 < head_size < c:
        raise UnsupportedConfigError(f"head_size={head_size!r} must leave room for V in C={c}")
    if c != 2 * head_size:
        raise UnsupportedConfigError(
            f"C={c} holds head_size={head_size} and head_size_v={c - head_size}: the fused vLLM "
            "kernels need head_size == head_size_v (encode K and V separately otherwise)"
        )
    if x0.dtype not in V_DTYPES:
        raise UnsupportedConfigError(
            f"cache dtype {x0.dtype} is not fp16/bf16/fp32; an FP8 cache holds V quantized already"
        )
    return x0


def _rows(views: Sequence[torch.Tensor], view: torch.dtype | None) -> _Rows:
    """Paged rows of ``[num_blocks, H, block_size, D]`` views: (slot, head, channel, block) strides."""
    lay = _listed(views, view)
    sb, sh, st, sd = views[0].stride()
    return _Rows(lay, st, sh, sd, sb)


def prepare_views(layers: Sequence[torch.Tensor], head_size: int) -> CacheViews:
    """Validate vLLM 0.33 layer views once and build their kernel addressing."""
    views = list(layers)
    x0 = _check_views(views, head_size)
    _check_device(x0)
    kb = x0.element_size()
    ks = [x[..., :head_size] for x in views]
    vs = [x[..., head_size:] for x in views]
    vview = torch.int16 if x0.dtype == torch.bfloat16 else None
    nb, h, bs, _ = x0.shape
    return CacheViews(_rows(ks, K_ELEM_VIEW[kb]), _rows(vs, vview), len(views), nb, h, bs, head_size,
                      x0.dtype, x0.device)  # fmt: skip


def _as_views(layers: Sequence[torch.Tensor] | CacheViews, head_size: int) -> CacheViews:
    if isinstance(layers, CacheViews):
        if layers.head_size != head_size:
            raise UnsupportedConfigError(f"views prepared for head_size={layers.head_size}, not {head_size}")
        return layers
    return prepare_views(layers, head_size)


def _block_table(
    cv: CacheViews, block_ids: BlockIds, num_tokens: int, block_size: int | None, start: int, distinct: bool
) -> tuple[torch.Tensor, int]:
    """The chunk's view-block ids on the device, and the view's tokens per block.

    ``block_size`` (the scheduler's block) may be a multiple of the view's
    (vLLM splits scheduler blocks into kernel blocks): ids are expanded.
    """
    kbs = cv.block_size
    bs = kbs if block_size is None else int(block_size)
    if bs < 1 or bs % kbs:
        raise UnsupportedConfigError(f"block_size={block_size} is not a multiple of the views' {kbs} slots per block")
    if num_tokens < 0 or start < 0:
        raise UnsupportedConfigError(f"num_tokens and start must be >= 0; got {num_tokens}, {start}")
    if start % bs:
        raise UnsupportedConfigError(
            f"start={start} is not a multiple of block_size={bs}: the fused path needs block-aligned chunks"
        )
    ratio = bs // kbs
    first, need = start // bs, -(-num_tokens // bs)
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
            raise UnsupportedConfigError(f"block_ids must be 1-D int32/int64; got {block_ids.dim()}-D {block_ids.dtype}")
        if block_ids.device.type != "cpu" and ratio == 1:
            ids_dev = block_ids[first : first + need]
            if ids_dev.numel() < need:
                raise UnsupportedConfigError(f"{num_tokens} tokens need {need} block ids; got {ids_dev.numel()}")
            return ids_dev.to(device=cv.device, dtype=torch.int64).contiguous(), kbs
        ids = [int(i) for i in block_ids.tolist()]
    else:
        ids = list(block_ids)
    used = ids[first : first + need]
    if len(used) < need:
        raise UnsupportedConfigError(f"{num_tokens} tokens at block_size {bs} need {need} block ids; got {len(used)}")
    nb = cv.num_blocks // ratio
    if used and (min(used) < 0 or max(used) >= nb):
        raise UnsupportedConfigError(f"block ids span {min(used)}..{max(used)}; the cache has {nb} blocks")
    if distinct and len(set(used)) != len(used):
        raise UnsupportedConfigError(f"block ids repeat: {used[:16]}; a chunk's blocks are distinct")
    if ratio > 1:
        used = [b * ratio + j for b in used for j in range(ratio)]
    t = torch.tensor(used or [0], dtype=torch.int64)
    if cv.device.type == "cuda":
        t = t.pin_memory()
    return t.to(cv.device, non_blocking=True), kbs


# ----------------------------------------------------------------------------
# Encode / decode
# ----------------------------------------------------------------------------


def gather_encode_layers(
    layers: Sequence[torch.Tensor] | CacheViews,
    block_ids: BlockIds,
    *,
    num_tokens: int,
    head_size: int,
    scope: ScaleScope,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    payloads: Sequence[torch.Tensor] | torch.Tensor,
    block_size: int | None = None,
    start: int = 0,
    strategy: Strategy = "auto",
) -> torch.Tensor:
    """Encode one chunk of every layer straight from vLLM views; return the group absmax ``[L, *scale_shape]``.

    ``block_ids``: the request's block table (scheduler blocks); the chunk's
    are ``block_ids[start // block_size:]``. A list is range-checked here; ids
    already on the GPU are not (that would cost a sync).

    ``payloads``: ``[L, payload_len]`` uint8 (rows may be padded, e.g.
    :func:`~kvcodec.kernels.quant_triton.empty_payloads`) or one 1-D tensor
    per layer. NaN/Inf in the absmax means that layer's blob must be refused.
    No device sync.
    """
    cv = _as_views(layers, head_size)
    scope = _check_scope(scope, page_size)
    ids, kbs = _block_table(cv, block_ids, num_tokens, block_size, start, distinct=False)
    kb = cv.dtype.itemsize
    pl = _payload_layers(payloads, _payload_bytes(num_tokens, cv.heads, head_size, kb, scope, page_size))
    if pl.count != cv.count:
        raise UnsupportedConfigError(f"{cv.count} layer views but {pl.count} payloads")
    _check_device(cv.k.layers.base, pl.base)
    return _encode_core(
        cv.k, cv.v, pl, tokens=num_tokens, heads=cv.heads, dim=head_size, kb=kb,
        v_bf16=cv.dtype == torch.bfloat16, scope=scope, page_size=page_size, fp8_dtype=fp8_dtype,
        strategy=strategy, table=ids, block_size=kbs,
    )  # fmt: skip


def decode_scatter_layers(
    payloads: Sequence[torch.Tensor] | torch.Tensor,
    layers: Sequence[torch.Tensor] | CacheViews,
    block_ids: BlockIds,
    *,
    num_tokens: int,
    head_size: int,
    scope: ScaleScope,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    block_size: int | None = None,
    start: int = 0,
) -> None:
    """Decode each layer's payload straight into the chunk's blocks of its view (one launch).

    K is copied bit for bit (the payload's K dtype must be the cache dtype);
    V is dequantized to the cache dtype. Other slots are untouched.
    """
    cv = _as_views(layers, head_size)
    scope = _check_scope(scope, page_size)
    ids, kbs = _block_table(cv, block_ids, num_tokens, block_size, start, distinct=True)
    kb = cv.dtype.itemsize
    pl = _payload_layers(payloads, _payload_bytes(num_tokens, cv.heads, head_size, kb, scope, page_size))
    if pl.count != cv.count:
        raise UnsupportedConfigError(f"{pl.count} payloads but {cv.count} layer views")
    _check_device(cv.k.layers.base, pl.base)
    _decode_core(
        pl, cv.k, cv.v, tokens=num_tokens, heads=cv.heads, dim=head_size, kb=kb,
        out_kind=_out_kind(cv.dtype), scope=scope, page_size=page_size, fp8_dtype=fp8_dtype,
        table=ids, block_size=kbs,
    )  # fmt: skip


# ----------------------------------------------------------------------------
# Host side: one launch, one async copy, headers from one template
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HostChunk:
    """Geometry of a chunk's blobs in one ``[L, row_stride]`` uint8 buffer (device staging and host).

    Row ``l`` holds layer ``l``'s blob at ``[offset, offset + blob_len)``;
    the header is padded in front so that each payload starts 16 bytes
    aligned (the kernels' 128-bit stores) and rows are 16-byte multiples.
    """

    layers: int
    header_len: int
    payload_len: int
    offset: int
    row_stride: int

    @classmethod
    def of(cls, layers: int, header_len: int, payload_len: int) -> HostChunk:
        off = -header_len % PAYLOAD_ALIGN
        stride = -(-(off + header_len + payload_len) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
        return cls(layers, header_len, payload_len, off, stride)

    @property
    def blob_len(self) -> int:
        return self.header_len + self.payload_len

    @property
    def payload_offset(self) -> int:
        return self.offset + self.header_len

    def payload_rows(self, buf: torch.Tensor) -> torch.Tensor:
        """The ``[L, payload_len]`` payload view of a buffer."""
        return buf[:, self.payload_offset : self.payload_offset + self.payload_len]

    def blob(self, buf: memoryview, layer: int) -> memoryview:
        """Layer ``layer``'s blob bytes in a host buffer's memoryview."""
        p = layer * self.row_stride + self.offset
        return buf[p : p + self.blob_len]


@dataclass
class PendingChunk:
    """A launched chunk: payloads on their way to the host buffer; :meth:`wait` seals the blobs."""

    encoder: ChunkEncoder
    geom: HostChunk
    packer: HeaderPacker
    chunk_id: int
    host: torch.Tensor
    amax_host: torch.Tensor
    event: Any
    keep: tuple[torch.Tensor, ...] = field(default=())
    """Device tensors the asynchronous work still reads."""

    def wait(self) -> list[memoryview]:
        """Wait for the copy, refuse NaN/Inf groups, pack the headers; return each layer's blob (views of ``host``)."""
        if self.event is not None:
            self.event.synchronize()
        self.keep = ()
        enc = self.encoder
        check_layers_amax(self.amax_host, enc.scope, enc.fp8_dtype, enc.layer_ids)
        mv = _host_view(self.host)
        g, pk = self.geom, self.packer
        blobs = []
        for j in range(g.layers):
            b = g.blob(mv, j)
            pk.pack_into(b, layer_id=enc.layer_ids[j], chunk_id=self.chunk_id, payload=b[g.header_len :])
            blobs.append(b)
        return blobs


def _host_view(buf: torch.Tensor) -> memoryview:
    return memoryview(buf.reshape(-1).numpy()).cast("B")


class ChunkEncoder:
    """Encodes chunks of one model's vLLM caches into blobs in host memory: one launch per chunk.

    Fixed per encoder: the views, scope, FP8 format, header version, hashes
    and layer ids. Per chunk, :meth:`launch` (host work: block table, one
    kernel launch, one ``copy_`` and an event) returns a :class:`PendingChunk`
    whose :meth:`~PendingChunk.wait` packs the headers after the copy.
    """

    def __init__(
        self,
        layers: Sequence[torch.Tensor] | CacheViews,
        *,
        head_size: int,
        scope: ScaleScope,
        page_size: int | None = None,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        version: int = 1,
        hashes: Hashes | dict[str, str] | None = None,
        layer_ids: Sequence[int] | None = None,
        block_size: int | None = None,
    ) -> None:
        self.views = _as_views(layers, head_size)
        self.scope = _check_scope(scope, page_size)
        self.page_size = page_size
        self.fp8_dtype = fp8_dtype
        self.version = version
        self.hashes = Hashes.coerce(hashes)
        self.layer_ids = list(range(self.views.count)) if layer_ids is None else list(layer_ids)
        if len(self.layer_ids) != self.views.count:
            raise UnsupportedConfigError(f"{len(self.layer_ids)} layer_ids for {self.views.count} layers")
        self.block_size = block_size
        self._packers: dict[int, tuple[HeaderPacker, HostChunk]] = {}

    def header(self, num_tokens: int, *, chunk_id: int = -1, layer_id: int = -1) -> Header:
        """The header every layer's blob of a ``num_tokens`` chunk carries (ids aside), as ``kvcodec.encode`` writes it."""
        cv, ps = self.views, self.page_size
        shape = scale_shape(self.scope, num_tokens, cv.heads, ps)
        elems = num_tokens * cv.heads * cv.head_size
        n_scales = 1
        for s in shape:
            n_scales *= s
        return Header(
            k_dtype=cv.dtype, v_dtype=self.fp8_dtype, scale_dtype=torch.float32, scale_scope=self.scope,
            version=self.version, scale_scheme=ScaleScheme.COMPUTED, layer_id=layer_id, chunk_id=chunk_id,
            chunk_size=num_tokens, page_size=-1 if ps is None else ps, kv_head_count=cv.heads,
            head_dim=cv.head_size, scale_shape=shape, k_payload_len=elems * cv.dtype.itemsize,
            v_payload_len=elems, scale_payload_len=4 * n_scales, hashes=self.hashes,
        )  # fmt: skip

    def geometry(self, num_tokens: int) -> tuple[HeaderPacker, HostChunk]:
        """The header packer and buffer geometry of a ``num_tokens`` chunk (cached)."""
        got = self._packers.get(num_tokens)
        if got is None:
            pk = HeaderPacker(self.header(num_tokens))
            got = self._packers[num_tokens] = (pk, HostChunk.of(self.views.count, pk.size, pk.header.payload_len))
        return got

    def host_buffer(self, num_tokens: int, *, pin: bool | None = None) -> torch.Tensor:
        """A new ``[L, row_stride]`` uint8 host buffer for a chunk (pinned when CUDA is there)."""
        g = self.geometry(num_tokens)[1]
        pin = torch.cuda.is_available() if pin is None else pin
        return torch.empty((g.layers, g.row_stride), dtype=torch.uint8, pin_memory=pin)

    def launch(
        self,
        block_ids: BlockIds,
        *,
        num_tokens: int,
        chunk_id: int,
        out: torch.Tensor,
        stream: Any = None,
        start: int = 0,
    ) -> PendingChunk:
        """Encode a chunk of every layer into ``out`` (from :meth:`host_buffer`) asynchronously.

        The kernel and the copies run on ``stream`` (a ``torch.cuda.Stream``;
        default: the current one); order it after the forward pass that wrote
        the blocks (``stream.wait_stream(...)``). ``out`` must stay untouched
        until :meth:`PendingChunk.wait` returns.
        """
        pk, g = self.geometry(num_tokens)
        if out.dtype != torch.uint8 or tuple(out.shape) != (g.layers, g.row_stride) or not out.is_contiguous():
            raise UnsupportedConfigError(f"out must be a contiguous uint8 [{g.layers}, {g.row_stride}] host buffer")
        if out.device.type != "cpu":
            raise UnsupportedConfigError(f"out must be host memory; got {out.device}")
        dev = self.views.device
        if dev.type == "cuda":
            with torch.cuda.stream(stream):
                return self._launch(pk, g, block_ids, num_tokens, chunk_id, out, start, torch.cuda.Event())
        if stream is not None:
            raise UnsupportedConfigError("a stream needs CUDA views")
        return self._launch(pk, g, block_ids, num_tokens, chunk_id, out, start, None)

    def _launch(self, pk: HeaderPacker, g: HostChunk, block_ids: BlockIds, num_tokens: int, chunk_id: int,
                out: torch.Tensor, start: int, event: Any) -> PendingChunk:  # fmt: skip
        dev = self.views.device
        direct = dev.type == "cpu" and not is_recording()  # interpreter: the kernels write ``out`` itself
        staging = out if direct else torch.empty((g.layers, g.row_stride), dtype=torch.uint8, device=dev)
        amax = gather_encode_layers(
            self.views, block_ids, num_tokens=num_tokens, head_size=self.views.head_size, scope=self.scope,
            page_size=self.page_size, fp8_dtype=self.fp8_dtype, payloads=g.payload_rows(staging),
            block_size=self.block_size, start=start,
        )  # fmt: skip
        if direct:
            return PendingChunk(self, g, pk, chunk_id, out, amax, None)
        amax_host = torch.empty(amax.shape, dtype=amax.dtype, pin_memory=dev.type == "cuda")
        _copy_async(amax_host, amax)
        _copy_async(out, staging)
        if event is not None:
            event.record()
        return PendingChunk(self, g, pk, chunk_id, out, amax_host, event, (staging, amax))


def _copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Device → pinned host copy on the current stream (a stub point for host-overhead timing)."""
    dst.copy_(src, non_blocking=True)
