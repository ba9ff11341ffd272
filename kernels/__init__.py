"""Triton kernels of kvcodec, installed as ``kvcodec.kernels``.

Importing this package does not import Triton; each kernel module does, and
is only loaded when the Triton backend is asked for:

* :mod:`kvcodec.kernels.quant_triton`: scales, FP8 quantize/dequantize and
  the fused chunk encode/decode (one or all layers per launch), bit-exact
  with :mod:`kvcodec.quant`.
* :mod:`kvcodec.kernels.paged_triton`: vLLM paged-cache gather/scatter and
  the fused paged encode/decode, bit-exact with :mod:`kvcodec.paged`.

Kernels run on CUDA tensors, or on CPU tensors in Triton's interpreter when
``TRITON_INTERPRET=1`` is set before they are first imported.
"""

from __future__ import annotations

import importlib.util

__all__ = ["triton_installed"]


def triton_installed() -> bool:
    """True when Triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None
