"""Any buffer-like input as a flat, C-contiguous memoryview of bytes, or a CodecError."""

from __future__ import annotations

import sys
from typing import Any

from ..errors import Reason, UnsupportedConfigError

__all__ = ["as_bytes_view"]


def _tensor_bytes(buf: Any) -> Any:
    """A CPU tensor's bytes as a numpy array (no copy). torch is already imported if one is passed."""
    torch = sys.modules["torch"]
    try:
        if buf.is_nested or buf.layout != torch.strided or buf.device.type != "cpu":
            raise UnsupportedConfigError(
                f"a tensor blob must be a dense CPU tensor; got layout {buf.layout} on {buf.device}",
                reason=Reason.BAD_BUFFER,
            )
        if not buf.is_contiguous():
            raise UnsupportedConfigError("a tensor blob must be contiguous", reason=Reason.BAD_BUFFER)
        return buf.detach().reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError, ValueError) as e:
        raise UnsupportedConfigError(
            f"cannot read the bytes of this tensor: {e}", reason=Reason.BAD_BUFFER
        ) from None


def as_bytes_view(buf: Any) -> memoryview:
    """``buf`` (bytes, bytearray, memoryview, mmap, numpy array, CPU tensor) as bytes, without a copy."""
    if type(buf).__module__.startswith("torch") and "torch" in sys.modules:
        if isinstance(buf, sys.modules["torch"].Tensor):
            buf = _tensor_bytes(buf)
    try:
        mv = buf if type(buf) is memoryview else memoryview(buf)
        if not mv.c_contiguous:
            raise UnsupportedConfigError(
                f"buffer must be C-contiguous; got a strided {type(buf).__name__}", reason=Reason.BAD_BUFFER
            )
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        len(mv)  # a released view raises here
    except UnsupportedConfigError:
        raise
    except (TypeError, ValueError, BufferError, NotImplementedError) as e:
        raise UnsupportedConfigError(
            f"expected a bytes-like buffer, got {type(buf).__name__} ({e})", reason=Reason.BAD_BUFFER
        ) from None
    return mv
