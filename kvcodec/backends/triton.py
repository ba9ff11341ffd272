"""The Triton backend: :mod:`kvcodec.kernels` behind the one backend interface.

Imported only when chosen, so ``import kvcodec`` never imports Triton. Beyond
the interface it offers the fused encode (K, FP8 V and scales of one or all
layers of a chunk in one launch), which the codec uses when it applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .base import Groups, NonFinitePolicy, TwoPass

__all__ = ["BACKEND", "TritonBackend"]


def _kernels() -> Any:
    from ..kernels import quant_triton

    return quant_triton


class TritonBackend(TwoPass):
    """Scales, FP8 codes and dequantization as Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""

    name = "triton"

    def scales(self, v: torch.Tensor, groups: Groups, nonfinite: NonFinitePolicy) -> torch.Tensor:
        """fp32 scales of ``v``."""
        g = groups
        return _kernels().compute_scales(v, g.scope, page_size=g.page_size, fp8_dtype=g.fp8_dtype, nonfinite=nonfinite)

    def quantize(self, v: torch.Tensor, scales: torch.Tensor, groups: Groups, *, out: torch.Tensor) -> torch.Tensor:
        """FP8 codes of ``v`` with the caller's scales."""
        g = groups
        return _kernels().quantize(v, scales, g.scope, page_size=g.page_size, fp8_dtype=g.fp8_dtype, out=out)

    def dequantize(
        self, q: torch.Tensor, scales: torch.Tensor, groups: Groups, *, out: torch.Tensor
    ) -> torch.Tensor:
        """``float(q) * scale`` into ``out``."""
        g = groups
        return _kernels().dequantize(q, scales, g.scope, page_size=g.page_size, out_dtype=out.dtype, out=out)

    def encode_fused(self, k: torch.Tensor, v: torch.Tensor, groups: Groups, payload: torch.Tensor) -> torch.Tensor:
        """K, FP8 V and fp32 scales of one layer into ``payload`` in one launch; returns the group absmax."""
        g = groups
        return _kernels().encode_fused(k, v, g.scope, page_size=g.page_size, fp8_dtype=g.fp8_dtype, payload=payload)

    def encode_fused_layers(
        self, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], groups: Groups, payloads: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`encode_fused` for every layer of a chunk in one launch; returns ``[L, *scale_shape]`` absmax."""
        g = groups
        return _kernels().encode_fused_layers(
            ks, vs, g.scope, page_size=g.page_size, fp8_dtype=g.fp8_dtype, payloads=payloads
        )


BACKEND = TritonBackend()
