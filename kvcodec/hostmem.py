"""Host memory: copies of CPU tensors and byte buffers that stay on the calling thread, and blob buffers.

torch's CPU copy splits large tensors over its OpenMP team, and GNU OpenMP
gives every new calling thread a team of its own: a connector's pool of N
threads would grow the process by N teams. numpy's copy is single-threaded
and releases the GIL, so a caller's pool scales across chunks instead.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import torch

__all__ = [
    "buffer_address",
    "byte_span",
    "copy_bytes",
    "copy_scale_bytes",
    "copy_tensor",
    "filled_bytes",
    "new_buffer",
    "overlaps_buffer",
    "owned_copy",
]

try:
    from ._cpu import bytes_to_fill as _bytes_to_fill  # type: ignore[attr-defined]
    from ._cpu import empty_bytearray as _empty_bytearray  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - the extension is optional
    _empty_bytearray = bytearray
    _bytes_to_fill = None

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_NUMPY_NATIVE = (
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
)


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of ``t``'s memory (any strides), through an integer dtype of the same size when
    numpy lacks ``t``'s dtype (a torch ``view``: one more GIL release, so only then)."""
    return t.numpy() if t.dtype in _NUMPY_NATIVE else t.view(_INT_OF_SIZE[t.element_size()]).numpy()


def copy_scale_bytes(dst: torch.Tensor, scales: torch.Tensor) -> None:
    """The scales' bytes (row-major) into the uint8 tensor ``dst`` of the same size."""
    if dst.device.type == "cpu" and scales.device.type == "cpu" and scales.dtype in _NUMPY_NATIVE:
        src = np.ascontiguousarray(scales.numpy()).reshape(-1).view(np.uint8)
        dst.numpy()[:] = src
        return
    dst.copy_(scales.contiguous().reshape(-1).view(torch.uint8).to(dst.device))


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-shape, same-itemsize tensors; bit-exact, one thread on CPU."""
    if dst.device.type != "cpu" or src.device.type != "cpu" or dst.element_size() != src.element_size():
        dst.copy_(src)
        return
    if dst.numel():
        d, s_ = _np(dst), _np(src)
        np.copyto(d, s_ if s_.dtype == d.dtype else s_.view(d.dtype), casting="no")


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` for equal-length byte views, GIL released for large buffers."""
    if len(src):
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def new_buffer(n: int) -> bytearray:
    """A bytearray of ``n`` bytes that the caller fills entirely (not zeroed when the C extension is built)."""
    return _empty_bytearray(n)


def filled_bytes(n: int, fill: Callable[[memoryview], None]) -> bytes:
    """A new ``bytes`` of ``n`` bytes written by ``fill(view)``, with no final copy when the C
    extension is built (the writable view lives only during ``fill``; do not keep it)."""
    if _bytes_to_fill is None:
        buf = bytearray(n)
        fill(memoryview(buf))
        return bytes(buf)
    out, view = _bytes_to_fill(n)
    try:
        fill(view)
    finally:
        view.release()
    return out


def owned_copy(src: memoryview) -> memoryview:
    """A writable copy of ``src`` (a new bytearray's view)."""
    out = memoryview(new_buffer(len(src)))
    copy_bytes(out, src)
    return out


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) addresses ``t``'s elements can touch (its whole strided extent; ``t`` non-empty).

    A contiguous tensor spans exactly its bytes: that common case skips the per-dimension sum."""
    lo = t.data_ptr()
    if t.is_contiguous():
        return lo, lo + t.numel() * t.element_size()
    return lo, lo + (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def buffer_address(buf: memoryview) -> int:
    """Address of the first byte of a non-empty, C-contiguous byte view (about 2 µs: compute it
    once per buffer and hand it to :func:`overlaps_buffer` as ``base``)."""
    if not buf.readonly:  # ctypes takes a writable buffer and is four times quicker than numpy
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return np.frombuffer(buf, np.uint8).ctypes.data


def overlaps_buffer(t: torch.Tensor | None, buf: memoryview, base: int | None = None) -> bool:
    """Whether ``t``'s memory range intersects ``buf``'s. Pointers are compared whatever ``t``'s
    device: host and device addresses share one virtual space under CUDA's unified addressing.
    ``base`` is ``buffer_address(buf)`` when the caller already has it (one address, many tensors)."""
    if t is None or not t.numel() or not len(buf):
        return False
    if base is None:
        base = buffer_address(buf)
    lo, hi = byte_span(t)
    return lo < base + len(buf) and base < hi
