"""The one interface every backend implements, and how a backend declines a request.

A backend turns V (token-major ``[tokens, heads, head_dim]``) into scales and
FP8 codes and back. It never parses, never checksums and never starts threads
(on CPU the reference keeps each torch op under torch's parallel grain).
A backend that cannot serve a particular call (a dtype, an alignment, NaN in
the data...) raises :class:`Declined`; the dispatcher in :mod:`kvcodec.backends`
then runs the reference on the same arguments and records why. A backend may
have written part of ``out`` before declining (the C loops stop at a row
holding NaN, the C encode of per_page_head V at the page holding it); the
reference then writes all of it, or raises.

Beyond the four operations, the interface declares optional lanes (:class:`Lanes`), each
offered by one backend and named in its :attr:`Backend.lanes` (asked, never probed):
``encode_fused`` / ``encode_fused_layers`` / ``empty_payloads`` (Triton: K, codes and
scales of a blob in one launch), ``encode_host`` / ``decode_host`` (cpu: a host blob's
payload in one C call, numpy views only, the CRC folded in), ``expand_dequant`` (cpu: ``decode_host``'s
dequantization carried by the call that expands a lossless payload), ``scatter_rows`` /
``scatter_blob_rows_many`` (cpu: rows straight into a paged cache view) and ``split_k_planes`` /
``merge_k_planes`` (Triton: the lossless payload's K byte planes on K's device). A lane returns
one typed result (:class:`Served` for the cpu lanes) or raises :class:`Declined`;
:func:`kvcodec.backends.call` runs it and, when it declines, the caller's own path (its
``fallback``), counted as every fallback is. Only :mod:`kvcodec.backends` catches
:class:`Declined`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from ..hostmem import copy_tensor
from ..numerics import NonFinitePolicy, ScaleScope, narrow_scales

__all__ = [
    "LANES",
    "Backend",
    "BlobRows",
    "Declined",
    "Groups",
    "Lanes",
    "NonFinitePolicy",
    "Served",
    "TwoPass",
]


class Declined(Exception):
    """Raised by a backend that cannot serve a call, with the reason; :func:`kvcodec.backends.call` then
    runs the reference (or, for a lane, the caller's fallback) and counts the reason."""


@dataclass(frozen=True)
class Served:
    """What a cpu lane returns when it wrote its outputs."""

    crc: int | None = None
    """The CRC continued from the caller's seed over the bytes the lane went through (None: no seed
    was given, or the lane did not fold it in: the caller computes it)."""


@dataclass(frozen=True)
class Groups:
    """How V's elements are grouped under one scale, and the FP8 format they are cast to."""

    scope: ScaleScope
    """PER_TENSOR, PER_LAYER_HEAD or PER_PAGE_HEAD (external scales take the scope of their shape)."""
    page_size: int | None = None
    """Tokens per page (PER_PAGE_HEAD only; a partial last page is its own group)."""
    fp8_dtype: torch.dtype = torch.float8_e4m3fn


@dataclass(frozen=True)
class BlobRows:
    """One blob's K and V codes as the cache lanes read them: numpy views, no torch."""

    k: np.ndarray
    """uint8 ``[T, H, Dk * itemsize]``: K's bytes, row by row (any alignment)."""
    codes: np.ndarray
    """uint8 ``[T, H, D]``: V's e4m3 codes."""
    scales: np.ndarray
    """float32, C-contiguous: V's scales (``groups``' shape)."""
    groups: Groups


@runtime_checkable
class Backend(Protocol):
    """Scales, FP8 codes and dequantized V, bit-exact with the reference (``backend="torch"``)."""

    name: str
    lanes: frozenset[str]
    """The optional lanes of :data:`LANES` this backend offers (its other :class:`Lanes` methods decline)."""

    def encode_v(
        self,
        v: torch.Tensor,
        groups: Groups,
        *,
        scale_dtype: torch.dtype,
        nonfinite: NonFinitePolicy,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Compute V's scales, write its FP8 codes into ``out``; return the scales as stored (``scale_dtype``).

        Quantization uses the scales after their cast to ``scale_dtype``, as LMCache does.
        """
        ...

    def encode_kv(
        self,
        k: torch.Tensor,
        k_out: torch.Tensor,
        v: torch.Tensor,
        groups: Groups,
        *,
        scale_dtype: torch.dtype,
        nonfinite: NonFinitePolicy,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """K copied bit-exact into ``k_out``, then :meth:`encode_v`: one call, so a backend can do both
        in one pass (the C loops: one GIL release per chunk)."""
        ...

    def quantize(
        self, v: torch.Tensor, scales: torch.Tensor, groups: Groups, *, out: torch.Tensor
    ) -> torch.Tensor:
        """FP8 codes of ``v / scale`` (RNE, saturating) into ``out``, with the caller's scales."""
        ...

    def dequantize(
        self, q: torch.Tensor, scales: torch.Tensor, groups: Groups, *, out: torch.Tensor
    ) -> torch.Tensor:
        """``float(q) * scale`` rounded once to ``out.dtype`` (fp16, bf16 or fp32), into ``out``."""
        ...


LANES = (
    "encode_fused",
    "encode_fused_layers",
    "empty_payloads",
    "encode_host",
    "decode_host",
    "expand_dequant",
    "scatter_rows",
    "scatter_blob_rows_many",
    "split_k_planes",
    "merge_k_planes",
)
"""Every optional lane a backend may offer (:attr:`Backend.lanes`)."""


class Lanes:
    """The optional lanes, declared once: a backend offers those named in its ``lanes`` and inherits
    these, which decline, for the rest. Arguments and results per lane are documented here."""

    name = "backend"
    lanes: frozenset[str] = frozenset()

    def _none(self, lane: str) -> Declined:
        return Declined(f"the {self.name} backend has no {lane} lane")

    def encode_fused(
        self, k: torch.Tensor, v: torch.Tensor, groups: Groups, payload: torch.Tensor
    ) -> torch.Tensor:
        """K, FP8 V and fp32 scales of one layer into ``payload`` in one launch; returns the group absmax."""
        raise self._none("encode_fused")

    def encode_fused_layers(
        self, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], groups: Groups, payloads: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`encode_fused` for every layer of a chunk in one launch; returns ``[L, *scale_shape]`` absmax."""
        raise self._none("encode_fused_layers")

    def empty_payloads(self, layers: int, nbytes: int, device: torch.device | str) -> torch.Tensor:
        """Stacked ``[layers, nbytes]`` payloads for :meth:`encode_fused_layers`."""
        raise self._none("empty_payloads")

    def encode_host(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        groups: Groups,
        payload: memoryview,
        *,
        scale_dtype: torch.dtype,
        nonfinite: NonFinitePolicy,
        crc: int | None = None,
        k_copy: bool = True,
    ) -> Served:
        """``K ‖ e4m3(V) ‖ scales`` into a host blob payload in one call; with ``crc`` (the CRC so far) the
        result's ``crc`` is it continued over the whole payload, or None when not folded in.
        ``k_copy=False``: K's bytes left unwritten (the lossless stage codes K from ``k`` itself)."""
        raise self._none("encode_host")

    def decode_host(
        self,
        payload: memoryview,
        k_len: int,
        scales: torch.Tensor,
        groups: Groups,
        out_k: torch.Tensor,
        out_v: torch.Tensor,
        *,
        crc: int | None = None,
        k_done: bool = False,
    ) -> Served:
        """A host payload's K bytes into ``out_k`` and its codes dequantized into ``out_v`` in one call; with
        ``crc`` the result's ``crc`` is it continued over K and the codes, or None when not folded in.
        ``k_done``: ``out_k`` already holds K (a lossless blob's planes merged there): the codes alone."""
        raise self._none("decode_host")

    def expand_dequant(self, scales: torch.Tensor, groups: Groups, out_v: torch.Tensor) -> object:
        """:meth:`decode_host`'s dequantization of a lossless blob's codes planned for the C call that
        expands its payload, taken where :meth:`decode_host` would take it (the codes dequantized while
        that call has them in cache): a plan holding no tensor, whose ``args(scales, out_v)`` give
        :func:`kvcodec.backends.lossless_expand`'s ``deq`` for any scales and ``out_v`` alike in what
        was checked (their dtypes, shapes and layouts)."""
        raise self._none("expand_dequant")

    def scatter_rows(self, src: torch.Tensor, cache: torch.Tensor, col: int, runs: np.ndarray) -> Served:
        """``src`` ``[T, H, D]`` rows into columns ``col .. col + D`` of a ``[N, H, S, C]`` cache view, by
        ``runs`` (int64 ``(block, first slot, first token, tokens)`` rows)."""
        raise self._none("scatter_rows")

    def scatter_blob_rows_many(
        self, writes: Sequence[tuple[BlobRows, torch.Tensor, int | None]], v_col: int, runs: np.ndarray
    ) -> list[Served | Declined]:
        """Each ``(rows, cache, crc)``: the blob's K rows to columns ``0 ..`` and V dequantized to ``v_col ..``
        of the cache view, one pass over ``runs``; per layer a :class:`Served` (its ``crc`` continued over
        K and the codes from the given seed) or the :class:`Declined` it met (nothing written there)."""
        return [self._none("scatter_blob_rows_many") for _ in writes]

    def split_k_planes(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A 16-bit ``[T, H, D]`` K's byte planes of the lossless payload on K's device: the high plane
        ``[H, D, T]`` and the low plane ``[T, H, D]``, each flat uint8 (``docs/FORMAT.md``)."""
        raise self._none("split_k_planes")

    def merge_k_planes(self, hi: torch.Tensor, lo: torch.Tensor, out_k: torch.Tensor) -> torch.Tensor:
        """``out_k`` (16-bit ``[T, H, D]``) written from K's planes on its device (the reverse of
        :meth:`split_k_planes`, bit for bit); returns ``out_k``."""
        raise self._none("merge_k_planes")


class TwoPass(Lanes):
    """``encode_v`` and ``encode_kv`` from a backend's scales and quantize steps (two passes over V),
    for backends whose kernels are separate: the torch reference and the unfused Triton path."""

    def scales(self, v: torch.Tensor, groups: Groups, nonfinite: NonFinitePolicy) -> torch.Tensor:
        """fp32 scales of ``v`` (NaN/Inf groups refused or skipped per ``nonfinite``)."""
        raise NotImplementedError

    def quantize(
        self, v: torch.Tensor, scales: torch.Tensor, groups: Groups, *, out: torch.Tensor
    ) -> torch.Tensor:
        """FP8 codes of ``v`` with the given scales."""
        raise NotImplementedError

    def encode_v(
        self,
        v: torch.Tensor,
        groups: Groups,
        *,
        scale_dtype: torch.dtype,
        nonfinite: NonFinitePolicy,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Scales (as stored) and FP8 codes of ``v``; the codes use the stored scales, as LMCache's do."""
        scales = narrow_scales(self.scales(v, groups, nonfinite), scale_dtype, groups.scope)
        self.quantize(v, scales, groups, out=out)
        return scales

    def encode_kv(
        self,
        k: torch.Tensor,
        k_out: torch.Tensor,
        v: torch.Tensor,
        groups: Groups,
        *,
        scale_dtype: torch.dtype,
        nonfinite: NonFinitePolicy,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """K copied into ``k_out`` (on the calling thread), then :meth:`encode_v`."""
        copy_tensor(k_out, k)
        return self.encode_v(v, groups, scale_dtype=scale_dtype, nonfinite=nonfinite, out=out)
