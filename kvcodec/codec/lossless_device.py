"""The lossless payload's K byte planes on the device: split there for the host's Huffman stage, merged
there from the planes the host decoded.

The lossless stage (:mod:`.lossless`) splits a 16-bit K into its high plane (``[H, D, T]``, Huffman
coded) and low plane (``[T, H, D]``, raw) on the host. When K lives on a GPU these helpers do the
split and merge with the Triton backend's ``split_k_planes`` / ``merge_k_planes`` lanes
(:mod:`kvcodec.kernels.planes_triton`), so the planes, not K, cross between device and host and the
host never transposes. The entropy stage stays a CPU stage (docs/kernels.md, "The Triton kernels").

Each helper returns None / False when no device lane takes the call (a CPU tensor, another dtype, no
Triton): the caller then does the host path it has always done.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from .. import backends
from .lossless import split_planes

__all__ = ["merge_on_device", "split_host", "split_to_host"]


def _lane_backend(device: torch.device, backend: str | None, lane: str) -> backends.Backend | None:
    """The backend that offers ``lane`` on ``device``, or None (a CPU tensor with no backend named, or a
    backend without the lane: the host path then, nothing declined to count)."""
    if device.type == "cpu" and backend is None:
        return None
    be = backends.select(backend, device)
    return be if lane in be.lanes else None


def split_to_host(k: torch.Tensor, *, backend: str | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """``k``'s (``[T, H, D]`` fp16/bf16) high and low planes split on its device and copied into new
    host arrays (flat uint8, what the host stage codes), or None when no device lane took ``k``."""
    be = _lane_backend(k.device, backend, "split_k_planes")
    if be is None:
        return None
    got = backends.call(be, "split_k_planes", k, fallback=lambda: None)
    if got is None:
        return None
    hi_dev, lo_dev = got
    hi, lo = np.empty(hi_dev.numel(), np.uint8), np.empty(lo_dev.numel(), np.uint8)
    torch.from_numpy(hi).copy_(hi_dev)
    torch.from_numpy(lo).copy_(lo_dev)
    return hi, lo


def split_host(k: torch.Tensor, k_dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray] | None:
    """A CPU ``k``'s (``[T, H, D]``, C-contiguous, ``k_dtype``: the blob's K) planes split from its own
    bytes, so an encode need not copy K into the plain blob first; None for any other ``k``. The planes lie
    in this thread's reused plane buffer (:func:`~.lossless.encode_planes`): code them before anything
    else in this thread uses it."""
    if k.device.type != "cpu" or k.dtype != k_dtype or k.element_size() != 2 or not k.is_contiguous():
        return None
    if k.dim() != 3 or k.requires_grad:
        return None
    return split_planes(k.view(torch.uint8).numpy(), *k.shape, reuse=True)


def _host_bytes(buf: Any, n: int) -> torch.Tensor:
    """The first ``n`` bytes of host buffer ``buf`` as a CPU uint8 tensor, without a copy (only read)."""
    arr = np.frombuffer(buf, np.uint8, n)
    with warnings.catch_warnings():  # a read-only buffer: the tensor is only copied from
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def merge_on_device(hi: Any, lo: Any, out_k: torch.Tensor, *, backend: str | None = None) -> bool:
    """``out_k`` (``[T, H, D]`` fp16/bf16, any strides) written from host planes ``hi`` (``[H, D, T]``)
    and ``lo`` (``[T, H, D]``), buffers of at least ``T*H*D`` bytes, merged on ``out_k``'s device.

    False when no device lane took it (nothing written: the caller merges on the host)."""
    be = _lane_backend(out_k.device, backend, "merge_k_planes")
    if be is None:
        return False
    n = out_k.numel()
    planes = torch.empty(2 * n, dtype=torch.uint8, device=out_k.device)
    planes[:n].copy_(_host_bytes(hi, n))
    planes[n:].copy_(_host_bytes(lo, n))
    return (
        backends.call(be, "merge_k_planes", planes[:n], planes[n:], out_k, fallback=lambda: None) is not None
    )
