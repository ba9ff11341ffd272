"""The Triton backend: :mod:`kvcodec.kernels` behind the one backend interface.

Imported only when chosen, so ``import kvcodec`` never imports Triton (this
module imports the kernels' torch-only host side, :mod:`kvcodec.kernels.operands`;
the kernel modules, which import Triton, load on the first call). Beyond the
interface it offers the fused encode (K, FP8 V and scales of one or all
layers of a chunk in one launch), which the codec uses when it applies, and
the fused gather+encode / decode+scatter over vLLM cache views that
:mod:`kvcodec.codec.chunk_blobs` builds blobs around.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..format import ScaleScope
from ..kernels.launch import INTERPRET, is_recording
from ..kernels.operands import PAYLOAD_ALIGN, PLANE_DTYPES, check_scope, empty_payloads
from .base import Declined, Groups, NonFinitePolicy, TwoPass

__all__ = ["BACKEND", "PAYLOAD_ALIGN", "PLANE_DTYPES", "TritonBackend"]


def _quant() -> Any:
    from ..kernels import quant_triton

    return quant_triton


def _dequant() -> Any:
    from ..kernels import dequant_triton

    return dequant_triton


def _fused() -> Any:
    from ..kernels import fused_triton

    return fused_triton


def _vllm() -> Any:
    from ..kernels import vllm_triton

    return vllm_triton


def _planes() -> Any:
    from ..kernels import planes_triton

    return planes_triton


class TritonBackend(TwoPass):
    """Scales, FP8 codes and dequantization as Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""

    name = "triton"
    lanes = frozenset(
        {"encode_fused", "encode_fused_layers", "empty_payloads", "split_k_planes", "merge_k_planes"}
    )

    def scales(self, v: torch.Tensor, groups: Groups, nonfinite: NonFinitePolicy) -> torch.Tensor:
        """fp32 scales of ``v``."""
        g = groups
        return _quant().compute_scales(
            v, g.scope, page_size=g.page_size, fp8_dtype=g.fp8_dtype, nonfinite=nonfinite
        )

    def quantize(
        self, v: torch.Tensor, scales: torch.Tensor, groups: Groups, *, out: torch.Tensor
    ) -> torch.Tensor:
        """FP8 codes of ``v`` with the caller's scales."""
        g = groups
        return _quant().quantize(v, scales, g.scope, page_size=g.page_size, fp8_dtype=g.fp8_dtype, out=out)

    def dequantize(
        self, q: torch.Tensor, scales: torch.Tensor, groups: Groups, *, out: torch.Tensor
    ) -> torch.Tensor:
        """``float(q) * scale`` into ``out``."""
        g = groups
        return _dequant().dequantize(q, scales, g.scope, page_size=g.page_size, out_dtype=out.dtype, out=out)

    # Fused lane: the codec's encode / encode_layers.

    def empty_payloads(self, layers: int, nbytes: int, device: torch.device | str) -> torch.Tensor:
        """Stacked ``[layers, nbytes]`` payloads whose rows start 16 bytes apart (the fused kernels' wide stores)."""
        return empty_payloads(layers, nbytes, device)

    def encode_fused(
        self, k: torch.Tensor, v: torch.Tensor, groups: Groups, payload: torch.Tensor
    ) -> torch.Tensor:
        """K, FP8 V and fp32 scales of one layer into ``payload`` in one launch; returns the group absmax."""
        g = groups
        return _fused().encode_fused(
            k, v, g.scope, page_size=g.page_size, fp8_dtype=g.fp8_dtype, payload=payload
        )

    def encode_fused_layers(
        self, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], groups: Groups, payloads: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`encode_fused` for every layer of a chunk in one launch; returns ``[L, *scale_shape]`` absmax."""
        g = groups
        return _fused().encode_fused_layers(
            ks, vs, g.scope, page_size=g.page_size, fp8_dtype=g.fp8_dtype, payloads=payloads
        )

    # vLLM-view lane: kvcodec.codec.chunk_blobs.

    def check_scope(self, scope: ScaleScope, page_size: int | None) -> ScaleScope:
        """``scope`` as a scope the kernels compute scales for (:class:`UnsupportedConfigError` otherwise)."""
        return check_scope(scope, page_size)

    def prepare_views(self, layers: Sequence[torch.Tensor] | Any, head_size: int) -> Any:
        """The kernels' addressing of vLLM 0.33 layer views (a ``CacheViews`` passes through, checked)."""
        return _vllm().as_views(layers, head_size)

    def gather_encode_layers(self, views: Any, block_ids: Any, **kw: Any) -> torch.Tensor:
        """Every layer's payload of a chunk straight from the views; returns the absmax ``[L, *scale_shape]``."""
        return _vllm().gather_encode_layers(views, block_ids, **kw)

    # Planes lane: the lossless payload's K byte planes (kvcodec.codec.lossless_device).

    def _planes_ok(self, *ts: torch.Tensor) -> None:
        """Decline unless the kernels can take these tensors (a 16-bit K, one device they run on)."""
        k = ts[0]
        if k.dtype not in PLANE_DTYPES or k.dim() != 3:
            raise Declined(f"K's planes need a [T, H, D] fp16/bf16 K; got {k.dtype} {tuple(k.shape)}")
        if any(t.device != k.device for t in ts) or (k.device.type == "cpu" and not INTERPRET):
            raise Declined(f"K's planes on the device: tensors on {sorted({str(t.device) for t in ts})}")

    def split_k_planes(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K's high plane ``[H, D, T]`` and low plane ``[T, H, D]`` (flat uint8) on K's device, one launch."""
        self._planes_ok(k)
        return _planes().split_k_planes(k)

    def merge_k_planes(self, hi: torch.Tensor, lo: torch.Tensor, out_k: torch.Tensor) -> torch.Tensor:
        """``out_k`` written from K's planes (on its device) in one launch; returns ``out_k``."""
        self._planes_ok(out_k, hi, lo)
        return _planes().merge_k_planes(hi, lo, out_k)

    def writes_host_memory(self, device: torch.device) -> bool:
        """True when launches on ``device`` write host tensors directly (the interpreter; not while recording)."""
        return device.type == "cpu" and not is_recording()


BACKEND = TritonBackend()
