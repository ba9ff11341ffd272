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

Beyond the interface, a backend may offer one optional lane the codec uses
when present: ``encode_fused`` (Triton: K, codes and scales of a blob in one
launch) or ``encode_host`` (cpu: the same into a host blob in one C call, with
numpy views only, so an encode releases the GIL once). A lane declines like
any call, and the codec then takes the interface's path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..hostmem import copy_tensor
from ..numerics import NonFinitePolicy, ScaleScope, narrow_scales

__all__ = ["Backend", "Declined", "Groups", "NonFinitePolicy", "TwoPass"]


class Declined(Exception):
    """Raised by a backend that cannot serve a call; the dispatcher runs the reference instead."""


@dataclass(frozen=True)
class Groups:
    """How V's elements are grouped under one scale, and the FP8 format they are cast to."""

    scope: ScaleScope
    """PER_TENSOR, PER_LAYER_HEAD or PER_PAGE_HEAD (external scales take the scope of their shape)."""
    page_size: int | None = None
    """Tokens per page (PER_PAGE_HEAD only; a partial last page is its own group)."""
    fp8_dtype: torch.dtype = torch.float8_e4m3fn


@runtime_checkable
class Backend(Protocol):
    """Scales, FP8 codes and dequantized V, bit-exact with the reference (``backend="torch"``)."""

    name: str

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


class TwoPass:
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
