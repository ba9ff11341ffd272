"""The connector's fused path: every layer of a chunk in one Triton launch, saved and loaded.

The per-layer path (:mod:`.chunks`) gathers one layer's chunk into a staging
tensor, encodes it, and decodes + scatters it back, layer by layer. On CUDA
caches :class:`FusedLayers` does a chunk of all layers at once with
:mod:`kvcodec.kernels.vllm_triton`:

* save: one ``ChunkEncoder.launch`` (gather + encode of every layer straight
  from the cache views into a host buffer) and one ``wait`` (headers packed
  from one template); the blobs are byte-identical to
  :func:`~.chunks.encode_chunk`'s, identity suffix ``|dk=..,dv=..`` included.
* load: :meth:`FusedLayers.prepare` checks each blob (already parsed and
  CRC-checked once, by the store read) on the host as the per-layer path
  checks it (identity hashes, ids, geometry; the same ``CodecError``
  subclasses), off the step; :meth:`FusedLayers.load` sends the payloads to
  the device in one copy and one ``decode_scatter_layers`` writes every
  layer, parsing nothing again. Blobs the kernels cannot decode go to the
  one per-layer path (:func:`~.chunks.read_chunk`, :func:`~.chunk_writes.write_chunk`).

Served: 16- and 32-bit float caches (fp16, bf16, fp32) with
``head_size == head_size_v``, every layer the same shape, strides, dtype and
device, CUDA (or CPU under ``TRITON_INTERPRET=1``, for tests). A partial
load (vLLM computed the chunk's first ``skip`` tokens already; they stay
untouched) decodes the tail of each payload (K, codes, and the scales of
whole pages from ``skip`` on) as a blob of those tokens. The kernels address
whole blocks from a block boundary, so chunks or tails that start mid-block,
and tails that split a per_page_head scale page, are left to the per-layer
path; so are blobs the kernels cannot decode (scale dtype other than fp32,
external scopes, layers of one chunk with different scopes).

Triton is imported only when a :class:`FusedLayers` is built; importing this
module imports neither Triton nor vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcodec import ParsedBlob, Reason, ScaleScope, UnsupportedConfigError, check_hashes
from kvcodec.codec import resolve_scope, to_torch
from kvcodec.env import triton_interpret
from kvcodec.format import COMPUTED_SCOPES, Hashes, HeaderPacker
from kvcodec.format.geometry import geometry, is_plain, sections_from
from kvcodec.numerics import FP8_DTYPES

from .chunks import ChunkCodec, blob_identity, check_ids, check_k_exact

__all__ = ["FUSED_MODES", "Eligibility", "FusedChunk", "FusedLayers", "eligibility"]

FUSED_MODES = ("auto", "on", "off")
"""``auto``: CUDA caches that qualify; ``on``: required (CPU caches run in Triton's interpreter); ``off``."""

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PREFIX_HASH_LEN = 32
"""Hex digits of a connector chunk's prefix hash (:func:`~.keys.prefix_hashes`)."""


@dataclass(frozen=True)
class Eligibility:
    """Whether the fused path serves a model's caches, and why (logged once at registration)."""

    ok: bool
    reason: str


# ----------------------------------------------------------------------------
# Eligibility
# ----------------------------------------------------------------------------


def _interpret_env() -> bool:
    return triton_interpret()


def _cache_refusal(views: Sequence[torch.Tensor], cc: ChunkCodec) -> str | None:
    """Why these layer views cannot take the fused kernels (None: they can)."""
    if not views:
        return "no layer caches registered"
    x0 = views[0]
    if cc.fp8 is not None or x0.element_size() == 1:
        return f"{x0.dtype} cache: FP8 caches keep V quantized already (the per-layer path passes it through)"
    if x0.dtype not in _DTYPES:
        return f"cache dtype {x0.dtype}: the kernels serve float16, bfloat16 and float32 caches"
    if x0.dim() != 4 or x0.shape[3] != 2 * cc.head_size:
        return f"view {tuple(x0.shape)}: the kernels need head_size == head_size_v (C = 2 x {cc.head_size})"
    for x in views[1:]:
        if (x.shape, x.stride(), x.dtype, x.device) != (x0.shape, x0.stride(), x0.dtype, x0.device):
            return "the layers' views differ in shape, strides, dtype or device"
    if cc.block_size % x0.shape[2]:
        return f"block_size {cc.block_size} is not a multiple of the views' {x0.shape[2]} slots per block"
    if resolve_scope(cc.scope) not in COMPUTED_SCOPES:
        return f"scope {cc.scope}: the kernels compute per_tensor, per_layer_head and per_page_head scales"
    return None


def _device_refusal(device: torch.device, mode: str) -> str | None:
    """Why the kernels cannot run on ``device`` in this process (None: they can)."""
    from kvcodec.kernels import triton_installed

    if not triton_installed():
        return "Triton is not installed (pip install kvcodec[triton])"
    from kvcodec.kernels.launch import INTERPRET  # torch only: does not import Triton

    if device.type == "cuda":
        if INTERPRET or _interpret_env():
            return "TRITON_INTERPRET is set: the kernels would run in the interpreter, not on the GPU"
        return None
    if device.type != "cpu":
        return f"{device.type} caches: the kernels run on CUDA"
    if mode != "on":
        return 'CPU caches: the kernels need CUDA (fused="on" runs them in Triton\'s interpreter, for tests)'
    if not (INTERPRET and _interpret_env()):
        return "CPU caches need Triton's interpreter: set TRITON_INTERPRET=1 in the engine's environment"
    return None


def eligibility(caches: Mapping[str, torch.Tensor], cc: ChunkCodec, mode: str = "auto") -> Eligibility:
    """Whether :class:`FusedLayers` can serve these caches in this mode (nothing is imported but Triton's spec)."""
    if mode not in FUSED_MODES:
        raise UnsupportedConfigError(
            f"fused must be one of {list(FUSED_MODES)}; got {mode!r}", reason=Reason.BAD_VALUE
        )
    if mode == "off":
        return Eligibility(False, 'fused="off" in kv_connector_extra_config')
    views = list(caches.values())
    why = _cache_refusal(views, cc) or _device_refusal(views[0].device, mode)
    if why is not None:
        return Eligibility(False, why)
    return Eligibility(
        True, f"{len(views)} {views[0].dtype} layers on {views[0].device}: one launch per chunk"
    )


# ----------------------------------------------------------------------------
# Load checks (host side, as the per-layer path checks)
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """How the kernels decode a chunk's payloads (shared by every layer, or no fused load)."""

    scope: ScaleScope
    page_size: int | None
    fp8: torch.dtype


def _check_geometry(p: ParsedBlob, tokens: int, heads: int, dim: int, dtype: torch.dtype) -> None:
    """Refuse a blob this cache cannot take, with the errors :func:`~.chunks.decode_chunk` raises."""
    h = p.header
    if to_torch(h.v_dtype) not in FP8_DTYPES:
        raise UnsupportedConfigError(
            f"blob's V dtype {h.v_dtype} is not FP8; this codec writes FP8 V", reason=Reason.UNSUPPORTED_DTYPE
        )
    if not h.k_payload_len and h.v_payload_len:
        raise UnsupportedConfigError(
            "the blob holds no K; a vLLM cache needs both K and V", reason=Reason.MISSING_ARGUMENT
        )
    g = geometry(h)
    shape = g.v_shape if g is not None else (h.v_payload_len,)
    if shape != (tokens, heads, dim):
        raise UnsupportedConfigError(
            f"the blob holds {shape}; this cache needs ({tokens}, {heads}, {dim})", reason=Reason.BAD_SHAPE
        )
    check_k_exact(to_torch(h.k_dtype), dtype)


def _plan(p: ParsedBlob) -> _Plan | None:
    """The kernels' decode of one checked blob (:func:`_check_geometry`: of this cache's tokens and
    heads), or None when only the per-layer path decodes it: a blob that is not plain."""
    h = p.header
    if not is_plain(h):
        return None
    ps = h.page_size if h.scale_scope == ScaleScope.PER_PAGE_HEAD else None
    return _Plan(h.scale_scope, ps, to_torch(h.v_dtype))


# ----------------------------------------------------------------------------
# The fused path
# ----------------------------------------------------------------------------


class FusedLayers:
    """One model's layer caches, saved and loaded a whole chunk (every layer) per kernel launch.

    Build it with :meth:`build` at ``register_kv_caches``. Blobs returned by
    :meth:`save` are views of a reused host buffer: valid until the next save.
    """

    def __init__(
        self, caches: Mapping[str, torch.Tensor], layer_ids: Mapping[str, int], cc: ChunkCodec
    ) -> None:
        from kvcodec.codec.chunk_blobs import ChunkEncoder
        from kvcodec.kernels import operands, vllm_triton  # imports Triton

        self._vt, self._qt = vllm_triton, operands
        self.names = sorted(caches, key=lambda n: layer_ids[n])
        """Layer names in the kernels' layer order (by layer id)."""
        self.cc = cc
        self.hashes = blob_identity(cc, cc.head_size, cc.head_size)
        self.layer_ids = [layer_ids[n] for n in self.names]
        self.views = vllm_triton.prepare_views([caches[n] for n in self.names], cc.head_size)
        self.encoders = {
            bound: ChunkEncoder(
                self.views,
                head_size=cc.head_size,
                scope=resolve_scope(cc.scope),
                page_size=cc.page_size,
                version=cc.version,
                hashes=self._hashes("0" * PREFIX_HASH_LEN if bound else ""),
                layer_ids=self.layer_ids,
                block_size=cc.block_size,
            )
            for bound in (False, True)
        }
        """Without and with a prefix hash; the second's headers carry a placeholder of the real hash's
        length, so each chunk's own headers pack into the same buffer geometry."""
        self.encoder = self.encoders[False]
        self._save_host: dict[tuple[int, bool], torch.Tensor] = {}
        self._load_host: torch.Tensor | None = None
        self._load_done: Any = None
        """CUDA event: the last load's host → device copy is done (the buffer may be refilled)."""

    @classmethod
    def build(
        cls, caches: Mapping[str, torch.Tensor], layer_ids: Mapping[str, int], cc: ChunkCodec, mode: str
    ) -> tuple[FusedLayers | None, str]:
        """The fused path for these caches, or None with the reason; ``mode="on"`` raises instead of None."""
        el = eligibility(caches, cc, mode)
        fused = None
        if el.ok:
            try:
                fused = cls(caches, layer_ids, cc)
            except UnsupportedConfigError as e:
                el = Eligibility(False, str(e))
        if fused is None and mode == "on":
            raise UnsupportedConfigError(
                f'fused="on" but the fused path cannot serve these caches: {el.reason}',
                reason=Reason.UNSUPPORTED,
            )
        return fused, el.reason

    @property
    def device(self) -> torch.device:
        return self.views.device

    def serves(self, start: int, skip: int = 0) -> bool:
        """Whether a chunk starting at request token ``start`` (loading from ``start + skip``) is fused:
        both block-aligned, since the kernels write whole blocks from the first token on. vLLM's own
        prefix-cache hits end on a block boundary, so partial loads usually qualify."""
        bs = self.cc.block_size
        return start % bs == 0 and skip % bs == 0

    # ------------------------------------------------------------ save

    def _host_buffer(self, tokens: int, bound: bool) -> torch.Tensor:
        buf = self._save_host.get((tokens, bound))
        if buf is None:
            buf = self._save_host[tokens, bound] = self.host_buffer(tokens, bound)
        return buf

    def _hashes(self, chunk_hash: str) -> dict[str, str]:
        return blob_identity(self.cc, self.cc.head_size, self.cc.head_size, chunk_hash)

    def save(
        self, block_ids: Sequence[int], chunk: int, chunk_size: int, chunk_hash: str = ""
    ) -> list[tuple[str, memoryview]]:
        """Blobs of chunk ``chunk`` of every layer, as ``(layer name, blob)``; NaN/Inf in V raises.

        The blobs are views of a reused host buffer: valid until the next save."""
        return list(zip(self.names, self.launch(block_ids, chunk, chunk_size, chunk_hash).wait()))

    def launch(
        self,
        block_ids: Sequence[int],
        chunk: int,
        chunk_size: int,
        chunk_hash: str = "",
        out: torch.Tensor | None = None,
        stream: Any = None,
    ) -> Any:
        """Start the gather+encode of a chunk into ``out`` (a fresh host buffer from :meth:`host_buffer`;
        default: the reused one) on ``stream`` (CUDA; default: the current one); the returned pending
        chunk's ``wait()`` (any thread) waits for its event and seals the blobs."""
        if len(chunk_hash) not in (0, PREFIX_HASH_LEN):
            raise UnsupportedConfigError(
                f"chunk_hash must be {PREFIX_HASH_LEN} characters; got {chunk_hash!r}", reason=Reason.BAD_HASH
            )
        bound = bool(chunk_hash)
        buf = self._host_buffer(chunk_size, bound) if out is None else out
        pending = self.encoders[bound].launch(
            block_ids, num_tokens=chunk_size, chunk_id=chunk, out=buf, start=chunk * chunk_size, stream=stream
        )
        if bound:
            header = dataclasses.replace(
                pending.packer.header, hashes=Hashes.coerce(self._hashes(chunk_hash))
            )
            pending.packer = HeaderPacker(header)
        return pending

    def host_buffer(self, chunk_size: int, bound: bool = True) -> torch.Tensor:
        """A new host buffer for :meth:`launch` (pinned on CUDA), owned by the caller; ``bound``: for
        chunks with a prefix hash."""
        return self.encoders[bound].host_buffer(chunk_size, pin=self.device.type == "cuda")

    # ------------------------------------------------------------ load

    def check(
        self, p: ParsedBlob, tokens: int, chunk_hash: str = "", ids: tuple[int, int] | None = None
    ) -> None:
        """Verify one layer's parsed, CRC-checked blob as the per-layer load does (identity, ids,
        geometry); it is not parsed again."""
        check_hashes(p.header.hashes, self._hashes(chunk_hash), strict=True)
        if ids is not None:
            check_ids(p.header.layer_id, p.header.chunk_id, *ids)
        _check_geometry(p, tokens, self.views.heads, self.cc.head_size, self.views.dtype)

    def prepare(
        self,
        parsed: Mapping[str, ParsedBlob],
        chunk: int,
        chunk_size: int,
        skip: int = 0,
        chunk_hash: str = "",
    ) -> FusedChunk | None:
        """Check every layer's blob of chunk ``chunk`` (the per-layer path's errors, nothing
        written) and plan its one-launch load from token ``skip`` on; None when the blobs are valid
        but the kernels cannot decode them (the caller loads them layer by layer, from the same
        parsed blobs): e.g. a ``skip`` that splits a per_page_head scale page. Runs off the step."""
        rows = [parsed[n] for n in self.names]
        for p, lid in zip(rows, self.layer_ids):
            self.check(p, chunk_size, chunk_hash, (lid, chunk))
        plans = {_plan(p) for p in rows}
        if len(plans) != 1 or None in plans:
            return None
        (plan,) = plans
        if not 0 <= skip < chunk_size or (plan.page_size is not None and skip % plan.page_size):
            return None
        return FusedChunk(rows, chunk, chunk_size, skip, plan)

    def _payload_buffer(self, layers: int, stride: int) -> torch.Tensor:
        """A host ``[layers, stride]`` buffer free to fill (pinned and reused on CUDA)."""
        if self.device.type != "cuda":
            return torch.empty((layers, stride), dtype=torch.uint8)
        if self._load_done is not None:
            self._load_done.synchronize()
        buf = self._load_host
        if buf is None or buf.numel() < layers * stride:
            buf = self._load_host = torch.empty(layers * stride, dtype=torch.uint8, pin_memory=True)
        return buf[: layers * stride].view(layers, stride)

    def _upload(self, parsed: Sequence[ParsedBlob], skip: int = 0) -> torch.Tensor:
        """Every layer's payload as ``[L, payload_len]`` uint8 on the caches' device, rows 16-byte
        aligned (padded as the save side's are, so the kernels keep their 128-bit accesses).

        With ``skip``, each row is the payload of the chunk's tokens from ``skip`` on (the tail of K,
        of the codes and, per page, of the scales: :func:`~kvcodec.format.geometry.sections_from`): a blob of
        those tokens, which the kernels decode as they decode a whole chunk.
        """
        parts = [sections_from(p, skip) for p in parsed]
        n = sum(len(x) for x in parts[0])
        host = self._payload_buffer(len(parsed), self._qt.payload_stride(n))
        rows = host.numpy()
        for j, sections in enumerate(parts):
            at = 0
            for x in sections:
                rows[j, at : at + len(x)] = np.frombuffer(x, dtype=np.uint8)
                at += len(x)
        if self.device.type != "cuda":
            return host[:, :n]
        dev = host.to(self.device, non_blocking=True)  # dense [L, stride]: one copy, rows stay aligned
        self._load_done = torch.cuda.Event()
        self._load_done.record()
        return dev[:, :n]

    def load(self, fc: FusedChunk, block_ids: Sequence[int]) -> None:
        """Write a chunk :meth:`prepare` returned into every layer in one launch (nothing parsed or checked
        again); its first ``skip`` tokens stay as vLLM computed them."""
        plan = fc.plan
        self._vt.decode_scatter_layers(
            self._upload(fc.parsed, fc.skip),
            self.views,
            block_ids,
            num_tokens=fc.chunk_size - fc.skip,
            head_size=self.cc.head_size,
            scope=plan.scope,
            page_size=plan.page_size,
            fp8_dtype=plan.fp8,
            block_size=self.cc.block_size,
            start=fc.chunk * fc.chunk_size + fc.skip,
        )


@dataclass(frozen=True)
class FusedChunk:
    """A chunk's checked blobs, in :attr:`FusedLayers.names` order, and how the kernels decode them."""

    parsed: list[ParsedBlob]
    chunk: int
    chunk_size: int
    skip: int
    plan: _Plan
