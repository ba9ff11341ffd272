"""Blobs of a whole chunk, every layer at once, from cache views on the GPU: one launch, one copy, one header template.

The vLLM connector's fused save: :class:`ChunkEncoder` launches the Triton
backend's gather+encode of every layer of a chunk (payloads into a device
staging buffer laid out as the blobs will be), copies the buffer to a
caller's pinned host buffer asynchronously on a caller-given stream, and,
once the copy is done, packs every layer's header in place from one
:class:`~kvcodec.format.HeaderPacker` template (only the layer id and the
payload CRC differ between layers). The blobs are byte-identical to
``kvcodec.encode``'s of the gathered ``[T, H, D]`` tensors.

The kernels see tensors only; this module owns the blob side: headers,
buffer geometry (:class:`HostChunk`), host buffers and the NaN/Inf refusal
after the copy (:class:`PendingChunk`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends.triton import BACKEND as TRITON
from ..backends.triton import PAYLOAD_ALIGN
from ..errors import Reason, UnsupportedConfigError
from ..format import Hashes, Header, HeaderPacker, ScaleScope
from ..numerics import check_layers_amax
from .encode import plan_encode
from .spec import EncodeSpec

__all__ = ["BlockIds", "ChunkEncoder", "HostChunk", "PendingChunk"]

BlockIds = Sequence[int] | torch.Tensor


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


@dataclass(frozen=True)
class _Launch:
    """One chunk's launch: its header template, buffer geometry, block table and destination."""

    packer: HeaderPacker
    geom: HostChunk
    block_ids: BlockIds
    num_tokens: int
    chunk_id: int
    out: torch.Tensor
    start: int


class ChunkEncoder:
    """Encodes chunks of one model's vLLM caches into blobs in host memory: one launch per chunk.

    Fixed per encoder: the views, scope, FP8 format, header version, hashes
    and layer ids. Per chunk, :meth:`launch` (host work: block table, one
    kernel launch, one ``copy_`` and an event) returns a :class:`PendingChunk`
    whose :meth:`~PendingChunk.wait` packs the headers after the copy.
    """

    def __init__(
        self,
        layers: Sequence[torch.Tensor] | Any,
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
        self.views = TRITON.prepare_views(layers, head_size)
        self.scope = TRITON.check_scope(scope, page_size)
        self.page_size = page_size
        self.fp8_dtype = fp8_dtype
        self.version = version
        self.hashes = Hashes.coerce(hashes)
        self.layer_ids = list(range(self.views.count)) if layer_ids is None else list(layer_ids)
        if len(self.layer_ids) != self.views.count:
            raise UnsupportedConfigError(
                f"{len(self.layer_ids)} layer_ids for {self.views.count} layers", reason=Reason.BAD_VALUE
            )
        self.block_size = block_size
        self._packers: dict[int, tuple[HeaderPacker, HostChunk]] = {}

    def header(self, num_tokens: int, *, chunk_id: int = -1, layer_id: int = -1) -> Header:
        """The header every layer's blob of a ``num_tokens`` chunk carries (ids aside), as ``kvcodec.encode`` writes it.

        Planned by the codec's own :func:`~kvcodec.codec.encode.plan_encode` over
        data-free stand-ins of the chunk's K and V (one element, expanded), so
        there is one place that builds a header from an encode's options.
        """
        cv = self.views
        stand_in = torch.zeros((), dtype=cv.dtype).expand(num_tokens, cv.heads, cv.head_size)
        spec = EncodeSpec(
            scope=self.scope,
            page_size=self.page_size,
            hashes=self.hashes,
            layer_id=layer_id,
            chunk_id=chunk_id,
            v_dtype=self.fp8_dtype,
            allow_e5m2=True,
            version=self.version,
        )
        return plan_encode(stand_in, stand_in, spec).header

    def geometry(self, num_tokens: int) -> tuple[HeaderPacker, HostChunk]:
        """The header packer and buffer geometry of a ``num_tokens`` chunk (cached)."""
        got = self._packers.get(num_tokens)
        if got is None:
            pk = HeaderPacker(self.header(num_tokens))
            got = self._packers[num_tokens] = (
                pk,
                HostChunk.of(self.views.count, pk.size, pk.header.payload_len),
            )
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
        if (
            out.dtype != torch.uint8
            or tuple(out.shape) != (g.layers, g.row_stride)
            or not out.is_contiguous()
        ):
            raise UnsupportedConfigError(
                f"out must be a contiguous uint8 [{g.layers}, {g.row_stride}] host buffer",
                reason=Reason.BAD_OUTPUT,
            )
        if out.device.type != "cpu":
            raise UnsupportedConfigError(
                f"out must be host memory; got {out.device}", reason=Reason.BAD_OUTPUT
            )
        job = _Launch(pk, g, block_ids, num_tokens, chunk_id, out, start)
        if self.views.device.type == "cuda":
            with torch.cuda.stream(stream):
                return self._launch(job, torch.cuda.Event())
        if stream is not None:
            raise UnsupportedConfigError("a stream needs CUDA views", reason=Reason.BAD_DEVICE)
        return self._launch(job, None)

    def _launch(self, job: _Launch, event: Any) -> PendingChunk:
        dev = self.views.device
        g = job.geom
        direct = TRITON.writes_host_memory(dev)  # interpreter: the kernels write ``out`` itself
        staging = job.out if direct else torch.empty((g.layers, g.row_stride), dtype=torch.uint8, device=dev)
        amax = TRITON.gather_encode_layers(
            self.views,
            job.block_ids,
            num_tokens=job.num_tokens,
            head_size=self.views.head_size,
            scope=self.scope,
            page_size=self.page_size,
            fp8_dtype=self.fp8_dtype,
            payloads=g.payload_rows(staging),
            block_size=self.block_size,
            start=job.start,
        )
        if direct:
            return PendingChunk(self, g, job.packer, job.chunk_id, job.out, amax, None)
        amax_host = torch.empty(amax.shape, dtype=amax.dtype, pin_memory=dev.type == "cuda")
        _copy_async(amax_host, amax)
        _copy_async(job.out, staging)
        if event is not None:
            event.record()
        return PendingChunk(self, g, job.packer, job.chunk_id, job.out, amax_host, event, (staging, amax))


def _copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Device → pinned host copy on the current stream (a stub point for host-overhead timing)."""
    dst.copy_(src, non_blocking=True)
